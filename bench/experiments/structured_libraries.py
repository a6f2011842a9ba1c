"""Compare grammar libraries for structured output on one tokenizer (design/structured-output.md).

    python bench/experiments/structured_libraries.py TOKENIZER_JSON [--libs llguidance,outlines-core]
    python bench/experiments/structured_libraries.py TOKENIZER_JSON --train   # build it first (~2 min)

``--train`` writes a 151,646-token byte-level BPE (Qwen2.5's vocabulary size)
trained on this Python's standard library and site-packages sources.

For each library: the time to prepare the vocabulary, the compile time of the 20
benchmark schemas (``bench/suite/schemas.py``), which JSON-schema features of
``FEATURES`` compile, and the cost of one token mask: a seeded random walk
through allowed tokens (64 steps per schema), timing each mask. It also times
applying 32 rows' masks to MLX logits at 3,072 tokens and at the tokenizer's
size (``--libs ""`` runs only that). Run it with the libraries importable (e.g.
``pip install --target DIR`` and ``PYTHONPATH=DIR:.``); a library that does not
import is reported with its import error.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.suite.schemas import FEATURES, SCHEMAS

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
WALK = 64


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: printable stand-in -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(path: Path) -> tuple[list[bytes], int]:
    """Every token's bytes (byte-level BPE) and the EOS id."""
    data = json.loads(path.read_text())
    decode = _byte_decoder()
    vocab: dict[str, int] = data["model"]["vocab"]
    out = [b""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        out[i] = bytes(decode[c] for c in text)
    eos = 0
    for added in data.get("added_tokens", []):
        out[added["id"]] = added["content"].encode()
        if added["content"] == "<|endoftext|>":
            eos = added["id"]
    return out, eos


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": _pct(values, 0.5) * 1e3,
        "p99_ms": _pct(values, 0.99) * 1e3,
        "mean_ms": statistics.fmean(values) * 1e3,
    }


class Llguidance:
    name = "llguidance"

    def __init__(self, path: Path) -> None:
        import llguidance

        self.llg = llguidance
        self.version = llguidance.__version__ if hasattr(llguidance, "__version__") else "?"
        start = time.perf_counter()
        self.tok = llguidance.LLTokenizer(str(path))
        self.setup_s = time.perf_counter() - start

    def compile(self, schema: dict[str, Any]) -> Any:
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
        matcher = LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, matcher: Any, rng: random.Random) -> list[float]:
        import numpy as np

        times = []
        for _ in range(WALK):
            start = time.perf_counter()
            mask = matcher.compute_bitmask()
            times.append(time.perf_counter() - start)
            bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
            allowed = np.nonzero(bits)[0]
            if matcher.is_stopped() or len(allowed) == 0:
                break
            matcher.consume_token(int(rng.choice(list(allowed))))
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, path: Path) -> None:
        import importlib.metadata

        import outlines_core

        self.oc = outlines_core
        self.version = importlib.metadata.version("outlines-core")
        tokens, eos = token_bytes(path)
        start = time.perf_counter()
        mapping: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokens):
            if i != eos and b:
                mapping.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, mapping)
        self.setup_s = time.perf_counter() - start

    def compile(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def walk(self, index: Any, rng: random.Random) -> list[float]:
        guide = self.oc.Guide(index)
        times = []
        for _ in range(WALK):
            start = time.perf_counter()
            allowed = guide.get_tokens()
            times.append(time.perf_counter() - start)
            if guide.is_finished() or not allowed:
                break
            guide.advance(int(rng.choice(allowed)), return_tokens=False)
        return times


def mlx_apply(vocab: int, rows: int = 32, repeats: int = 30) -> dict[str, Any]:
    """Build and apply ``rows`` masks to (1, vocab) logits and concatenate, as a batch step does.

    ``device_unpack``: the bitmask words go to MLX and are unpacked there;
    ``numpy_unpack`` (the engine's): ``np.unpackbits``, one bool array, one ``mx.where``.
    """
    import mlx.core as mx
    import numpy as np

    words = np.random.default_rng(0).integers(0, 2**32, size=(vocab + 31) // 32, dtype=np.uint32)
    raw = words.tobytes()
    logits = mx.random.normal((1, vocab))
    shifts = mx.arange(32, dtype=mx.uint32)
    neg = mx.array(-mx.inf)
    mx.eval(logits, shifts, neg)

    def device_unpack() -> Any:
        w = mx.array(np.frombuffer(raw, dtype=np.uint32))
        allowed = ((w[:, None] >> shifts) & 1).reshape(-1)[:vocab].astype(mx.bool_)
        return mx.where(allowed, logits, neg)

    def numpy_unpack() -> Any:
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        return mx.where(mx.array(bits[:vocab].view(np.bool_)), logits, neg)

    out: dict[str, Any] = {"rows": rows}
    for _ in range(2):  # alternate, best-of per variant below
        for fn in (device_unpack, numpy_unpack):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                mx.eval(mx.concatenate([fn() for _ in range(rows)], axis=0))
                times.append(time.perf_counter() - start)
            summary = _summary(times)
            best = out.get(fn.__name__)
            if best is None or summary["p50_ms"] < best["p50_ms"]:
                out[fn.__name__] = summary
    return out


def measure(lib: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"version": lib.version, "vocab_setup_s": lib.setup_s}
    compile_times, mask_times, failed = [], [], []
    for i, schema in enumerate(SCHEMAS):
        start = time.perf_counter()
        try:
            compiled = lib.compile(schema)
        except Exception as exc:
            failed.append(f"schema {i}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        compile_times.append(time.perf_counter() - start)
        mask_times.extend(lib.walk(compiled, random.Random(i)))
        print(f"  {lib.name} schema {i}: {compile_times[-1] * 1e3:.1f} ms", flush=True)
    out["compile"] = _summary(compile_times) if compile_times else None
    out["mask"] = _summary(mask_times) if mask_times else None
    out["masks_timed"] = len(mask_times)
    out["schemas_failed"] = failed
    coverage = {}
    for feature, schema in FEATURES.items():
        try:
            lib.compile(schema)
            coverage[feature] = True
        except Exception as exc:
            coverage[feature] = f"{type(exc).__name__}: {str(exc)[:100]}"
    out["coverage"] = coverage
    out["features_compiled"] = sum(v is True for v in coverage.values())
    return out


def train(path: Path, vocab: int = 151_646) -> None:
    """Train the comparison's tokenizer on the installed Python sources and save it."""
    import sysconfig

    from trio_mlx.testing import corpus_text, train_tokenizer

    texts = [corpus_text()]
    for key in ("stdlib", "purelib"):
        for source in Path(sysconfig.get_paths()[key]).rglob("*.py"):
            try:
                texts.append(source.read_text(errors="ignore"))
            except OSError:
                continue
    tokenizer = train_tokenizer("\n".join(texts), vocab)
    tokenizer.save(str(path))
    print(f"wrote {path}: {tokenizer.get_vocab_size()} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", type=Path, help="a byte-level BPE tokenizer.json")
    parser.add_argument("--libs", default="llguidance,outlines-core,xgrammar")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--train", action="store_true", help="train TOKENIZER first")
    args = parser.parse_args()
    if args.train:
        train(args.tokenizer)
    vocab = len(token_bytes(args.tokenizer)[0])
    results: dict[str, Any] = {"vocab": vocab, "features": len(FEATURES), "walk": WALK}
    makers = {"llguidance": Llguidance, "outlines-core": OutlinesCore}
    for name in filter(None, args.libs.split(",")):
        print(f"{name}:", flush=True)
        if name == "xgrammar":
            try:
                import xgrammar  # noqa: F401
            except Exception as exc:
                results[name] = {"import_error": f"{type(exc).__name__}: {exc}"}
                continue
            results[name] = {"note": "imports; not measured by this script"}
            continue
        try:
            lib = makers[name](args.tokenizer)
        except Exception as exc:
            results[name] = {"import_error": f"{type(exc).__name__}: {exc}"}
            continue
        results[name] = measure(lib)
    results["mlx_apply"] = {str(v): mlx_apply(v) for v in sorted({3072, vocab})}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
