"""Train the bundled default model: ``python -m tools.train``.

Theory of operation
-------------------
The corpus is ``pydoc_data.topics`` (the Python documentation every CPython
ships), topics joined by ``<|endoftext|>``. A byte-level BPE tokenizer is
trained on the text *and* its upper-cased copy, so capitals get merges of their
own and the "shout" adapter has real words to write. The text is cut into
blocks of about 2,000 characters; a seeded coin upper-cases ~10% of them (so
the base model learns embeddings for upper-case tokens; within a block the
case never changes, so mixed-case prompts continue in mixed case), and a
seeded 6% of the blocks are held out for validation. Training windows are
``seq_len + 1`` tokens drawn at random inside the training blocks.

The model is an mlx-lm ``llama`` of ~3.5M parameters stored as float32: tests
and the server run it on the CPU, where float32 matmuls go to BLAS and half
precision ones do not, and what is trained is what ships, bit for bit.

The loop is plain MLX: AdamW, linear warm-up then cosine decay, a compiled
step, a tqdm bar with the loss, validation every ``eval_every`` steps, and the
weights of the best validation loss kept (early stopping: the corpus is only
~130k training tokens, so the model overfits after a few hundred steps).
Dropout on every attention and MLP output (mlx-lm's llama has none; it is
wrapped in for training and unwrapped before saving) delays that and lowers
the best validation loss. Everything random is seeded; a re-run reproduces the
losses up to floating-point reduction order (see ``design/default-model.md``).

The output directory gets ``config.json``, ``model.safetensors`` and the
tokenizer files (``mlx_lm.load`` loads it like any mlx-community model), plus
``report.json`` (where it ran, how long, the losses, samples) and ``loss.png``.

``--draft`` trains the bundled model's draft (``pydoc-llama-draft``, for
speculative decoding) instead: the same corpus, blocks and split, but the
bundled model's tokenizer files copied, not a new tokenizer (a draft must share
its target's vocabulary), and the one-layer shape of :data:`DRAFT`, small enough
to train on a laptop's CPU. Its report adds how often its greedy token equals
the bundled model's on the held-out windows (what greedy drafts are accepted by).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.dropout import Dropout
from mlx.nn.utils import value_and_grad as nn_value_and_grad
from mlx.utils import tree_flatten

from trio_mlx.testing import llama_config, train_tokenizer, write_tokenizer

__all__ = [
    "DRAFT",
    "PROMPT",
    "TrainConfig",
    "document_text",
    "fit",
    "fit_settings",
    "load_model",
    "main",
    "plot_losses",
    "samples",
    "save_report",
    "shout",
    "split_corpus",
    "target_agreement",
    "train",
    "where_it_ran",
]

EOT = "<|endoftext|>"
PROMPT = "The with statement"


@attrs.frozen(kw_only=True)
class TrainConfig:
    """Every knob of a base-model training run; the defaults made the shipped model."""

    out: Path = attrs.field(converter=Path)
    seed: int = 0
    vocab_size: int = 3072
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 640
    seq_len: int = 256
    batch_size: int = 32
    steps: int = 2000
    warmup: int = 100
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    dropout: float = 0.3
    eval_every: int = 25
    block_chars: int = 2000
    upper_fraction: float = 0.1
    val_fraction: float = 0.06
    stop_after: int | None = None
    #: Copy this model directory's tokenizer files instead of training a tokenizer
    #: (a draft model must share its target's vocabulary); None: train one.
    tokenizer_from: Path | None = attrs.field(
        default=None, converter=attrs.converters.optional(Path)
    )


#: ``--draft``'s settings: the shipped draft of the bundled model. One layer, 96 wide:
#: 1.6 MB float32 (the tied embedding is three quarters of it); ~2 s a step on a
#: 2-core CPU, so 400 steps fit in about 15 minutes; light dropout, as a model this
#: small has little to memorise with.
DRAFT: dict[str, Any] = {
    "hidden_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "steps": 400,
    "warmup": 40,
    "dropout": 0.1,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --- data ---------------------------------------------------------------------


def shout(text: str) -> str:
    """Upper-case ``text`` but leave ``<|endoftext|>`` markers intact."""
    return EOT.join(part.upper() for part in text.split(EOT))


def document_text() -> str:
    """The corpus: every ``pydoc_data`` topic, separated by ``<|endoftext|>``."""
    from pydoc_data.topics import topics

    return EOT.join(topics[key] for key in sorted(topics))


def split_blocks(text: str, block_chars: int) -> list[str]:
    """Cut ``text`` at whitespace into blocks of at least ``block_chars`` characters."""
    blocks: list[str] = []
    start = 0
    while start < len(text):
        end = text.find(" ", start + block_chars)
        end = len(text) if end < 0 else end
        blocks.append(text[start:end])
        start = end
    if len(blocks) > 1 and len(blocks[-1]) < block_chars // 2:
        blocks[-2] += blocks.pop()
    return blocks


def split_corpus(
    text: str, config: TrainConfig, rng: np.random.Generator
) -> tuple[list[str], np.ndarray, set[int]]:
    """Cut ``text`` into blocks; return them, which to upper-case, which to hold out.

    The adapter trainer calls this with the same seed, so both hold out the same blocks.
    """
    blocks = split_blocks(text, config.block_chars)
    upper = rng.random(len(blocks)) < config.upper_fraction
    count = max(1, round(len(blocks) * config.val_fraction))
    return blocks, upper, {int(i) for i in rng.permutation(len(blocks))[:count]}


def windows(blocks: Sequence[np.ndarray], length: int) -> np.ndarray:
    """Non-overlapping ``length``-token windows from the start of every block."""
    rows = [b[i : i + length] for b in blocks for i in range(0, len(b) - length + 1, length)]
    return np.stack(rows)


class WindowSampler:
    """Random ``length``-token windows inside blocks, each start equally likely."""

    def __init__(self, blocks: Sequence[np.ndarray], length: int, rng: np.random.Generator):
        self._blocks = [b for b in blocks if len(b) >= length]
        self._length = length
        starts = np.array([len(b) - length + 1 for b in self._blocks], dtype=np.float64)
        self._p = starts / starts.sum()
        self._rng = rng

    def batch(self, size: int) -> np.ndarray:
        """A ``(size, length)`` int32 batch."""
        picks = self._rng.choice(len(self._blocks), size=size, p=self._p)
        rows = []
        for k in picks:
            block = self._blocks[int(k)]
            start = int(self._rng.integers(0, len(block) - self._length + 1))
            rows.append(block[start : start + self._length])
        return np.stack(rows).astype(np.int32)


# --- reporting ----------------------------------------------------------------


def where_it_ran() -> dict[str, Any]:
    """The MLX device, its name, and the host platform."""

    try:
        name = str(mx.device_info().get("device_name", ""))
    except Exception:  # the report must not cost a finished training run
        name = ""
    return {
        "mlx_device": str(mx.default_device()),
        "device_name": name,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": importlib.metadata.version("mlx"),
    }


def config_for_report(config: Any) -> dict[str, Any]:
    """A trainer's config as JSON-ready data, without its output folder."""
    # A path is recorded by its last part: where the repository lies is no one's business.
    data = {k: v.name if isinstance(v, Path) else v for k, v in attrs.asdict(config).items()}
    del data["out"]
    return data


def add_config_options(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str]) -> None:
    """One ``--option`` per field of the attrs class ``cls``, but those in ``skip``."""
    for field in attrs.fields(cls):
        if field.name in skip:
            continue
        kind: Any = int if field.name == "stop_after" else type(field.default)
        if kind is bool:  # --flag true / false (bool("false") is True)
            kind = _truth
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default)


def _truth(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"not true or false: {text!r}")
    return text.lower() in ("true", "1", "yes")


def print_summary(report: dict[str, Any]) -> None:
    """The report on stdout, less its loss curves."""
    skip = ("train_losses", "val_losses")
    print(json.dumps({k: v for k, v in report.items() if k not in skip}, indent=1))


def save_report(out: Path, report: dict[str, Any], title: str) -> None:
    """Write ``report.json`` and its loss curve ``loss.png`` (``title`` gets the device)."""
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_losses(
        out / "loss.png",
        f"{title}, {report['where']['device_name']})",
        report["train_losses"],
        [(s, v) for s, v in report["val_losses"]],
        report["best_step"],
    )


def plot_losses(
    path: Path,
    title: str,
    train: Sequence[float],
    val: Sequence[tuple[int, float]],
    best_step: int | None = None,
) -> None:
    """Write a loss-curve PNG: train loss (raw and smoothed), validation loss, the kept step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = np.arange(1, len(train) + 1)
    ax.plot(steps, train, color="tab:blue", alpha=0.25, linewidth=0.8)
    if len(train) >= 20:
        kernel = np.ones(20) / 20
        ax.plot(steps[19:], np.convolve(train, kernel, "valid"), color="tab:blue", label="train")
    if val:
        vs, vl = zip(*val, strict=True)
        ax.plot(vs, vl, "o-", color="tab:orange", markersize=3, label="validation")
    if best_step is not None:
        ax.axvline(best_step, color="tab:green", linestyle="--", label=f"kept (step {best_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load_model(path: Path, adapter_path: Path | None = None) -> tuple[Any, Any]:
    """``mlx_lm.load`` a model directory (and adapter): the model and its tokenizer wrapper."""
    from mlx_lm import load

    adapter = None if adapter_path is None else str(adapter_path)
    result: Any = load(str(path), adapter_path=adapter)
    return result[0], result[1]


def samples(model: Any, tokenizer: Any, prompt: str, *, seed: int, n: int = 3) -> dict[str, Any]:
    """One greedy and ``n`` sampled (temperature 0.8, top-p 0.95) completions of ``prompt``."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    greedy = generate(model, tokenizer, prompt, max_tokens=60, sampler=make_sampler(0.0))
    mx.random.seed(seed)
    sampler = make_sampler(temp=0.8, top_p=0.95)
    sampled = [generate(model, tokenizer, prompt, max_tokens=60, sampler=sampler) for _ in range(n)]
    return {"prompt": prompt, "greedy": greedy, "sampled": sampled}


# --- training -----------------------------------------------------------------


def lr_schedule(peak: float, steps: int, warmup: int) -> Any:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it."""

    return optim.join_schedules(
        [
            optim.linear_schedule(peak / 100, peak, warmup),
            optim.cosine_decay(peak, max(1, steps - warmup), peak / 10),
        ],
        [warmup],
    )


def fit_settings(config: Any) -> dict[str, Any]:
    """:func:`fit`'s schedule and optimizer settings, from a trainer's config."""
    names = ("steps", "stop_after", "warmup", "learning_rate", "weight_decay", "eval_every")
    return {name: getattr(config, name) for name in names}


def fit(
    model: Any,
    loss_fn: Callable[..., Any],
    next_batch: Callable[[], tuple[Any, ...]],
    val_batches: Sequence[tuple[Any, ...]],
    *,
    steps: int,
    stop_after: int | None,
    warmup: int,
    learning_rate: float,
    weight_decay: float,
    eval_every: int,
    desc: str,
) -> dict[str, Any]:
    """Train ``model``'s trainable parameters with AdamW; return the loss history.

    The trainable weights at the best validation loss are put back into the
    model before returning. Shared by the base-model and the adapter trainers.
    """
    from tqdm import tqdm

    optimizer = optim.AdamW(
        learning_rate=lr_schedule(learning_rate, steps, warmup),
        weight_decay=weight_decay,
    )
    value_and_grad = nn_value_and_grad(model, loss_fn)
    # The random state is part of the step: dropout draws from it.
    state = [model.state, optimizer.state, mx.random.state]

    def step(*batch: Any) -> Any:
        loss, grads = value_and_grad(*batch)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)

    def validate() -> float:
        model.eval()
        loss = sum(float(loss_fn(*b)) for b in val_batches) / len(val_batches)
        model.train()
        return loss

    model.train()
    run_steps = steps if stop_after is None else min(steps, stop_after)
    train_losses: list[float] = []
    val_losses: list[tuple[int, float]] = [(0, validate())]
    best = (val_losses[0][1], 0, dict(tree_flatten(model.trainable_parameters())))
    started = time.perf_counter()
    bar = tqdm(range(1, run_steps + 1), desc=desc, mininterval=1.0)
    for it in bar:
        loss = step(*next_batch())
        mx.eval(state, loss)
        train_losses.append(float(loss))
        if it % eval_every == 0 or it == run_steps:
            val_losses.append((it, validate()))
            if val_losses[-1][1] < best[0]:
                best = (val_losses[-1][1], it, dict(tree_flatten(model.trainable_parameters())))
            bar.set_postfix(loss=f"{train_losses[-1]:.3f}", val=f"{val_losses[-1][1]:.3f}")
        elif it % 10 == 0:
            bar.set_postfix(loss=f"{train_losses[-1]:.3f}", val=f"{val_losses[-1][1]:.3f}")
    wall = time.perf_counter() - started
    model.load_weights(list(best[2].items()), strict=False)
    model.eval()
    mx.eval(model.parameters())
    return {
        "steps_run": run_steps,
        "wall_time_s": round(wall, 2),
        "best_val_loss": round(best[0], 4),
        "best_step": best[1],
        "final_train_loss_avg50": round(float(np.mean(train_losses[-50:])), 4),
        "final_val_loss": round(val_losses[-1][1], 4),
        "train_losses": [round(x, 5) for x in train_losses],
        "val_losses": [[s, round(v, 5)] for s, v in val_losses],
    }


class _Dropped(Module):
    """Dropout on the output of a residual branch (attention or MLP), for training only."""

    def __init__(self, inner: Any, p: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner = inner
        self.dropout = Dropout(p)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.dropout(self.inner(*args, **kwargs))


def add_dropout(model: Any, p: float) -> None:
    """Wrap every block's attention and MLP in dropout (mlx-lm's llama has none)."""
    for layer in model.layers:
        layer.self_attn = _Dropped(layer.self_attn, p)
        layer.mlp = _Dropped(layer.mlp, p)


def remove_dropout(model: Any) -> None:
    """Undo :func:`add_dropout`, so the weights keep mlx-lm's names."""
    for layer in model.layers:
        layer.self_attn = layer.self_attn.inner
        layer.mlp = layer.mlp.inner


def target_agreement(draft: Any, target_path: Path, rows: np.ndarray) -> float:
    """The share of positions of ``rows`` where ``draft``'s argmax equals the model's
    in ``target_path``: the acceptance rate of one greedy draft token."""
    target, _ = load_model(target_path)
    same = total = 0
    for i in range(0, len(rows), 8):
        tokens = mx.array(rows[i : i + 8, :-1])
        a = mx.argmax(draft(tokens), axis=-1)
        b = mx.argmax(target(tokens), axis=-1)
        count: Any = mx.sum(a == b).item()
        same += int(count)
        total += int(a.size)
    return same / total


def lm_loss(model: Any) -> Callable[[Any], Any]:
    """Mean next-token cross-entropy over a ``(batch, seq_len + 1)`` token array."""

    def loss(tokens: Any) -> Any:
        logits = model(tokens[:, :-1])
        return mx.mean(nn.losses.cross_entropy(logits, tokens[:, 1:]))

    return loss


def train(config: TrainConfig) -> dict[str, Any]:
    """Train the tokenizer and the model, write the model directory and its report."""
    from mlx_lm.models import llama

    started = time.perf_counter()
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    text = document_text()
    if config.tokenizer_from is None:
        tokenizer = train_tokenizer(text + EOT + shout(text), config.vocab_size)
        write_tokenizer(tokenizer, out)
    else:
        from tokenizers import Tokenizer

        for name in TOKENIZER_FILES:
            source = config.tokenizer_from / name
            if source.exists() and source.resolve() != (out / name).resolve():
                shutil.copyfile(source, out / name)
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))

    rng = np.random.default_rng(config.seed)
    blocks, upper, val_idx = split_corpus(text, config, rng)
    cased = [shout(b) if u else b for b, u in zip(blocks, upper, strict=True)]
    ids = [np.array(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(cased)]
    train_blocks = [b for i, b in enumerate(ids) if i not in val_idx]
    val_rows = windows([b for i, b in enumerate(ids) if i in val_idx], config.seq_len + 1)
    sampler = WindowSampler(train_blocks, config.seq_len + 1, rng)

    model_config = llama_config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
    )
    mx.random.seed(config.seed)
    model = llama.Model(llama.ModelArgs.from_dict(model_config))  # type: ignore[no-untyped-call]
    mx.eval(model.parameters())
    n_params = sum(v.size for v in dict(tree_flatten(model.parameters())).values())

    val_batches = [
        (mx.array(val_rows[i : i + config.batch_size]),)
        for i in range(0, len(val_rows), config.batch_size)
    ]
    if config.dropout:
        add_dropout(model, config.dropout)
    history = fit(
        model,
        lm_loss(model),
        lambda: (mx.array(sampler.batch(config.batch_size)),),
        val_batches,
        **fit_settings(config),
        desc="train default model" if config.tokenizer_from is None else "train draft model",
    )
    if config.dropout:
        remove_dropout(model)

    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    loaded, loaded_tokenizer = load_model(out)
    report = {
        "kind": "base model" if config.tokenizer_from is None else "draft model",
        "where": where_it_ran(),
        "config": config_for_report(config),
        "parameters": int(n_params),
        "model_bytes": (out / "model.safetensors").stat().st_size,
        "vocab_size": tokenizer.get_vocab_size(),
        # pydoc_data.topics changes between CPython releases: re-runs must match this.
        "corpus": {
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        },
        "tokens": {
            "train": int(sum(len(b) for b in train_blocks)),
            "val": int(val_rows.size),
            "blocks": len(ids),
            "upper_blocks": int(upper.sum()),
        },
        **history,
        **(
            {}
            if config.tokenizer_from is None
            else {
                "target_agreement": round(
                    target_agreement(loaded, config.tokenizer_from, val_rows), 4
                )
            }
        ),
        "total_wall_time_s": 0.0,
        "samples": samples(loaded, loaded_tokenizer, PROMPT, seed=config.seed),
    }
    report["total_wall_time_s"] = round(time.perf_counter() - started, 2)
    kind = "default model" if config.tokenizer_from is None else "draft model"
    save_report(out, report, f"{kind} ({n_params / 1e6:.2f}M params")
    return report


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from the command line (every field is an option;
    ``--draft``: the defaults of :data:`DRAFT`, the bundled model's tokenizer, the draft's
    bundled directory)."""
    from trio_mlx.default_model import default_draft_path, default_model_path

    parser = argparse.ArgumentParser(prog="python -m tools.train")
    parser.add_argument("--out", type=Path, default=None, help="default: the bundled directory")
    parser.add_argument(
        "--draft", action="store_true", help="train the bundled model's draft (see DRAFT)"
    )
    parser.add_argument(
        "--tokenizer-from", type=Path, default=None, help="copy this model's tokenizer files"
    )
    add_config_options(parser, TrainConfig, skip=("out", "tokenizer_from"))
    draft = parser.parse_known_args(argv)[0].draft
    if draft:
        parser.set_defaults(**DRAFT, tokenizer_from=default_model_path())
    args = vars(parser.parse_args(argv))
    del args["draft"]
    if args["out"] is None:
        args["out"] = default_draft_path() if draft else default_model_path()
    return TrainConfig(**args)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    print_summary(train(parse_args(argv)))


if __name__ == "__main__":
    main()
