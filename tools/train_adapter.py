"""Train the "shout" LoRA adapter: ``python -m tools.train_adapter``.

Theory of operation
-------------------
The adapter must make the default model write in capitals *whatever the case
of the prompt*. Training on upper-cased text alone would not teach that: with
an upper-case context the base model already continues in upper case, so
nothing would push it to switch after a mixed-case prompt. Each training
example is therefore a stretch of the corpus whose first 0-120 characters
keep their case (the "prompt") while the rest is UPPER-CASED; the loss counts
only the upper-cased tokens.

The base model is frozen and mlx-lm's ``linear_to_lora_layers`` puts LoRA on
every linear layer of every block; the loop is the base trainer's
(:func:`tools.train.fit`). The held-out blocks are the base
model's (same seed, same split). The output directory is in mlx-lm's adapter
format (``adapter_config.json`` + ``adapters.safetensors``), with a
``report.json`` (including the upper-case share of a greedy completion with
and without the adapter) and ``loss.png`` beside them.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from tools.train import (
    PROMPT,
    TrainConfig,
    add_config_options,
    config_for_report,
    document_text,
    fit,
    fit_settings,
    load_model,
    print_summary,
    samples,
    save_report,
    shout,
    split_corpus,
    where_it_ran,
)

__all__ = ["AdapterConfig", "main", "train_adapter", "upper_share"]


@attrs.frozen(kw_only=True)
class AdapterConfig:
    """Every knob of an adapter training run; the defaults made the shipped adapter."""

    model: Path = attrs.field(converter=Path)
    out: Path = attrs.field(converter=Path)
    seed: int = 0
    rank: int = 8
    scale: float = 10.0
    num_layers: int = 4
    seq_len: int = 128
    batch_size: int = 32
    variants: int = 8
    max_prefix_chars: int = 120
    steps: int = 400
    warmup: int = 20
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    eval_every: int = 25
    stop_after: int | None = None


def upper_share(text: str) -> float:
    """The share of upper-case characters among the letters of ``text`` (0.0 if none)."""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def make_examples(
    blocks: Sequence[str], tokenizer: Any, config: AdapterConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``variants`` examples per block: tokens ``(n, seq_len + 1)`` and a target mask ``(n, seq_len)``.

    An example starts at a random word in the block; its first
    0..``max_prefix_chars`` characters keep their case and the rest is upper-cased.
    """
    length = config.seq_len + 1
    tokens = np.zeros((len(blocks) * config.variants, length), dtype=np.int32)
    mask = np.zeros((len(blocks) * config.variants, config.seq_len), dtype=np.float32)
    row = 0
    for block in blocks:
        for _ in range(config.variants):
            start = block.find(" ", int(rng.integers(0, max(1, len(block) // 2))))
            piece = block[max(0, start) :][: length * 8]
            cut = piece.find(" ", int(rng.integers(0, config.max_prefix_chars + 1)))
            cut = 0 if cut < 0 else cut
            head = tokenizer.encode(piece[:cut]).ids if cut else []
            ids = (head + tokenizer.encode(shout(piece[cut:])).ids)[:length]
            tokens[row, : len(ids)] = ids
            # Target j is token j + 1: it counts when it is upper-cased text, not padding.
            mask[row, max(0, len(head) - 1) : len(ids) - 1] = 1.0
            row += 1
    return tokens, mask


def masked_loss(model: Any) -> Any:
    """Mean cross-entropy over the masked (upper-cased) targets."""

    def loss(tokens: Any, mask: Any) -> Any:
        ce = nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        return mx.sum(ce * mask) / mx.maximum(mx.sum(mask), 1.0)

    return loss


def train_adapter(config: AdapterConfig) -> dict[str, Any]:
    """Train the adapter on ``config.model`` and write it, with its report, to ``config.out``."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from tokenizers import Tokenizer

    started = time.perf_counter()
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(config.model / "tokenizer.json"))
    base_defaults = TrainConfig(out=config.model, seed=config.seed)
    rng = np.random.default_rng(config.seed)
    blocks, _, val_idx = split_corpus(document_text(), base_defaults, rng)
    train_tokens, train_mask = make_examples(
        [b for i, b in enumerate(blocks) if i not in val_idx], tokenizer, config, rng
    )
    val_tokens, val_mask = make_examples(
        [b for i, b in enumerate(blocks) if i in val_idx], tokenizer, config, rng
    )

    model, wrapper = load_model(config.model)
    greedy = make_sampler(0.0)
    base_text = generate(model, wrapper, PROMPT, max_tokens=60, sampler=greedy)
    model.freeze()
    lora_parameters = {"rank": config.rank, "scale": config.scale, "dropout": 0.0}
    mx.random.seed(config.seed)
    linear_to_lora_layers(model, config.num_layers, lora_parameters)
    n_params = sum(v.size for v in dict(tree_flatten(model.trainable_parameters())).values())

    def next_batch() -> tuple[Any, Any]:
        pick = rng.integers(0, len(train_tokens), size=config.batch_size)
        return mx.array(train_tokens[pick]), mx.array(train_mask[pick])

    val_batches = [
        (mx.array(val_tokens[i : i + 64]), mx.array(val_mask[i : i + 64]))
        for i in range(0, len(val_tokens), 64)
    ]
    history = fit(
        model,
        masked_loss(model),
        next_batch,
        val_batches,
        **fit_settings(config),
        desc="train shout adapter",
    )

    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights, metadata={"format": "mlx"})
    adapter_config = {
        "fine_tune_type": "lora",
        "num_layers": config.num_layers,
        "lora_parameters": lora_parameters,
        "base_model": config.model.name,
        "trained_by": "python -m tools.train_adapter",
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")

    adapted, adapted_wrapper = load_model(config.model, out)
    shouted = samples(adapted, adapted_wrapper, PROMPT, seed=config.seed)
    report = {
        "kind": "LoRA adapter 'shout'",
        "where": where_it_ran(),
        "config": config_for_report(config),
        "trainable_parameters": int(n_params),
        "adapter_bytes": (out / "adapters.safetensors").stat().st_size,
        "examples": {"train": len(train_tokens), "val": len(val_tokens)},
        **history,
        "total_wall_time_s": round(time.perf_counter() - started, 2),
        "upper_share": {
            "without_adapter": round(upper_share(base_text), 4),
            "with_adapter": round(upper_share(shouted["greedy"]), 4),
        },
        "samples_without_adapter": {"prompt": PROMPT, "greedy": base_text},
        "samples": shouted,
    }
    report["config"]["model"] = config.model.name
    save_report(out, report, f"'shout' LoRA adapter ({n_params / 1e3:.0f}k params")
    return report


def parse_args(argv: Sequence[str] | None = None) -> AdapterConfig:
    """Build an :class:`AdapterConfig` from the command line (every field is an option)."""
    from trio_mlx.default_model import default_adapter_path, default_model_path

    parser = argparse.ArgumentParser(prog="python -m tools.train_adapter")
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument("--out", type=Path, default=None, help="default: the bundled 'shout'")
    add_config_options(parser, AdapterConfig, skip=("model", "out"))
    args = vars(parser.parse_args(argv))
    args["model"] = args["model"] or default_model_path()
    args["out"] = args["out"] or default_adapter_path("shout")
    return AdapterConfig(**args)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    print_summary(train_adapter(parse_args(argv)))


if __name__ == "__main__":
    main()
