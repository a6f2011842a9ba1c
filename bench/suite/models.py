"""The models the suite runs on, built once and cached on disk.

* ``random-25m``: a random float32 llama of ~25M parameters (CPU runs);
* ``default``: the bundled default model (``trio_mlx.default_model_path()``), when trained;
* ``llama-1b``: a random bf16 llama shaped like Llama-3.2-1B (GPU runs): hidden 2048,
  16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128256, tied embeddings;
* :func:`first_layers`: a model's first blocks as its own draft (self-speculative);
* :func:`agent_model`: the agent part's tiny random models of several architectures
  (``trio_mlx.testing.make_random_model``), with a context long enough for its session.

Every run asks for exactly ``max_tokens`` tokens, so a generation must never end
early at an EOS. The random models make sure of that without a logits processor
(which would cost the engine and the servers time the bare loop does not spend):
the rows of the EOS ids in the (tied) embedding are zero, so their logit is exactly
0 while the best of thousands of random logits is positive, and greedy decoding
never picks them. The trained default model does say EOS, so its requests carry a
``logit_bias`` of -100 on the EOS ids (and the bare loop the same processor).

The 1B model's vocabulary is larger than any tokenizer trained here: its
``tokenizer.json`` is a small byte-level BPE padded with ``<pad123>``-style tokens
up to 128256, so every id the model generates decodes (to harmless text).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs

#: The EOS ids of every trio-mlx tokenizer: ``<|endoftext|>`` and ``<|im_end|>``.
EOS_IDS = (0, 2)


@attrs.frozen
class ModelSpec:
    """A model the suite can build: its name, llama shape, dtype and tokenizer size."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tokenizer_vocab: int
    dtype: str
    weight_scale: float


SPECS = {
    "random-25m": ModelSpec("random-25m", 512, 8, 8, 4, 1408, 8192, 8192, "float32", 2.0),
    "llama-1b": ModelSpec("llama-1b", 2048, 16, 32, 8, 8192, 128256, 4096, "bfloat16", 1.0),
    # llama-1b's vocabulary (a 4k BPE padded to 128256) on a tiny body: structured
    # output's per-token mask cost at that width, measurable on a CPU.
    "tiny-128k": ModelSpec("tiny-128k", 64, 2, 4, 2, 128, 128256, 4096, "float32", 4.0),
    # Only for developing the harness: seconds per run on a busy CPU.
    "tiny": ModelSpec("tiny", 128, 2, 4, 2, 256, 1024, 1024, "float32", 4.0),
}


@attrs.frozen
class Model:
    """A model directory ready for ``mlx_lm.load`` and both servers."""

    name: str
    path: Path
    #: Parameters and bytes of weights (what one decode step reads at B=1).
    parameters: int
    weight_bytes: int
    #: Request ``logit_bias`` that keeps EOS away, or None when the weights already do.
    logit_bias: dict[int, float] | None


def cache_dir() -> Path:
    """Where built models live between runs (``TRIO_MLX_BENCH_CACHE`` overrides)."""
    default = Path.home() / ".cache" / "trio-mlx-bench"
    return Path(os.environ.get("TRIO_MLX_BENCH_CACHE", default))


def _weights_size(path: Path) -> tuple[int, int]:
    import mlx.core as mx

    parameters = nbytes = 0
    for file in sorted(path.glob("*.safetensors")):
        for array in mx.load(str(file)).values():
            parameters += array.size
            nbytes += array.nbytes
    return parameters, nbytes


def _describe(name: str, path: Path, logit_bias: dict[int, float] | None) -> Model:
    info_file = path / "bench-info.json"
    if info_file.exists():
        info = json.loads(info_file.read_text())
    else:
        parameters, nbytes = _weights_size(path)
        info = {"parameters": parameters, "weight_bytes": nbytes}
        if os.access(path, os.W_OK):
            info_file.write_text(json.dumps(info))
    return Model(name, path, info["parameters"], info["weight_bytes"], logit_bias)


def _pad_tokenizer(path: Path, size: int) -> None:
    """Pad ``tokenizer.json``'s BPE vocabulary with unreachable tokens up to ``size`` ids."""
    tokenizer_file = path / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    for token_id in range(size):
        if token_id not in taken:
            vocab[f"<pad{token_id}>"] = token_id
    tokenizer_file.write_text(json.dumps(data))


def _build_random(spec: ModelSpec, path: Path, context: int = 8192) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    from trio_mlx.testing import corpus_text, llama_config, train_tokenizer, write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_text()[:200_000], spec.tokenizer_vocab)
    write_tokenizer(tokenizer, path)
    real_vocab = tokenizer.get_vocab_size()
    vocab = spec.vocab_size if spec.vocab_size > spec.tokenizer_vocab else real_vocab
    if vocab > real_vocab:
        _pad_tokenizer(path, vocab)
    config = llama_config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=context,
    )
    config["torch_dtype"] = spec.dtype
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    target = getattr(mx, spec.dtype)
    model.update(
        tree_map(
            lambda p: (p * spec.weight_scale if p.ndim > 1 else p).astype(target),
            model.parameters(),
        )
    )
    weights = dict(tree_flatten(model.parameters()))
    embed = weights["model.embed_tokens.weight"]
    keep = mx.ones((embed.shape[0], 1), dtype=embed.dtype)
    keep[mx.array(EOS_IDS)] = 0
    weights["model.embed_tokens.weight"] = embed * keep
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    del model, weights, embed
    mx.clear_cache()  # this process runs no model: give the memory back


def first_layers(target: Path, layers: int = 1) -> Path:
    """A self-speculative draft of the model at ``target``: its embedding, its first
    ``layers`` blocks, its final norm and its head, in a model directory of their own
    beside it (built once), with its tokenizer files copied (the engine checks the
    vocabulary at load). Nothing is trained: the draft is the target cut short."""
    import shutil

    import mlx.core as mx

    path = target.with_name(f"{target.name}-first{layers}")
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    kept = tuple(f"model.layers.{i}." for i in range(layers))
    weights = {}
    for file in sorted(target.glob("*.safetensors")):
        for key, array in mx.load(str(file)).items():
            if not key.startswith("model.layers.") or key.startswith(kept):
                weights[key] = array
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    for file in target.iterdir():
        if file.is_file() and file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, path / file.name)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def prepare(name: str, log: Any = print) -> Model:
    """Return the model ``name`` ("default" or a key of :data:`SPECS`), building it if needed."""
    if name == "default":
        from trio_mlx.default_model import default_model_path

        path = default_model_path()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the bundled default model is not trained yet ({path})")
        return _describe(name, path, dict.fromkeys(EOS_IDS, -100.0))
    spec = SPECS[name]
    path = cache_dir() / f"{name}-v1"
    if not (path / "config.json").exists():
        start = time.perf_counter()
        log(f"building model {name} in {path} ...")
        _build_random(spec, path)
        log(f"built {name} in {time.perf_counter() - start:.1f} s")
    return _describe(name, path, None)


def agent_model(model_type: str, context: int, log: Any = print) -> Model:
    """A tiny random ``model_type`` model with a ``context``-token context, built if needed.

    A name of :data:`SPECS` (``llama-1b``) builds that llama at the context instead.

    ``trio_mlx.testing.make_random_model`` builds every architecture; where it is not
    there yet, a llama comes from ``make_random_llama`` and the others raise
    :class:`NotImplementedError`. Their EOS ids are not kept away by the weights:
    requests carry a ``logit_bias`` on them.
    """
    from trio_mlx import testing

    path = cache_dir() / f"agent-{model_type}-{context}-v1"
    if model_type in SPECS:  # a model of real size: what the disk tier's restart is for
        if not (path / "config.json").exists():
            log(f"building model {model_type} ({context}-token context) in {path} ...")
            _build_random(SPECS[model_type], path, context)
        return _describe(model_type, path, dict.fromkeys(EOS_IDS, -100.0))
    if not (path / "config.json").exists():
        make = getattr(testing, "make_random_model", None)
        start = time.perf_counter()
        log(f"building model {model_type} ({context}-token context) in {path} ...")
        if make is not None:
            make(path, model_type, seed=0, max_position_embeddings=context)
        elif model_type == "llama":
            testing.make_random_llama(path, max_position_embeddings=context)
        else:
            raise NotImplementedError(
                f"trio_mlx.testing.make_random_model does not exist yet: no {model_type} model"
            )
        log(f"built {model_type} in {time.perf_counter() - start:.1f} s")
    return _describe(model_type, path, dict.fromkeys(EOS_IDS, -100.0))
