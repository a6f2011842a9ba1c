"""Decode throughput of one model sharded over an ``mx.distributed`` group, against one process.

The model is tensor parallel (mlx-lm's ``sharded_load``: llama's ``shard`` splits
every attention and MLP projection over the ranks; the embedding and the LM head
are replicated). Two loops are measured, greedy, at batch sizes B:

* ``bare``: mlx-lm only. Every rank loads its shard, builds the same
  ``BatchGenerator``, inserts the same B prompts and calls ``next()`` until every
  row is done: identical calls, so the collectives line up. Rank 0 times it.
* ``engine``: ``trio_mlx.open_engine`` on rank 0 (it loads the sharded model
  itself when launched), B concurrent ``engine.generate`` streams; the other
  ranks run ``trio_mlx.distributed.follow`` (they replay rank 0's lane
  commands, so the same collectives run).

Per B and round: wall time from submit to the last row done, each row's time to
first token, tokens generated. ``decode_tok_s`` = (tokens - B) / (end - latest
first token): the steady decode rate once every row is prefilled;
``overall_tok_s`` = tokens / wall. The best round (by decode rate) is kept.
Prompts are 16 seeded random ids per row, the same in every run. The random
models written by ``make-model`` have zero LM-head rows for the special ids
(0..2, EOS among them), so greedy decoding never stops early and every row
generates exactly ``--tokens`` tokens.

Subcommands::

    python bench/distributed_decode.py make-model DIR [--shape 8b|small|tiny]
        [--dtype bfloat16|float32] [--vocab N] [--shard-gb G] [--no-check]
    python bench/distributed_decode.py run MODEL OUT.json [--mode bare|engine|both]
        [--batches 1,8,32] [--tokens 128] [--rounds 2] [--prompt-len 16]
    python bench/distributed_decode.py report OUT_DIR/*.json [--markdown OUT_DIR/README.md]

``run`` works in one process and under ``mlx.launch`` (every rank runs the same
command; rank 0 writes OUT.json). Run ``--mode bare`` and ``--mode engine`` as
separate launches (``both`` runs them one after the other in one launch), then
``report`` puts the 1-rank and 2-rank files side by side.

On a machine with 2 NVIDIA GPUs (MLX CUDA, NCCL), from the repository root, with
``engine/`` and ``http/`` on ``PYTHONPATH`` (this script also puts ``engine/`` on
``sys.path`` itself when ``trio_mlx`` is not importable); ``M`` a folder for the
model and ``R`` one for the results::

    python3 bench/distributed_decode.py make-model $M --shape 8b          # ~15 GB bf16
    CUDA_VISIBLE_DEVICES=0 python3 bench/distributed_decode.py run $M $R/1-bare.json --mode bare
    CUDA_VISIBLE_DEVICES=0 python3 bench/distributed_decode.py run $M $R/1-engine.json --mode engine
    launch() { python3 -c 'from mlx._distributed_utils.launch import main; main()' "$@"; }
    launch -n 2 --backend nccl --python python3 -- \\
        bench/distributed_decode.py run $M $R/2-bare.json --mode bare
    launch -n 2 --backend nccl --python python3 -- \\
        bench/distributed_decode.py run $M $R/2-engine.json --mode engine
    python3 bench/distributed_decode.py report $R/*.json --markdown $R/README.md

Notes on ``mlx.launch`` (mlx 0.32, ``mlx/_distributed_utils/launch.py``):

* ``python3 -m mlx._distributed_utils.launch`` does nothing (the module has no
  ``__main__`` block): use the ``-c`` form above, or the ``mlx.launch`` console
  script where it is on PATH (``pip install --target DIR`` puts it in
  ``DIR/bin``).
* Local ranks are started with ``bash -c`` and inherit the launcher's whole
  environment: ``PYTHONPATH`` (and ``LD_PRELOAD``) carry over, no ``--env``
  needed. The working directory is the launcher's, so relative paths work.
* ``nccl`` sets ``CUDA_VISIBLE_DEVICES=<rank>`` for each local rank
  (overriding any value of yours), plus ``MLX_WORLD_SIZE``, ``NCCL_HOST_IP`` and
  ``NCCL_PORT`` (``--nccl-port``, default 12345: change it if a previous launch
  left the port busy). ``ring`` sets ``MLX_HOSTFILE``; both set ``MLX_RANK``.
* Should ``mlx_lm.utils.sharded_load`` fail under NCCL at its closing barrier
  (an ``all_sum`` on the CPU stream; untested here), ``run --mode bare
  --loader direct`` loads the same shards without it. The engine loads with
  ``sharded_load`` whatever ``--loader`` says.
* The launcher exits 0 even when a rank fails (it kills the others): check
  that OUT.json was written (only rank 0 writes it, at the end).
* ``--python`` is needed: without it the script path itself is executed.
  Put ``--`` before the script: the launcher parses options anywhere in the
  line (``parse_known_args``), and ``--`` keeps the script's own options its own.

On a CPU (what was checked here), with OpenBLAS preloaded::

    python bench/distributed_decode.py make-model /tmp/tiny --shape tiny --dtype float32
    mlx.launch -n 2 --backend ring --starting-port 45123 --python $(which python) -- \\
        bench/distributed_decode.py run /tmp/tiny /tmp/r/2-bare.json --mode bare \\
        --batches 1,4 --tokens 16 --rounds 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import struct
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: Llama shapes: hidden, layers, heads, KV heads, MLP, default vocab, max positions.
SHAPES: dict[str, dict[str, int]] = {
    # Llama-3-8B's layers (its vocab is 128256; the BPE trained here tops out near 65k ids).
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    },
    # The same code path at a size a laptop CPU builds in seconds.
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1792,
        "vocab_size": 4096,
        "max_position_embeddings": 8192,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
    },
}

#: Token ids whose LM-head rows are zero (the special tokens: EOS ids 0 and 2 among them).
SPECIAL_IDS = (0, 1, 2)
#: Seed of the prompts (and of every rank's ``mx.random`` in the bare loop).
SEED = 1234


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def ensure_trio_mlx() -> None:
    """Make ``trio_mlx`` importable from this checkout when it is not installed."""
    if importlib.util.find_spec("trio_mlx") is None:
        sys.path.insert(0, str(REPO / "engine"))


# --------------------------------------------------------------------------- make-model


def tokenizer_corpus(limit: int = 16_000_000) -> str:
    """CPython's docs text, then its stdlib sources (sorted): enough text for a 32k+ BPE."""
    ensure_trio_mlx()
    from trio_mlx.testing import corpus_text

    parts = [corpus_text()]
    size = len(parts[0])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    for file in sorted(stdlib.rglob("*.py")):
        if size >= limit:
            break
        if skip.intersection(file.relative_to(stdlib).parts):
            continue
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text)
        size += len(text)
    return "\n\n".join(parts)


def make_model(
    directory: Path,
    shape: str,
    dtype: str,
    vocab: int | None,
    shard_gb: float,
    seed: int,
    weight_scale: float,
    check: bool,
) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    ensure_trio_mlx()
    from trio_mlx.testing import llama_config, train_tokenizer, write_tokenizer

    started = time.perf_counter()
    dims = dict(SHAPES[shape])
    wanted_vocab = vocab or dims.pop("vocab_size")
    dims.pop("vocab_size", None)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("model*.safetensors*"):
        old.unlink()

    text = tokenizer_corpus()
    tokenizer = train_tokenizer(text, wanted_vocab)
    write_tokenizer(tokenizer, directory)
    real_vocab = int(tokenizer.get_vocab_size())
    log(
        f"tokenizer: asked for {wanted_vocab} ids, the corpus ({len(text) / 1e6:.1f}M chars)"
        f" gives {real_vocab} ({time.perf_counter() - started:.1f} s)"
    )

    config = llama_config(vocab_size=real_vocab, tie_word_embeddings=False, **dims)
    config["torch_dtype"] = dtype
    config["rope_theta"] = 500000.0 if shape == "8b" else 10000.0
    target = getattr(mx, dtype)

    # The module's own initial parameters stay lazy and are never evaluated: only
    # their shapes are used. Each weight is drawn directly in the target dtype.
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    shapes = [(name, tuple(p.shape)) for name, p in tree_flatten(model.parameters())]
    del model
    weights: dict[str, Any] = {}
    for name, dims_ in shapes:
        if len(dims_) == 1:  # norms: ones, as a trained model's are near
            array = mx.ones(dims_, dtype=target)
        else:
            std = weight_scale / math.sqrt(dims_[-1])
            array = mx.random.normal(dims_, dtype=target, scale=std)
            if name == "lm_head.weight" or (
                name == "model.embed_tokens.weight" and config["tie_word_embeddings"]
            ):
                keep = mx.ones((dims_[0], 1), dtype=target)
                keep[mx.array(SPECIAL_IDS)] = 0
                array = array * keep
        mx.eval(array)
        weights[name] = array
    params = sum(int(a.size) for a in weights.values())
    nbytes = sum(int(a.nbytes) for a in weights.values())

    # Shards of at most ``shard_gb``, with an index: what mlx-lm's converter writes.
    limit = max(1, int(shard_gb * (1 << 30)))
    shards: list[list[str]] = [[]]
    size = 0
    for name, array in weights.items():
        if shards[-1] and size + array.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += array.nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(
            str(directory / file), {n: weights[n] for n in names}, metadata={"format": "mlx"}
        )
        weight_map.update(dict.fromkeys(names, file))
    index = {
        "metadata": {"total_size": nbytes, "total_parameters": params},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    del weights, array
    mx.clear_cache()
    log(
        f"wrote {directory}: {shape} {dtype}, {params:,} parameters, {nbytes:,} bytes"
        f" ({nbytes / 1e9:.2f} GB) in {len(shards)} file(s),"
        f" {time.perf_counter() - started:.1f} s"
    )
    if check:
        check_model(directory)


def check_model(directory: Path) -> None:
    """Load with ``mlx_lm.load``, decode 8 greedy tokens for two rows: no EOS, all decodable."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    started = time.perf_counter()
    model, tokenizer = mlx_lm.load(str(directory))
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    rows = prompts(2, 16, vocab)
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=2,
        prefill_batch_size=2,
    )
    uids = gen.insert(rows, max_tokens=[8, 8])
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    reasons: dict[int, str] = {}
    while len(reasons) < len(uids):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                reasons[r.uid] = r.finish_reason
    gen.close()
    for uid in uids:
        if reasons[uid] != "length" or len(out[uid]) != 8:
            raise SystemExit(f"check failed: row {uid} ended {reasons[uid]!r} after {out[uid]}")
        text = tokenizer.decode(out[uid])
        log(f"check: row {uid} -> {out[uid]} {text!r}")
    log(f"check: mlx_lm.load and 8 greedy tokens OK ({time.perf_counter() - started:.1f} s)")
    del model
    mx.clear_cache()


# --------------------------------------------------------------------------- run


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """``batch`` distinct rows of ``length`` ids, the same for every mode, rank and run."""
    rng = random.Random(SEED)
    return [[rng.randrange(len(SPECIAL_IDS), vocab) for _ in range(length)] for _ in range(batch)]


def safetensors_size(directory: Path) -> tuple[int, int]:
    """(parameters, bytes) from the safetensors headers (no weights are read)."""
    params = nbytes = 0
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            params += math.prod(info["shape"])
            nbytes += info["data_offsets"][1] - info["data_offsets"][0]
    return params, nbytes


def model_info(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    params, nbytes = safetensors_size(path)
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "torch_dtype",
    )
    return {
        "path": str(path),
        "params": params,
        "bytes": nbytes,
        "shape": {k: config[k] for k in keys if k in config},
    }


def launched() -> bool:
    """Whether ``mlx.launch`` (or mpirun) started this process as one of several ranks."""
    for name in ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if name in os.environ:
            return int(os.environ[name]) > 1
    return "MLX_RANK" in os.environ and bool(os.environ.get("MLX_HOSTFILE"))


def env_rank() -> int:
    return int(os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def backend_info() -> dict[str, Any]:
    env = os.environ
    if "NCCL_HOST_IP" in env:
        name = "nccl"
    elif env.get("MLX_HOSTFILE"):
        name = "ring"
    elif "OMPI_COMM_WORLD_SIZE" in env:
        name = "mpi"
    elif "MLX_JACCL_COORDINATOR" in env:
        name = "jaccl"
    else:
        name = None
    keep = ("MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT", "CUDA_VISIBLE_DEVICES")
    return {"name": name, "env": {k: env[k] for k in keep if k in env}}


def summarize(
    start: float, end: float, first: Iterable[float | None], counts: Iterable[int]
) -> dict[str, Any]:
    """One round's metrics from the submit time, end time, first-token times and token counts."""
    first_ = [t for t in first if t is not None]
    counts_ = list(counts)
    total = sum(counts_)
    rows = len(counts_)
    ttft = [t - start for t in first_]
    latest = max(first_) if first_ else end
    decode_window = end - latest
    return {
        "decode_tok_s": (total - rows) / decode_window if decode_window > 0 else None,
        "overall_tok_s": total / (end - start),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_max_s": max(ttft) if ttft else None,
        "tokens": total,
        "seconds": end - start,
    }


def best(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    chosen = max(rounds, key=lambda r: (r["decode_tok_s"] or 0.0, r["overall_tok_s"]))
    return dict(chosen, rounds=rounds)


def report_round(mode: str, batch: int, round_: int, r: dict[str, Any], want: int) -> None:
    decode = r["decode_tok_s"]
    log(
        f"{mode} B={batch} round {round_}: decode {decode or 0:.1f} tok/s,"
        f" overall {r['overall_tok_s']:.1f} tok/s, ttft p50 {r['ttft_p50_s'] or 0:.3f} s,"
        f" {r['tokens']} tokens in {r['seconds']:.2f} s"
        + ("" if r["tokens"] == want else f"  (WARNING: expected {want} tokens)")
    )


def direct_sharded_load(path: Path, group: Any) -> tuple[Any, Any]:
    """``sharded_load`` (tensor parallel) without its closing barrier on the CPU stream.

    mlx-lm's ends with ``all_sum(..., stream=mx.cpu)``; this one syncs the
    ranks on the default stream instead (``--loader direct``, a fallback should
    a backend refuse collectives on the CPU stream).
    """
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(path, lazy=True, strict=False)
    model.shard(group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(
        path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id")
    )
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return model, tokenizer


def run_bare(
    model_path: Path,
    batches: list[int],
    tokens: int,
    rounds: int,
    prompt_len: int,
    vocab: int,
    loader: str = "mlx-lm",
) -> tuple[dict[str, Any], int]:
    """Every rank: the bare BatchGenerator loop; returns (results, world size)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    rank, world = 0, 1
    if launched():
        from mlx_lm.utils import sharded_load

        group = mx.distributed.init()
        rank, world = int(group.rank()), int(group.size())
        if loader == "direct":
            model, tokenizer = direct_sharded_load(model_path, group)
        else:
            model, tokenizer = sharded_load(str(model_path), tensor_group=group)
    else:
        model, tokenizer = mlx_lm.load(str(model_path))
    mx.random.seed(SEED)
    say = log if rank == 0 else (lambda *_: None)
    say(f"bare: loaded on {world} rank(s), {mx.default_device()}")
    stop = [[t] for t in tokenizer.eos_token_ids]

    def one(rows: list[list[int]], max_tokens: int) -> dict[str, Any]:
        gen = BatchGenerator(
            model,
            stop_tokens=stop,
            completion_batch_size=len(rows),
            prefill_batch_size=min(len(rows), 8),
        )
        start = time.perf_counter()
        uids = gen.insert(rows, max_tokens=[max_tokens] * len(rows))
        index = {uid: i for i, uid in enumerate(uids)}
        first: list[float | None] = [None] * len(rows)
        counts = [0] * len(rows)
        row0: list[int] = []
        live = len(rows)
        while live:
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                i = index[r.uid]
                counts[i] += 1
                if i == 0:
                    row0.append(int(r.token))
                if first[i] is None:
                    first[i] = now
                if r.finish_reason is not None:
                    live -= 1
        end = time.perf_counter()
        gen.close()
        return dict(summarize(start, end, first, counts), row0_tokens=row0)

    one(prompts(1, prompt_len, vocab), 4)  # warm up
    results: dict[str, Any] = {}
    for batch in batches:
        rows = prompts(batch, prompt_len, vocab)
        one(rows, min(8, tokens))  # this batch size's shapes
        done = []
        for round_ in range(rounds):
            r = one(rows, tokens)
            done.append(r)
            if rank == 0:
                report_round("bare", batch, round_, r, batch * tokens)
        results[str(batch)] = best(done)
    return results, world


async def run_engine(
    model_path: Path, batches: list[int], tokens: int, rounds: int, prompt_len: int, vocab: int
) -> tuple[dict[str, Any], int]:
    """Rank 0 (or the one process): B concurrent engine.generate streams."""
    import trio

    import trio_mlx

    params = trio_mlx.SamplingParams(max_tokens=tokens, temperature=0.0)
    # max_batch=1 would send every request to the serial lane (refused when distributed).
    max_batch = max(2, *batches)
    async with trio_mlx.open_engine(
        model_path, max_batch=max_batch, prompt_cache_bytes=0
    ) as engine:
        group = getattr(getattr(engine, "_loaded", None), "group", None)
        world = int(group.size()) if group is not None else 1
        log(f"engine: loaded on {world} rank(s), max_batch {max_batch}")

        async def one(rows: list[list[int]], p: Any) -> dict[str, Any]:
            first: list[float | None] = [None] * len(rows)
            counts = [0] * len(rows)
            row0: list[int] = []

            async def row(i: int) -> None:
                async with engine.generate(rows[i], p) as stream:
                    async for delta in stream:
                        if delta.token_ids:
                            if first[i] is None:
                                first[i] = time.perf_counter()
                            counts[i] += len(delta.token_ids)
                            if i == 0:
                                row0.extend(delta.token_ids)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(len(rows)):
                    nursery.start_soon(row, i)
            return dict(summarize(start, time.perf_counter(), first, counts), row0_tokens=row0)

        short = trio_mlx.SamplingParams(max_tokens=min(8, tokens), temperature=0.0)
        await one(prompts(1, prompt_len, vocab), trio_mlx.SamplingParams(max_tokens=4))
        results: dict[str, Any] = {}
        for batch in batches:
            rows = prompts(batch, prompt_len, vocab)
            await one(rows, short)
            done = []
            for round_ in range(rounds):
                r = await one(rows, params)
                done.append(r)
                report_round("engine", batch, round_, r, batch * tokens)
            results[str(batch)] = best(done)
    return results, world


def run(args: argparse.Namespace) -> None:
    ensure_trio_mlx()
    model_path = Path(args.model)
    out = Path(args.out)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    modes = ["bare", "engine"] if args.mode == "both" else [args.mode]

    def follower_exit() -> None:
        from trio_mlx.distributed import follow, follower_rank

        if follower_rank() is not None:
            sys.exit(follow(str(model_path)))

    docs = []
    for mode in modes:
        started = time.time()
        run_args = (model_path, batches, args.tokens, args.rounds, args.prompt_len, vocab)
        if mode == "bare":
            results, world = run_bare(*run_args, loader=args.loader)
            import mlx.core as mx

            mx.clear_cache()  # the bare model is gone with run_bare's frame
            if env_rank() != 0:
                continue
        else:
            follower_exit()
            import trio

            results, world = trio.run(run_engine, *run_args)
        import mlx.core as mx

        try:
            device_name = mx.device_info().get("device_name")
        except Exception:
            device_name = None
        docs.append(
            {
                "mode": mode,
                "ranks": world,
                "backend": backend_info() if world > 1 else None,
                "device": str(mx.default_device()),
                "device_name": device_name,
                "versions": {"mlx": mx.__version__, "mlx_lm": _version("mlx-lm")},
                "model": model_info(model_path),
                "batches": batches,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "prompt_len": args.prompt_len,
                "loader": args.loader if mode == "bare" and world > 1 else None,
                "started": started,
                "results": results,
            }
        )
    if env_rank() != 0 or not docs:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = docs[0] if len(docs) == 1 else {"mode": "both", "runs": docs}
    out.write_text(json.dumps(doc, indent=2))
    log(f"wrote {out}")
    print_table(load_runs([out]))


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- report


def load_runs(files: Iterable[Path]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for file in files:
        doc = json.loads(Path(file).read_text())
        for r in doc.get("runs", [doc]):
            runs.append(dict(r, file=str(file)))
    return runs


def table(runs: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: decode tok/s per B for each (ranks, mode), and the ratios."""
    # Several files for one (ranks, mode): the best decode rate per B.
    rate: dict[tuple[int, str], dict[int, float]] = {}
    for r in runs:
        per = rate.setdefault((int(r["ranks"]), r["mode"]), {})
        for b, res in r["results"].items():
            value = res.get("decode_tok_s")
            if value is not None:
                per[int(b)] = max(per.get(int(b), 0.0), value)
    ranks = sorted({k[0] for k in rate} | {1, 2})
    batches = sorted({b for per in rate.values() for b in per})

    def get(n: int, mode: str, b: int) -> float | None:
        return rate.get((n, mode), {}).get(b)

    def ratio(x: float | None, y: float | None) -> str:
        return f"{x / y:.2f}" if x is not None and y else "-"

    def num(x: float | None) -> str:
        return f"{x:.1f}" if x is not None else "-"

    head = ["B"]
    head += [f"{n}-rank {mode}" for n in ranks for mode in ("bare", "engine")]
    head += [f"{n}/{ranks[0]} ranks {mode}" for n in ranks[1:] for mode in ("bare", "engine")]
    head += [f"engine/bare {n}-rank" for n in ranks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in batches:
        cells = [str(b)]
        cells += [num(get(n, mode, b)) for n in ranks for mode in ("bare", "engine")]
        cells += [
            ratio(get(n, mode, b), get(ranks[0], mode, b))
            for n in ranks[1:]
            for mode in ("bare", "engine")
        ]
        cells += [ratio(get(n, "engine", b), get(n, "bare", b)) for n in ranks]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def describe(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| file | mode | ranks | backend | device | model | tokens/row | rounds |"]
    lines.append("|---|---|---:|---|---|---|---:|---:|")
    for r in runs:
        m = r.get("model", {})
        shape = m.get("shape", {})
        model = (
            f"{human(m.get('params', 0))} params, {human(m.get('bytes', 0))}B,"
            f" h{shape.get('hidden_size')} L{shape.get('num_hidden_layers')}"
            f" {shape.get('torch_dtype')} vocab {shape.get('vocab_size')}"
        )
        backend = (r.get("backend") or {}).get("name") or "-"
        device = r.get("device_name") or r.get("device")
        lines.append(
            f"| {Path(r['file']).name} | {r['mode']} | {r['ranks']} | {backend} | {device}"
            f" | {model} | {r.get('tokens')} | {r.get('rounds')} |"
        )
    return lines


def details(runs: list[dict[str, Any]]) -> list[str]:
    # Row 0's greedy tokens against the 1-rank bare loop's: the same model should
    # say the same (a sharded reduction in bf16 may legitimately drift late on).
    reference: dict[str, list[int]] = {}
    for r in runs:
        if r["ranks"] == 1 and r["mode"] == "bare":
            for b, res in r["results"].items():
                reference.setdefault(b, res.get("row0_tokens") or [])
    lines = [
        "| ranks | mode | B | decode tok/s | overall tok/s | TTFT p50 s | tokens | seconds"
        " | row 0 as 1-rank bare |"
    ]
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in sorted(runs, key=lambda r: (r["ranks"], r["mode"])):
        for b, res in sorted(r["results"].items(), key=lambda kv: int(kv[0])):
            decode = res.get("decode_tok_s")
            ttft = res.get("ttft_p50_s")
            mine, ref = res.get("row0_tokens"), reference.get(b)
            if not mine or not ref:
                same = "-"
            elif mine == ref:
                same = "same"
            else:
                differ = next(
                    (i for i, (x, y) in enumerate(zip(mine, ref, strict=False)) if x != y), None
                )
                common = min(len(mine), len(ref))
                same = f"differs at token {differ}" if differ is not None else f"same {common}"
            lines.append(
                f"| {r['ranks']} | {r['mode']} | {b} | {decode or 0:.1f}"
                f" | {res['overall_tok_s']:.1f} | {ttft or 0:.3f} | {res['tokens']}"
                f" | {res['seconds']:.2f} | {same} |"
            )
    return lines


def print_table(runs: list[dict[str, Any]], emit: Callable[[str], None] = log) -> None:
    for line in table(runs):
        emit(line)


def report(args: argparse.Namespace) -> None:
    runs = load_runs(Path(f) for f in args.files)
    text = [
        "# Distributed decode: tensor parallel over mx.distributed vs one process",
        "",
        "Decode tok/s = (tokens - B) / (end - latest first token), best round;"
        " greedy, every row generates the same number of tokens."
        " `bench/distributed_decode.py` says how it is measured and run.",
        "",
        *table(runs),
        "",
        "## Runs",
        "",
        *describe(runs),
        "",
        "## Every measurement (best round)",
        "",
        "The last column compares row 0's greedy tokens with the 1-rank bare loop's."
        " Sharded float32 models give the same tokens; bf16 ones drift (each rank's"
        " partial sums are rounded to bf16 before the all_sum), on a random model's"
        " flat logits often from the second token on. The token counts and shapes,"
        " hence the throughput, are the same either way.",
        "",
        *details(runs),
        "",
    ]
    print("\n".join(text))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n".join(text))
        log(f"wrote {args.markdown}")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a random-weight llama model directory")
    mk.add_argument("directory", type=Path)
    mk.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    mk.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    mk.add_argument("--vocab", type=int, default=None, help="BPE vocab to train (default: shape's)")
    mk.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors file")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--weight-scale", type=float, default=1.0, help="std * sqrt(fan_in)")
    mk.add_argument("--no-check", action="store_true", help="skip the load-and-decode check")

    rn = sub.add_parser("run", help="measure decode throughput (also under mlx.launch)")
    rn.add_argument("model")
    rn.add_argument("out")
    rn.add_argument("--mode", choices=["bare", "engine", "both"], default="engine")
    rn.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    rn.add_argument("--tokens", type=int, default=128, help="tokens per row")
    rn.add_argument("--rounds", type=int, default=2, help="timed rounds per B (best kept)")
    rn.add_argument("--prompt-len", type=int, default=16)
    rn.add_argument(
        "--loader",
        choices=["mlx-lm", "direct"],
        default="mlx-lm",
        help="bare, launched: mlx_lm.utils.sharded_load, or the same without its CPU-stream barrier",
    )

    rp = sub.add_parser("report", help="side-by-side table of run outputs")
    rp.add_argument("files", nargs="+")
    rp.add_argument("--markdown", default=None)

    args = parser.parse_args()
    if args.command == "make-model":
        make_model(
            args.directory,
            args.shape,
            args.dtype,
            args.vocab,
            args.shard_gb,
            args.seed,
            args.weight_scale,
            not args.no_check,
        )
    elif args.command == "run":
        run(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
