"""trio-mlx's benchmark suite: ``python -m bench.suite [--quick] [--profile gpu]``.

Runs, side by side in one run, and writes ``bench/results/latest/<machine>/``
(``results.json``, ``results.md``, PNG plots):

1. engine overhead: ``engine.generate`` vs a bare ``BatchGenerator`` loop;
2. trio-mlx's server vs ``mlx_lm.server`` vs bare, closed-loop streaming chat;
3. fairness: serial requests among batch rows, and the reverse;
4. loop responsiveness: ``/health`` latency idle vs while rows decode;
5. memory after many mixed requests;
6. the prompt cache: TTFT with a shared long prefix vs a fresh one;
7. structured output: decode with every row constrained to a JSON schema vs
   unconstrained, and schema compile times (``--only structured`` runs it alone).
8. continuous traffic: closed-loop clients at many C and open-loop Poisson
   arrivals through both servers, against bare loops whose rows arrive together
   and staggered (:mod:`bench.suite.traffic`).
9. several LoRA adapters in one batch: decode tok/s with rows over 1, 2 and 4
   adapters vs all-base rows, the batch lane vs the serial lane for the same
   requests, and the per-step cost of each way to compute the adapted layers
   (:mod:`bench.suite.multilora`; only when ``--only`` names it).
10. agent sessions: ten turns of a coding agent, each adding a tool result to one
    long prompt, through both servers on tiny models of several architectures:
    TTFT and prompt-cache hits per turn, and the first turn after a restart from
    the disk tier (:mod:`bench.suite.agent`; only when ``--only`` names it).
11. speculative decoding (prompt lookup, the bundled draft), on and off, at several B
    (:mod:`bench.suite.speculative`; only when ``--only spec`` names it).
12. embeddings beside chat: embeddings/s alone and beside N chat streams, and the
    chat's tok/s ratio (:mod:`bench.suite.embed`; only when ``--only`` names it).

A part of trio-mlx that is not there yet (the engine API, ``trio-mlx serve``) is
reported as "not run: ..." and never replaced by made-up numbers. MLX work runs
in worker processes with an optimized BLAS preloaded; HTTP load comes from
client processes of its own (see :mod:`bench.suite.loadgen`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import attrs
from bench.suite import report, scenarios
from bench.suite.models import EOS_IDS, Model, prepare
from bench.suite.servers import mlx_lm_server, trio_mlx_help, trio_mlx_server

ROOT = Path(__file__).resolve().parents[2]

_COMMON: dict[str, Any] = {
    "prompt_len": 32,
    "prompt_words": 24,
    "server_rounds": 2,
    "prompt_cache": {"prefix_words": 400, "trials": 2},
    "structured_batches": [8, 32],
    # More rounds than the overhead part: the best of each side counts, and a
    # shared machine's load swings the rounds widely.
    "structured_rounds": 5,
    "multilora": {
        "batches": [8, 32],
        "max_tokens": 48,
        "prompt_len": 16,
        "rounds": 3,
        "serial_requests": 8,
        "steps": 24,
        "methods": ["grouped", "gather", "sorted", "dense"],
    },
    # Embeddings beside chat (bench.suite.embed): phases of `seconds` each.
    "embed": {
        "streams": [4, 16],
        "shares": [0.1, 0.3],
        "clients": 2,
        "inputs": 16,
        "input_tokens": 32,
        "max_tokens": 64,
        "prompt_len": 32,
        "seconds": 5.0,
        "rounds": 3,
        "batch_tokens": None,
    },
    # Speculative decoding (bench.suite.speculative): B rows of one trace, on and off.
    "spec": {
        "batches": [1, 4, 16, 64],
        "max_tokens": 128,
        "rounds": 3,  # the governor learns in the first; it counts only if it is best
        "min_seconds": 2.0,  # a round's passes of B requests last at least this long
        "min_passes": 3,  # and number at least this many a side (a CPU pass at B=64: 4 s)
        "num_draft_tokens": 4,
        "traces": ["edit", "recite", "draft", "repeat"],
    },
    # The agent part's session (bench.suite.agent_trace.AgentSize): about 8k tokens of
    # system prompt on a CPU, 24k on a GPU; tool results of 500-3,000 tokens.
    "agent": {"system_tokens": 8000, "turns": 10, "tool_tokens": [500, 3000], "max_tokens": 32},
}
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        **_COMMON,
        "batches": [1, 8, 32],
        "overhead_max_tokens": 64,
        "rounds": 2,
        "concurrency": [1, 8, 32],
        "max_tokens": 64,
        "requests_per_stream": 2,
        "fairness": {"batch_rows": 8, "batch_max_tokens": 160, "serial_max_tokens": 16,
                     "interval": 2.0, "duration": 10.0, "flood_streams": 2},
        "responsiveness": {"rows": 32, "max_tokens": 64, "interval": 0.05,
                           "idle_duration": 2.0, "busy_duration": 3.0, "delay": 1.0},
        "memory": {"requests": 200, "mark": 100, "concurrency": 8, "max_tokens": 24,
                   "max_prompt_words": 48, "serial_every": 5},
        "prompt_cache": {"prefix_words": 150, "trials": 2},
        "agent": {"system_tokens": 2000, "turns": 10, "tool_tokens": [200, 800], "max_tokens": 16},
        "traffic": {"concurrency": [1, 4, 16], "duration": 6.0, "warm": 1.5, "max_tokens": 64,
                    "bare_seconds": 4.0, "bare_warm": 1.0, "fractions": [0.5, 0.8, 1.0],
                    "open_duration": 6.0, "prompt_words_spread": [20, 400], "long_prompts": 2,
                    "long_tokens": 1000},
    },
    "full": {
        **_COMMON,
        "batches": [1, 8, 32],
        "overhead_max_tokens": 128,
        "rounds": 3,
        "concurrency": [1, 8, 32],
        "max_tokens": 128,
        "requests_per_stream": 3,
        "fairness": {"batch_rows": 8, "batch_max_tokens": 256, "serial_max_tokens": 16,
                     "interval": 3.0, "duration": 30.0, "flood_streams": 2},
        "responsiveness": {"rows": 32, "max_tokens": 128, "interval": 0.05,
                           "idle_duration": 3.0, "busy_duration": 6.0, "delay": 1.5},
        "memory": {"requests": 1000, "mark": 100, "concurrency": 8, "max_tokens": 32,
                   "max_prompt_words": 96, "serial_every": 5},
    },
    "gpu": {
        **_COMMON,
        "batches": [1, 8, 32, 64, 128],
        "overhead_max_tokens": 128,
        "rounds": 2,
        "concurrency": [1, 8, 32],
        "max_tokens": 128,
        "requests_per_stream": 2,
        "fairness": {"batch_rows": 32, "batch_max_tokens": 1024, "serial_max_tokens": 32,
                     "interval": 1.5, "duration": 10.0, "flood_streams": 4},
        "responsiveness": {"rows": 32, "max_tokens": 512, "interval": 0.02,
                           "idle_duration": 2.0, "busy_duration": 3.0, "delay": 0.5},
        "memory": {"requests": 1000, "mark": 100, "concurrency": 16, "max_tokens": 32,
                   "max_prompt_words": 256, "serial_every": 10},
        "prompt_cache": {"prefix_words": 3000, "trials": 2},
        "agent": {"system_tokens": 24000, "turns": 10, "tool_tokens": [500, 3000],
                  "max_tokens": 32},
        "multilora": {"batches": [8, 32], "max_tokens": 128, "prompt_len": 32, "rounds": 2,
                      "serial_requests": 8, "steps": 32,
                      "methods": ["grouped", "gather", "sorted", "dense"]},
        "traffic": {"concurrency": [1, 8, 32, 64, 128], "duration": 10.0, "warm": 2.0,
                    "max_tokens": 128, "bare_seconds": 6.0, "bare_warm": 2.0,
                    "fractions": [0.5, 0.8, 1.0], "open_duration": 15.0,
                    "prompt_words_spread": [20, 2000], "long_prompts": 3, "long_tokens": 4000},
        # The goal is set beside 32 chat streams.
        "embed": {**_COMMON["embed"], "streams": [8, 32], "shares": [0.1]},
        # A draft model at a real model's size: llama-1b and its own first block.
        "spec": {**_COMMON["spec"], "traces": [*_COMMON["spec"]["traces"], "draft-1b"]},
    },
}  # fmt: skip
PROFILES["full"]["traffic"] = {**PROFILES["quick"]["traffic"], "duration": 10.0,
                               "open_duration": 10.0}  # fmt: skip
#: HBM copy bandwidth of the H200 the B=1 bound divides by (bytes/s).
H200_BANDWIDTH = 4.3e12


class Log:
    """Progress lines with the time since the run started."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.start)
        print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {message}", flush=True)


def model_env() -> dict[str, str]:
    """The environment for processes that run MLX: an optimized BLAS preloaded where one exists,
    and the engine's MLX CUDA settings (unless set), so the bare loops and ``mlx_lm.server`` run
    under the same MLX settings as trio-mlx: like with like."""
    from trio_mlx._accel.settings import DEFAULTS
    from trio_mlx._start.blas import preload_env

    env = preload_env(dict(os.environ))
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _probe(env: dict[str, str], code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def environment(env: dict[str, str]) -> dict[str, Any]:
    """MLX, mlx-lm, the device and the BLAS, as a worker process sees them."""
    code = (
        "import json, importlib.metadata as m, mlx.core as mx\n"
        "from trio_mlx import backend_info\n"
        "i = backend_info()\n"
        "print(json.dumps({'mlx': m.version('mlx'), 'mlx_lm': m.version('mlx-lm'),"
        " 'device': str(mx.default_device()), 'cuda': mx.cuda.is_available(),"
        " 'blas': i.describe(),"
        " 'engine': hasattr(__import__('trio_mlx'), 'open_engine')}))"
    )
    info = json.loads(_probe(env, code) or "{}")
    info["cpus"] = os.cpu_count()
    if info.get("cuda"):
        from trio_mlx._accel.settings import DEFAULTS

        info["mlx_settings"] = {name: env.get(name) for name in DEFAULTS}
    return info


def run_job(
    job: dict[str, Any], env: dict[str, str], log: Log, notes: list[str]
) -> list[dict[str, Any]]:
    """Run an :mod:`bench.suite.inproc` job in a worker process; return its result lines."""
    command = [sys.executable, "-m", "bench.suite.inproc", json.dumps(job)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    results = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            record = json.loads(line[7:])
            results.append(record)
            if "batch" in record and "bare" in record:
                eng = record["engine"]
                tail = f", engine {eng['decode_tok_s'] or eng['e2e_tok_s']:,.0f}" if eng else ""
                bare = record["bare"]["decode_tok_s"] or record["bare"]["e2e_tok_s"]
                log(f"  B={record['batch']}: bare {bare:,.0f} tok/s{tail}")
    if proc.wait() != 0:
        message = f"worker job {job['kind']} exited with status {proc.returncode}"
        if not results:
            raise RuntimeError(message)
        # MLX can abort at interpreter exit ("terminate called without an active
        # exception"); the results were all reported by then, so keep them.
        log(f"  note: {message} after reporting its results")
        notes.append(f"{message} after reporting its results (kept)")
    return results


def _job(kind: str, model: Model, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "model": str(model.path), "logit_bias": model.logit_bias, **fields}


def chat_prompt_len(model: Model, words: int) -> int:
    """Tokens of a templated chat prompt of ``words`` random words, as the servers see it."""
    import random

    from bench.suite.loadgen import WORDS
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model.path)
    rng = random.Random(0)  # one generator: a fresh one per word repeated the first word
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    messages = [{"role": "user", "content": text}]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def client_processes() -> int:
    """Enough load-generator processes that none is busy (see client CPU in the report)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def traffic_profile(profile: dict[str, Any], model: Model) -> dict[str, Any]:
    """``profile`` for the traffic part on ``model``: its EOS bias, and the long and mixed
    prompts' lengths in words, cut to what the model's context holds."""
    p = {**profile, "logit_bias": {str(k): -100 for k in EOS_IDS} if model.logit_bias else None}
    t = dict(p["traffic"])
    context = json.loads((model.path / "config.json").read_text())["max_position_embeddings"]
    per_word = chat_prompt_len(model, 400) / 400
    room = context - t["max_tokens"] - 64
    t["long_words"] = int(min(t["long_tokens"], room) / per_word)
    lo, hi = t["prompt_words_spread"]
    t["prompt_words_spread"] = [lo, int(min(hi * per_word, room / 2) / per_word)]
    p["traffic"] = t
    p["prompt_words"] = 60
    return p


def _median(rows: list[dict[str, Any]], key: Any, *, upper: bool = False) -> dict[str, Any]:
    """The middle of ``rows`` by ``key``; of an even count the lower (or ``upper``) one."""
    ranked = sorted(rows, key=key)
    return ranked[len(ranked) // 2 if upper else (len(ranked) - 1) // 2]


def summarize_rounds(
    data: dict[str, Any],
    bares: list[dict[str, Any]],
    closed: dict[str, dict[int, list[dict[str, Any]]]],
    longs: dict[str, list[dict[str, Any]]],
) -> None:
    """The traffic part's tables from its rounds so far: each server's median round.

    ``data["bare"]`` gets, per C, the median round of each bare reference, and each
    server's row its median round by tok/s (the lower of two) with every round's tok/s
    and ratios to that same round's bare loops; the long arrivals keep the median round
    by their gap ratio (the worse of two), with every round's ratio and tok/s.
    """

    def tok_s(record: dict[str, Any]) -> float:
        return float(record.get("tok_s") or 0.0)

    bare: dict[str, Any] = {}
    for c in {c for b in bares for c in b}:
        runs = [b[c] for b in bares if c in b]
        record = dict(runs[0])
        for kind in ("together", "staggered"):
            record[kind] = _median([x[kind] for x in runs], tok_s)
            record[f"rounds_{kind}"] = [x[kind].get("tok_s") for x in runs]
        bare[c] = record
    data["bare"] = bare
    data["servers"] = {}
    for name, per_c in closed.items():
        rows = []
        for c, runs in per_c.items():
            row = dict(_median(runs, tok_s))
            row["rounds_tok_s"] = [x["tok_s"] for x in runs]
            for kind in ("together", "staggered"):
                row[f"rounds_x_{kind}"] = [
                    _ratio_or_none(x["tok_s"], bares[x["round"]].get(str(c), {}).get(kind, {}))
                    for x in runs
                ]
            rows.append(row)
        data["servers"][name] = rows
    data["long"] = {}
    for name, runs in longs.items():
        if runs:
            row = dict(_median(runs, lambda x: x.get("during_p99_over_p50") or 0.0, upper=True))
            row["rounds_ratio"] = [x.get("during_p99_over_p50") for x in runs]
            row["rounds_tok_s"] = [x.get("tok_s") for x in runs]
            data["long"][name] = row


def _ratio_or_none(value: Any, reference: dict[str, Any]) -> float | None:
    """``value`` over the reference record's tok/s, or None if either is missing."""
    base = reference.get("tok_s")
    return float(value) / float(base) if value and base else None


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """``--variant LABEL:VAR=VALUE,--flag=VALUE``: its label, environment and server flags."""
    label, sep, rest = text.partition(":")
    if not sep or not label or not rest:
        raise SystemExit(f"--variant {text!r}: expected LABEL:SETTING[,SETTING...]")
    env: dict[str, str] = {}
    flags: list[str] = []
    for item in rest.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant {text!r}: {item!r} is not NAME=VALUE")
        if name.startswith("--"):
            flags += [name, value]
        else:
            env[name] = value
    return label, env, flags


class Suite:
    """One run: the profile, the models, what is available, and the results so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log = Log()
        self.profile = {**PROFILES[args.profile], "client_processes": client_processes()}
        if args.batches:
            self.profile["batches"] = [int(b) for b in args.batches.split(",")]
        if args.concurrency:
            cs = [int(c) for c in args.concurrency.split(",")]
            self.profile["traffic"] = {**self.profile["traffic"], "concurrency": cs}
        self.traffic_parts = set(args.traffic.split(","))
        self.variants = [parse_variant(v) for v in args.variant]
        self.env = model_env()
        self.out = (
            Path(args.out) if args.out else ROOT / "bench" / "results" / "latest" / args.machine
        )
        self.results: dict[str, Any] = {
            "machine": args.machine,
            "profile": args.profile,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "not_run": [],
            "notes": [],
        }

    def not_run(self, reason: str) -> None:
        self.log(f"not run: {reason}")
        self.results["not_run"].append(reason)

    def run(self) -> None:
        log, only = self.log, set(self.args.only.split(",")) if self.args.only else None
        log(f"profile {self.args.profile}; results to {self.out}")
        self.results["env"] = env = environment(self.env)
        log(f"{env.get('device')}; mlx {env.get('mlx')}; {env.get('blas')}")
        self.engine = bool(env.get("engine"))
        self.server = trio_mlx_help(self.env) is not None
        if not self.engine:
            self.not_run("engine overhead and memory: trio_mlx.open_engine does not exist yet")
        if not self.server:
            self.not_run("trio-mlx server: `trio-mlx serve --help` does not work yet")
        # The agent part brings its own models: a run of it alone builds no other.
        names = [] if only == {"agent"} else self.model_names()
        models = [prepare(name, log) for name in names]
        self.results["models"] = {
            m.name: {
                "parameters": m.parameters,
                "weight_bytes": m.weight_bytes,
                "path": str(m.path),
            }
            for m in models
        }

        def wanted(part: str) -> bool:
            return only is None or part in only

        # Results are written after every part, so a run cut short still leaves its numbers.
        for i, model in enumerate(models):
            if wanted("overhead"):
                self.overhead(model)
                self.bound(models[0])
                self.write()
            http_parts = ("server", "fairness", "responsiveness", "prompt_cache")
            if any(map(wanted, http_parts)) and (i == 0 or self.args.profile == "full"):
                self.servers(model, first=i == 0, wanted=wanted)
                self.write()
        if wanted("memory") and self.engine:
            self.memory(models[0])
            self.write()
        if wanted("structured") and self.engine:
            self.structured(models[0])
            self.write()
        # Opt-in: as long as the rest of the GPU profile, which must fit one device call.
        if only is not None and "multilora" in only and self.engine:
            self.multilora(models[0])
            self.write()
        if only is not None and "embed" in only and self.engine:
            self.embed(models[0])
            self.write()
        if only is not None and "spec" in only and self.engine:
            self.spec(models[0])
            self.write()
        if wanted("traffic"):
            self.traffic(models[0])
        # Opt-in: its own models, and two server starts per model beyond the session's.
        if only is not None and "agent" in only:
            self.agent()
        self.write()
        log(f"wrote {self.out}/results.md")

    def write(self) -> None:
        self.results["duration_s"] = time.monotonic() - self.log.start
        report.write(self.results, self.out)

    def model_names(self) -> list[str]:
        if self.args.models:
            return self.args.models.split(",")
        if self.args.profile == "gpu":
            return ["llama-1b"]
        from trio_mlx.default_model import default_model_path

        trained = (default_model_path() / "config.json").exists()
        if not trained:
            self.not_run("the bundled default model: not trained yet (random-25m only)")
        names = ["default"] if trained else []
        return [*names, "random-25m"] if self.args.profile == "full" or not names else names

    def overhead(self, model: Model) -> None:
        p = self.profile
        self.log(f"1. engine overhead on {model.name}: B = {p['batches']}")
        job = _job("overhead", model, batches=p["batches"], max_tokens=p["overhead_max_tokens"],
                   rounds=p["rounds"], prompt_len=p["prompt_len"], engine=self.engine)  # fmt: skip
        rows = []
        for record in run_job(job, self.env, self.log, self.results["notes"]):
            bare, eng = record["bare"], record["engine"]
            ratio = (
                eng["decode_tok_s"] / bare["decode_tok_s"]
                if eng and bare["decode_tok_s"] and eng["decode_tok_s"]
                else None
            )
            rows.append(
                {
                    "batch": record["batch"],
                    "bare": bare,
                    "engine": eng,
                    "ratio": ratio,
                    "paired": record.get("paired"),
                }
            )
        self.results.setdefault("overhead", {})[model.name] = rows

    def servers(self, model: Model, *, first: bool, wanted: Any) -> None:
        p = {
            **self.profile,
            "logit_bias": {str(k): -100 for k in EOS_IDS} if model.logit_bias else None,
        }
        cs = p["concurrency"]
        # The shared prefix must fit the model's context: trio-mlx answers 400 beyond it.
        context = json.loads((model.path / "config.json").read_text())["max_position_embeddings"]
        words = min(p["prompt_cache"]["prefix_words"], context // 3)
        p["prompt_cache"] = {**p["prompt_cache"], "prefix_words": words}
        length = chat_prompt_len(model, p["prompt_words"])
        data: dict[str, Any] = {"bare": {}, "servers": {}, "prompt_tokens": length}
        if wanted("server"):
            self.log(f"2. bare ceiling on {model.name}: C = {cs}, {length}-token prompts")
            job = _job("overhead", model, batches=cs, max_tokens=p["max_tokens"], rounds=2,
                       prompt_len=length, engine=False)  # fmt: skip
            for r in run_job(job, self.env, self.log, self.results["notes"]):
                data["bare"][str(r["batch"])] = r["bare"]
            self.results.setdefault("server", {})[model.name] = data
        logs = self.out / "logs"
        starters: dict[str, Any] = {
            "mlx_lm.server": lambda: mlx_lm_server(
                model.path, max_batch=max(cs), env=self.env, log_dir=logs
            )
        }
        drains = (1.0, None) if first and wanted("fairness") else (1.0,)
        for drain in drains if self.server else ():
            starters[f"trio-mlx (drain {drain})"] = lambda d=drain: trio_mlx_server(
                model.path, max_batch=max(cs), env=self.env, log_dir=logs, drain_timeout=d
            )
        # Every server stays up for the whole part and the throughput rounds alternate
        # between them: on a shared machine, load that comes and goes hits all alike.
        with contextlib.ExitStack() as stack:
            running = self._start_servers(stack, starters, model, p, f"{{}} on {model.name}")
            main = {n: s for n, s in running.items() if n != "trio-mlx (drain None)"}
            if wanted("server"):
                self._throughput(data, main, p)
            for name, server in running.items() if first else ():
                try:
                    self._server_extras(name, server, p, main=name in main, wanted=wanted)
                except Exception as exc:
                    self.not_run(f"{name} extras on {model.name}: {type(exc).__name__}: {exc}")

    def _start_servers(
        self,
        stack: contextlib.ExitStack[Any],
        starters: dict[str, Any],
        model: Model,
        p: dict[str, Any],
        failure: str,
    ) -> dict[str, Any]:
        """Start and warm each server on ``stack``; the ones that came up, by name.

        One server failing must not lose the others: it is reported as not run,
        under ``failure`` with its name filled in.
        """
        running: dict[str, Any] = {}
        for name, start in starters.items():
            self.log(f"starting {name} on {model.name}")
            try:
                running[name] = stack.enter_context(start())
                self._warm(running[name], p)
            except Exception as exc:
                self.not_run(f"{failure.format(name)}: {type(exc).__name__}: {exc}")
        return running

    def _throughput(self, data: dict[str, Any], servers: dict[str, Any], p: dict[str, Any]) -> None:
        """Each concurrency, ``server_rounds`` rounds over all servers in turn; the best counts."""
        for c in p["concurrency"]:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
            for _ in range(p["server_rounds"]):
                for name, server in servers.items():
                    runs[name].append(scenarios.throughput(server, p, c))
            for name, rows in runs.items():
                best = {**max(rows, key=lambda r: r["tok_s"]), "rounds": [r["tok_s"] for r in rows]}
                data["servers"].setdefault(name, []).append(best)
                self.log(f"  {name} C={c}: {best['tok_s']:,.0f} tok/s (rounds "
                         f"{', '.join(f'{t:,.0f}' for t in best['rounds'])}), TTFT p99 "
                         f"{report.ms(best['ttft_p99_s'])} ms, exact tokens {best['exact_tokens']}, "
                         f"failed {best['failed']}")  # fmt: skip

    def _server_extras(
        self, name: str, server: Any, p: dict[str, Any], *, main: bool, wanted: Any
    ) -> None:
        if wanted("fairness"):
            self.log(f"3. fairness on {name} ({2 * p['fairness']['duration']:.0f} s)")
            f = scenarios.fairness(server, p)
            self.results.setdefault("fairness", {})[name] = f
            self.log(f"  serial wait p50/p99 {report.ms(f['serial_wait']['ttft_p50_s'])}/"
                     f"{report.ms(f['serial_wait']['ttft_p99_s'])} ms")  # fmt: skip
        if main and wanted("responsiveness"):
            self.log(f"4. /health latency on {name}")
            r = scenarios.responsiveness(server, p)
            self.results.setdefault("responsiveness", {})[name] = r
            self.log(
                f"  idle p99 {report.ms(r['idle']['p99_s'])} ms, busy p99 {report.ms(r['busy']['p99_s'])} ms"
            )
        if main and wanted("prompt_cache"):
            self.log(f"6. prompt cache on {name}")
            self.results.setdefault("prompt_cache", {})[name] = scenarios.prompt_cache(server, p)

    def _warm(self, server: Any, p: dict[str, Any]) -> None:
        """One request at each concurrency level, so no timed run pays for compilation."""
        for c in p["concurrency"]:
            scenarios.throughput(server, {**p, "requests_per_stream": 1, "max_tokens": 8}, c)

    def memory(self, model: Model) -> None:
        m = self.profile["memory"]
        self.log(f"5. memory: {m['requests']} mixed requests through the engine on {model.name}")
        (record,) = run_job(_job("memory", model, **m), self.env, self.log, self.results["notes"])
        self.results["memory"] = {**record, "model": model.name, **m}

    def traffic(self, model: Model) -> None:
        """Part 8: continuous traffic (see :mod:`bench.suite.traffic`).

        Every server is started up front and stays up for the part. Each of
        ``--traffic-rounds`` rounds runs the bare references, then every server in
        turn (the order reversed every other round) through each C's closed loop
        and the long arrivals; so a round's ratios are side by side, and load that
        comes and goes on the machine hits every server alike. The tables show
        each server's median round and list every round's ratio to its own
        round's bare loop (a fresh H200 server's figure moved by up to 40% between
        two servers with the same settings). The open loop runs once, after.
        """
        from bench.suite import traffic

        p = traffic_profile(self.profile, model)
        t = p["traffic"]
        cs = t["concurrency"]
        rounds = self.args.traffic_rounds
        length = chat_prompt_len(model, p["prompt_words"])
        data: dict[str, Any] = {"settings": t, "prompt_tokens": length, "servers": {}, "open": {}}
        data["rounds"] = rounds
        data["variants"] = {
            label: {"env": env, "flags": flags} for label, env, flags in self.variants
        }
        self.results["traffic"] = data
        job = _job("closed", model, batches=cs, max_tokens=t["max_tokens"], prompt_len=length,
                   seconds=t["bare_seconds"], warm_seconds=t["bare_warm"])  # fmt: skip
        logs = self.out / "logs"
        # trio-mlx first: its capacity sets the open-loop rates for every server.
        starters: dict[str, Any] = {}
        if self.server:
            starters["trio-mlx"] = lambda: trio_mlx_server(
                model.path, max_batch=max(cs), env=self.env, log_dir=logs
            )
            for label, env, flags in self.variants:
                starters[f"trio-mlx ({label})"] = partial(
                    trio_mlx_server, model.path, max_batch=max(cs), env={**self.env, **env},
                    log_dir=logs / label, extra=flags,
                )  # fmt: skip
        if not self.args.no_mlx_lm_server:
            starters["mlx_lm.server"] = lambda: mlx_lm_server(
                model.path, max_batch=max(cs), env=self.env, log_dir=logs
            )
        closed: dict[str, dict[int, list[dict[str, Any]]]] = {}
        longs: dict[str, list[dict[str, Any]]] = {}
        bares: list[dict[str, Any]] = []
        data["bare_rounds"] = bares
        with contextlib.ExitStack() as stack:
            warm = {**p, "concurrency": cs}
            running = self._start_servers(stack, starters, model, warm, "traffic on {}")
            for r in range(rounds):
                self.log(f"8. continuous traffic on {model.name}, round {r + 1} of {rounds}: "
                         f"bare closed loops, C = {cs}")  # fmt: skip
                bares.append(traffic.bare(job, self.env, self.log))
                order = list(running) if r % 2 == 0 else list(reversed(running))
                for name in order:
                    try:
                        self._traffic_round(running[name], name, p, r, bares[-1],
                                            closed.setdefault(name, {}),
                                            longs.setdefault(name, []))  # fmt: skip
                    except Exception as exc:  # one server failing must not lose the others
                        self.not_run(f"traffic on {name}, round {r + 1}: "
                                     f"{type(exc).__name__}: {exc}")  # fmt: skip
                summarize_rounds(data, bares, closed, longs)
                self.write()
            if "open" in self.traffic_parts and running:
                self._open_loops(data, running, p)

    def _traffic_round(
        self,
        server: Any,
        name: str,
        p: dict[str, Any],
        r: int,
        bare: dict[str, Any],
        closed: dict[int, list[dict[str, Any]]],
        longs: list[dict[str, Any]],
    ) -> None:
        """One round of the closed loops (each C) and the long arrivals on one server."""
        from bench.suite import traffic

        cs = p["traffic"]["concurrency"]
        for c in cs if "closed" in self.traffic_parts else ():
            row = {**traffic.closed(server, p, c), "round": r}
            closed.setdefault(c, []).append(row)
            together = bare.get(str(c), {}).get("together", {}).get("tok_s")
            self.log(f"  {name} C={c}: {row['tok_s'] or 0:,.0f} tok/s (x"
                     f"{report._ratio(row['tok_s'], together)} together), TTFT p50/p99 "
                     f"{report.ms(row['ttft_p50_s'])}/{report.ms(row['ttft_p99_s'])} ms, ITL "
                     f"p50/p99 {report.ms(row['itl_p50_s'])}/{report.ms(row['itl_p99_s'])} ms, "
                     f"GPU {report._num(row['gpu_busy_pct'])}%, GPU GiB {report._gpu_gib(row)}, "
                     f"worker {report._num(row.get('worker_busy'), 2)}")  # fmt: skip
        if "long" in self.traffic_parts:
            row = {**traffic.long_arrival(server, p, max(cs)), "round": r}
            longs.append(row)
            self.log(f"  {name} C={max(cs)} with {row['long_arrivals']} long prompts: "
                     f"ITL p50 {report.ms(row['itl_p50_s'])} ms, during long p99 "
                     f"{report.ms(row['itl_during_long_p99_s'])} ms (x"
                     f"{report._num(row['during_p99_over_p50'], 1)}), long TTFT "
                     f"{', '.join(report.ms(x) for x in row['long_ttft_s'])} ms, GPU GiB "
                     f"{report._gpu_gib(row)}")  # fmt: skip
            for line in row["slow_steps"]:
                self.log(f"    {name} slow step: {line}")

    def _open_loops(self, data: dict[str, Any], running: dict[str, Any], p: dict[str, Any]) -> None:
        """The open loop on every server, at fractions of the first server's capacity."""
        from bench.suite import traffic

        t = p["traffic"]
        first = next(iter(running))
        # Capacity for the open loop's prompt mix: a closed loop at the largest C with
        # prompts drawn from the same spread.
        cap = traffic.closed(running[first], p, max(t["concurrency"]), mixed=True)
        data["capacity_run"] = cap
        capacity = cap["req_s"] or 1.0
        data["capacity_req_s"] = capacity
        self.log(f"  {first} capacity with the open loop's prompts: {capacity:.1f} req/s")
        for name, server in running.items():
            try:
                opens = data["open"].setdefault(name, [])
                for k, fraction in enumerate(t["fractions"]):
                    row = traffic.open_loop(server, p, capacity * fraction, seed=k)
                    row["fraction"] = fraction
                    opens.append(row)
                    self.log(f"  {name} open loop {fraction:.0%} ({row['rate']:.1f} req/s): "
                             f"{row['tok_s'] or 0:,.0f} tok/s, TTFT p50/p99 "
                             f"{report.ms(row['ttft_p50_s'])}/{report.ms(row['ttft_p99_s'])} ms, "
                             f"ITL p50/p99 {report.ms(row['itl_p50_s'])}/"
                             f"{report.ms(row['itl_p99_s'])} ms, during long prompts p99 "
                             f"{report.ms(row['itl_during_long_p99_s'])} ms, failed "
                             f"{row['failed']}")  # fmt: skip
                    self.write()
            except Exception as exc:  # one server failing must not lose the others
                self.not_run(f"open loop on {name}: {type(exc).__name__}: {exc}")

    def agent(self) -> None:
        """Part 10: an agent session on tiny models of each architecture (:mod:`bench.suite.agent`)."""
        from bench.suite import agent
        from bench.suite.agent_trace import AgentSize, context_needed
        from bench.suite.models import agent_model

        size = AgentSize.from_dict(self.profile["agent"])
        if self.args.agent_system_tokens:
            size = attrs.evolve(size, system_tokens=self.args.agent_system_tokens)
        context = context_needed(size)
        help_text = trio_mlx_help(self.env) or ""
        disk_tier = agent.CACHE_DIR_FLAG in help_text
        data: dict[str, Any] = {"settings": attrs.asdict(size), "context": context,
                                "disk_tier": disk_tier, "models": {}}  # fmt: skip
        self.results["agent"] = data
        if not disk_tier:
            self.not_run(f"agent restart on the disk tier: `trio-mlx serve` has no "
                         f"{agent.CACHE_DIR_FLAG} flag yet")  # fmt: skip
        for model_type in self.args.agent_models.split(","):
            try:
                model = agent_model(model_type, context, self.log)
            except Exception as exc:
                self.not_run(f"agent session on {model_type}: {type(exc).__name__}: {exc}")
                continue
            self.log(f"10. agent session on {model_type}: {size.system_tokens}-token system "
                     f"prompt, {size.turns} turns of {size.tool_tokens[0]}-"
                     f"{size.tool_tokens[1]}-token tool results")  # fmt: skip
            result = agent.run_model(model, size, env=self.env, disk_tier=disk_tier,
                                     log_dir=self.out / "logs" / "agent" / model_type,
                                     log=self.log,
                                     mlx_lm=not self.args.no_mlx_lm_server)  # fmt: skip
            for error in result["errors"]:
                self.not_run(f"agent session on {model_type}, {error}")
            data["models"][model_type] = result
            self.results["models"][f"agent {model_type}"] = {
                "parameters": model.parameters, "weight_bytes": model.weight_bytes,
                "path": str(model.path),
            }  # fmt: skip
            self.log(report.agent_line(model_type, result))
            self.write()

    def structured(self, model: Model) -> None:
        p = self.profile
        self.log(f"7. structured output on {model.name}: B = {p['structured_batches']}")
        job = _job("structured", model, batches=p["structured_batches"],
                   rounds=p["structured_rounds"],
                   max_tokens=p["overhead_max_tokens"], prompt_len=p["prompt_len"])  # fmt: skip
        rows, compiles = [], None
        for record in run_job(job, self.env, self.log, self.results["notes"]):
            if record["job"] == "structured_compile":
                compiles = record
                continue
            free, con = record["unconstrained"], record["constrained"]
            ratio = (
                con["decode_tok_s"] / free["decode_tok_s"]
                if con["decode_tok_s"] and free["decode_tok_s"]
                else None
            )
            rows.append({**record, "ratio": ratio})
            self.log(f"  B={record['batch']}: unconstrained {free['decode_tok_s'] or 0:,.0f}, "
                     f"constrained {con['decode_tok_s'] or 0:,.0f} tok/s")  # fmt: skip
        self.results["structured"] = {"model": model.name, "rows": rows, "compile": compiles}

    def multilora(self, model: Model) -> None:
        """Part 9: rows under several LoRA adapters (see :mod:`bench.suite.multilora`)."""
        from bench.suite import multilora

        m = self.profile["multilora"]
        self.log(f"9. several LoRA adapters in one batch on {model.name}: B = {m['batches']}")
        records = run_job(_job("multilora", model, **m), self.env, self.log, self.results["notes"])
        for r in records:
            if r["job"] == "multilora_error":
                self.not_run(f"multilora {r['part']} on {model.name}: {r['error']}")
            elif r["job"] == "multilora_methods":
                self.log(f"  B={r['batch']} {r['case']} {r['method'] or 'base'}: {r['ms']:.2f} ms")
            elif r["job"] == "multilora_engine_methods":
                rate = r["result"]["decode_tok_s"] or 0
                self.log(f"  B={r['batch']} {r['case']}, {r['method']}: {rate:,.0f} tok/s")
            else:
                rate = r["result"]["decode_tok_s" if r["job"] == "multilora_rows" else "e2e_tok_s"]
                label = r.get("case") or f"{r['requests']} requests, {r['lane']} lane"
                self.log(f"  B={r.get('batch', r.get('rows'))} {label}: {rate or 0:,.0f} tok/s")
        self.results["multilora"] = multilora.collect(records, model.name, m)

    def embed(self, model: Model) -> None:
        """Part 12: embeddings beside chat (see :mod:`bench.suite.embed`)."""
        e = {**self.profile["embed"]}
        if self.args.concurrency:
            e["streams"] = [int(c) for c in self.args.concurrency.split(",")]
        self.log(f"12. embeddings beside chat on {model.name}: N = {e['streams']}")
        records = run_job(_job("embed", model, **e), self.env, self.log, self.results["notes"])
        for r in records:
            self.log(
                f"  N={r['streams']} share {r['share']:g}: embeddings/s "
                f"{r['embed_alone']['embeddings_s']:,.1f} alone, "
                f"{r['together']['embeddings_s']:,.1f} beside chat; chat tok/s "
                f"{r['chat_alone']['chat_tok_s']:,.0f} alone, {r['together']['chat_tok_s']:,.0f} "
                f"beside embeddings ({r['chat_ratio'] or 0:.2f}x)"
            )
        self.results["embed"] = {"model": model.name, "settings": e, "rows": records}

    def spec(self, model: Model) -> None:
        """Part 11: speculative decoding (see :mod:`bench.suite.speculative`)."""
        from bench.suite.models import cache_dir

        m = {**self.profile["spec"], "cache": str(cache_dir())}
        if self.args.batches:
            m["batches"] = [int(b) for b in self.args.batches.split(",")]
        self.log(f"11. speculative decoding: B = {m['batches']}")
        records = run_job(_job("spec", model, **m), self.env, self.log, self.results["notes"])
        for r in records:
            acc = r["on"]["acceptance"]
            self.log(f"  {r['trace']} B={r['batch']}: off {r['off']['decode_tok_s']:,.0f}, on "
                     f"{r['on']['decode_tok_s']:,.0f} tok/s, acceptance "
                     f"{'-' if acc is None else f'{acc:.0%}'}")  # fmt: skip
        self.results["spec"] = {"settings": m, "rows": records}

    def bound(self, model: Model) -> None:
        if self.args.profile != "gpu":
            return
        bound = H200_BANDWIDTH / model.weight_bytes
        rows = self.results.get("overhead", {}).get(model.name, [])
        b1 = next((r for r in rows if r["batch"] == 1), None)
        out: dict[str, Any] = {
            "weight_bytes": model.weight_bytes,
            "bandwidth_tb_s": 4.3,
            "bound_tok_s": bound,
        }
        if b1:
            out["bare_tok_s"] = b1["bare"]["decode_tok_s"]
            out["bare_fraction"] = (b1["bare"]["decode_tok_s"] or 0) / bound
            if b1["engine"]:
                out["engine_tok_s"] = b1["engine"]["decode_tok_s"]
                out["engine_fraction"] = (b1["engine"]["decode_tok_s"] or 0) / bound
        self.results["bound"] = out


def main() -> None:
    """Parse the command line and run the suite."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_const", const="quick", dest="profile", help="--profile quick"
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), help="default: full")
    parser.add_argument(
        "--machine", default=None, help="results go to bench/results/latest/MACHINE/"
    )
    parser.add_argument(
        "--models", help="comma-separated: default, random-25m, llama-1b, tiny, tiny-128k"
    )
    parser.add_argument("--only", help="comma-separated parts: overhead, server, fairness, "
                        "responsiveness, prompt_cache, memory, structured, "
                        "multilora, embed, traffic, agent, spec")  # fmt: skip
    parser.add_argument("--out", help="write here instead of bench/results/latest/MACHINE/")
    parser.add_argument("--batches", help="comma-separated B for the overhead part "
                        "(default: the profile's)")  # fmt: skip
    parser.add_argument("--concurrency", help="comma-separated C for the traffic part "
                        "(default: the profile's)")  # fmt: skip
    parser.add_argument("--traffic", default="closed,long,open",
                        help="the traffic part's measures: closed (closed loops per C), long "
                        "(long prompts among C - 1 streams), open (Poisson arrivals)")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:SETTING,...",
                        help="the traffic part also runs trio-mlx with these settings, as "
                        "'trio-mlx (LABEL)': VAR=VALUE sets an environment variable, --flag=VALUE "
                        "a server flag (repeatable), e.g. 'no-cudnn:MLX_CUDA_USE_CUDNN_SDPA=0'")  # fmt: skip
    parser.add_argument("--traffic-rounds", type=int, default=1, metavar="R",
                        help="the traffic part's rounds: every server stays up and each round "
                        "runs the bare loops, then every server in turn; the tables show "
                        "the median round and list every round's ratios")  # fmt: skip
    parser.add_argument("--agent-models", default="llama,gemma3_text,qwen3_next,gpt_oss",
                        help="the agent part's architectures (tiny random models, comma-separated; "
                        "llama-1b: a random llama of Llama-3.2-1B's shape)")  # fmt: skip
    parser.add_argument("--agent-system-tokens", type=int, default=None, metavar="N",
                        help="the agent part's system prompt in tokens (default: the profile's)")  # fmt: skip
    parser.add_argument("--no-mlx-lm-server", action="store_true",
                        help="the traffic part runs trio-mlx (and its variants) only: for "
                        "variant-only runs; every ratio to mlx_lm.server needs it")  # fmt: skip
    parser.set_defaults(profile="full")
    args = parser.parse_args()
    if args.machine is None:
        args.machine = "gpu" if args.profile == "gpu" else "cpu"
    Suite(args).run()


if __name__ == "__main__":
    main()
