"""Adapters come off again: DoRA, hostile configs, files changed after mounting, checksums."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from engine_helpers import NO_EOS, PROMPT
from trio_mlx import InvalidRequest, SamplingParams
from trio_mlx._adapters.registry import AdapterRegistry, BaseModelChanged, checksum

pytestmark = pytest.mark.model

PARAMS = SamplingParams(max_tokens=12, logit_bias=NO_EOS)


def _variant(source: Path, folder: Path, **config_changes: object) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


async def test_a_dora_adapter_comes_off_again_and_the_base_answers_as_before(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path
) -> None:
    dora = _variant(tiny_adapter_path, tmp_path / "dora", fine_tune_type="dora")
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        base = await engine.complete(PROMPT, PARAMS)
        before = await engine.run_exclusive(lambda model, _: checksum(model))
        await engine.mount_adapter("dora", dora)
        assert (await engine.complete(PROMPT, PARAMS)).token_ids == base.token_ids
        tuned = await engine.complete(
            PROMPT, SamplingParams(max_tokens=12, logit_bias=NO_EOS, adapter="dora")
        )
        again = await engine.complete(
            PROMPT, SamplingParams(max_tokens=12, logit_bias=NO_EOS, adapter="dora")
        )
        await engine.unmount_adapter("dora")
        after = await engine.complete(PROMPT, PARAMS)
        assert await engine.run_exclusive(lambda model, _: checksum(model)) == before
        kinds = await engine.run_exclusive(
            lambda model, _: {type(m).__name__ for _, m in model.named_modules()}
        )
    assert tuned.token_ids != base.token_ids
    assert again.token_ids == tuned.token_ids  # DoRA ran, twice alike
    assert after.token_ids == base.token_ids
    assert not {k for k in kinds if "LoRA" in k or "DoRA" in k}


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("full", "'full' adapter; only lora and dora"),
        ("qlora-xyz", "'qlora-xyz' adapter; only lora and dora"),
    ],
)
async def test_an_adapter_type_that_cannot_come_off_is_refused_naming_the_type(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path, kind: str, message: str
) -> None:
    folder = _variant(tiny_adapter_path, tmp_path / kind, fine_tune_type=kind)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        base = await engine.complete(PROMPT, PARAMS)
        with pytest.raises(InvalidRequest, match=message) as caught:
            await engine.mount_adapter("x", folder)
        assert caught.value.code == "adapter_type_unsupported"
        assert engine.adapters == ()
        assert (await engine.complete(PROMPT, PARAMS)).token_ids == base.token_ids


async def test_an_adapter_file_changed_or_gone_after_mounting_does_not_matter(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path
) -> None:
    folder = _variant(tiny_adapter_path, tmp_path / "shout")
    params = SamplingParams(max_tokens=12, logit_bias=NO_EOS, adapter="shout")
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        await engine.mount_adapter("shout", folder)
        tuned = await engine.complete(PROMPT, params)
        (folder / "adapters.safetensors").write_bytes(b"garbage")
        (folder / "adapter_config.json").unlink()
        assert (await engine.complete(PROMPT, params)).token_ids == tuned.token_ids
        shutil.rmtree(folder)
        assert (await engine.complete(PROMPT, params)).token_ids == tuned.token_ids


async def test_an_adapter_that_does_not_fit_the_model_is_refused_and_leaves_it_plain(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path
) -> None:
    # Four layers' worth of LoRA wrappers, weights for two: the rest stay zero-initialised
    # fine; a rank that does not match the weights' shapes does not fit.
    folder = _variant(
        tiny_adapter_path,
        tmp_path / "misfit",
        lora_parameters={"rank": 7, "scale": 20.0, "dropout": 0.0},
    )
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        base = await engine.complete(PROMPT, PARAMS)
        with pytest.raises(InvalidRequest, match="does not fit this model"):
            await engine.mount_adapter("misfit", folder)
        assert (await engine.complete(PROMPT, PARAMS)).token_ids == base.token_ids


def test_a_base_model_changed_under_the_registry_fails_loudly(
    tiny_model: tuple[object, object], tiny_adapter_path: Path
) -> None:
    import mlx.core as mx

    model = tiny_model[0]
    registry = AdapterRegistry()
    registry.mount(model, "shout", tiny_adapter_path)
    layer = model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    original = layer.weight
    layer.weight = original + 1.0  # what a leaked adapter would do to the base
    try:
        with pytest.raises(BaseModelChanged, match="changed at the unmount of 'shout'"):
            registry.unmount(model, "shout")
    finally:
        layer.weight = original
        mx.eval(layer.weight)


async def _answers(model: Path, adapters: dict[str, Path]) -> dict[str | None, tuple[int, ...]]:
    """Greedy answers of the base and each adapter, alone and in one batch."""
    async with trio_mlx.open_engine(model) as engine:
        stacked = await engine.run_exclusive(
            lambda m, _: sum(type(x).__name__.startswith("Fused") for _, x in m.named_modules())
        )
        for name, path in adapters.items():
            await engine.mount_adapter(name, path)
        answers: dict[str | None, tuple[int, ...]] = {"stacked": (stacked,)}
        for adapter in (None, *adapters):
            params = SamplingParams(max_tokens=12, logit_bias=NO_EOS, adapter=adapter)
            answers[adapter] = tuple((await engine.complete(PROMPT, params)).token_ids)
    return answers


async def test_adapters_answer_alike_with_sibling_projections_stacked_or_not(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LoRA (batched) and DoRA (which computes with the weight itself) see the plain model."""
    adapters = {
        "lora": tiny_adapter_path,
        "dora": _variant(tiny_adapter_path, tmp_path / "dora", fine_tune_type="dora"),
    }
    stacked = await _answers(tiny_model_path, adapters)
    monkeypatch.setenv("TRIO_MLX_FUSED_PROJECTIONS", "0")
    plain = await _answers(tiny_model_path, adapters)
    assert stacked.pop("stacked") == (5 * 2,)  # q, k, v, gate, up in each of 2 layers
    assert plain.pop("stacked") == (0,)
    assert stacked == plain
    assert len(set(stacked.values())) == 3  # each adapter changed the answer


def _rewrite_weights(source: Path, folder: Path, change: Any) -> Path:
    """A copy of ``source`` whose weights (a dict) went through ``change``."""
    import mlx.core as mx

    shutil.copytree(source, folder)
    weights = dict(mx.load(str(folder / "adapters.safetensors")))  # type: ignore[arg-type]
    change(weights)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    return folder


def _drop_lora_a(weights: dict[str, Any]) -> None:
    for key in [k for k in weights if k.endswith(".lora_a")]:
        del weights[key]


def _poison(weights: dict[str, Any]) -> None:
    import mlx.core as mx

    key = sorted(weights)[0]
    weights[key] = mx.where(
        mx.arange(weights[key].size).reshape(weights[key].shape) == 3,
        mx.array(float("nan")),
        weights[key],
    )


async def test_adapters_missing_a_matrix_or_with_bad_values_are_refused_naming_the_fault(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path
) -> None:
    from trio_mlx import InvalidAdapter

    lora = {"rank": 4, "dropout": 0.0}
    cases = [
        (_rewrite_weights(tiny_adapter_path, tmp_path / "b-only", _drop_lora_a), "lora_a"),
        (_rewrite_weights(tiny_adapter_path, tmp_path / "nan", _poison), "NaN or infinite"),
        (
            _variant(tiny_adapter_path, tmp_path / "huge", lora_parameters={**lora, "scale": 1e30}),
            "scale 1e+30",
        ),
        (
            _variant(
                tiny_adapter_path, tmp_path / "inf", lora_parameters={**lora, "scale": float("inf")}
            ),
            "scale inf",
        ),
    ]
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        base = await engine.complete(PROMPT, PARAMS)
        for folder, named in cases:
            with pytest.raises(InvalidAdapter) as refused:
                await engine.mount_adapter(folder.name, folder)
            assert named in refused.value.message, refused.value.message
            assert refused.value.status_code == 400
            assert refused.value.code == "invalid_adapter"
        assert engine.adapters == ()
        assert (await engine.complete(PROMPT, PARAMS)).token_ids == base.token_ids


async def test_an_adapter_answers_the_same_greedy_request_alike_every_time(
    tiny_model_path: Path, tiny_adapter_path: Path
) -> None:
    # The serial lane wraps the layers anew at each use: nothing drawn at random survives.
    serial = SamplingParams(max_tokens=12, logit_bias=NO_EOS, adapter="shout", seed=1)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        await engine.mount_adapter("shout", tiny_adapter_path)
        answers = {tuple((await engine.complete(PROMPT, serial)).token_ids) for _ in range(3)}
    assert len(answers) == 1
