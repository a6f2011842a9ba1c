"""Write a run's results: ``results.json``, ``results.md`` (tables) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.suite import embed, multilora, speculative


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def ms(value: Any) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _overhead_md(results: dict[str, Any]) -> list[str]:
    if not results.get("overhead"):
        return []  # not run (e.g. --only structured)
    lines = ["## 1. Engine overhead: `engine.generate` vs a bare `BatchGenerator` loop", ""]
    lines += [
        "Decode tokens/s in the steady state (every row decoding), best of the rounds; "
        "goal: engine/bare >= 0.97 at every B.",
        "",
        "The last four columns are medians over the rounds, each engine run against the "
        "bare run just before it: tok/s ratio, CPU seconds per token ratio (all threads), "
        "the engine's Trio-thread CPU per token (actor, routing, consumers) and the share "
        "of the wall time its MLX thread ran calls.",
        "",
        "| model | B | bare tok/s | engine tok/s | engine/bare | bare e2e | engine e2e "
        "| paired ratio | CPU/token ratio | Trio us/token | MLX thread busy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model, rows in results.get("overhead", {}).items():
        for row in rows:
            bare, eng, paired = row["bare"], row["engine"] or {}, row.get("paired") or {}
            busy = paired.get("worker_busy")
            lines.append(
                f"| {model} | {row['batch']} | {_num(bare['decode_tok_s'])} | "
                f"{_num(eng.get('decode_tok_s'))} | {_ratio(eng.get('decode_tok_s'), bare['decode_tok_s'])} | "
                f"{_num(bare['e2e_tok_s'])} | {_num(eng.get('e2e_tok_s'))} | "
                f"{_num(paired.get('ratio'), 2)} | {_num(paired.get('cpu_ratio'), 2)} | "
                f"{_num(paired.get('trio_cpu_us_per_token'), 1)} | "
                f"{'-' if busy is None else f'{busy:.0%}'} |"
            )
    return [*lines, ""]


def _server_md(results: dict[str, Any]) -> list[str]:
    if not results.get("server"):
        return []
    lines = ["## 2. Servers vs bare: closed-loop streaming chat", ""]
    lines += [
        "Aggregate output tokens/s of C streaming clients (in separate processes), "
        "TTFT and request latency in ms; `x bare` divides by a bare `BatchGenerator` "
        "run of C rows with the same prompt length and max_tokens, end to end (prompt "
        "processing and tail included), `x bare decode` by its steady-state decode rate. "
        "`failed (retries)`: requests that failed, and connections retried before any "
        "response (as the `openai` client does). `client CPU` is the busiest client "
        "process's CPU use (1.0 = one core); `server CPU` the server process's.",
        "",
        "| model | server | C | tok/s | x bare | x bare decode | TTFT p50 | TTFT p99 | latency p50 | latency p99 | exact tokens | failed (retries) | client CPU | server CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for model, data in results.get("server", {}).items():
        bare = data.get("bare", {})
        for c, b in sorted(bare.items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {model} | bare BatchGenerator | {c} | {_num(b['e2e_tok_s'])} | 1.00 | "
                f"{_num(b['decode_tok_s'])} tok/s | {ms(b['ttft_max_s'])} (max) | | | | "
                f"{b['complete']} | | | |"
            )
        for name, rows in data.get("servers", {}).items():
            for row in rows:
                ceiling = bare.get(str(row["concurrency"]), {})
                lines.append(
                    f"| {model} | {name} | {row['concurrency']} | {_num(row['tok_s'])} | "
                    f"{_ratio(row['tok_s'], ceiling.get('e2e_tok_s'))} | "
                    f"{_ratio(row['tok_s'], ceiling.get('decode_tok_s'))} | {ms(row['ttft_p50_s'])} | "
                    f"{ms(row['ttft_p99_s'])} | {ms(row['latency_p50_s'])} | "
                    f"{ms(row['latency_p99_s'])} | {row.get('exact_tokens')} | "
                    f"{row['failed']} ({row.get('retries', 0)}) | "
                    f"{row['client_cpu_max']:.2f} | {row['server_cpu']:.2f} |"
                )
        vs = _server_ratios(data)
        if vs:
            lines += ["", f"trio-mlx / mlx_lm.server tok/s ({model}): {vs}"]
    return [*lines, ""]


def _server_ratios(data: dict[str, Any]) -> str:
    servers = data.get("servers", {})
    ref = {r["concurrency"]: r["tok_s"] for r in servers.get("mlx_lm.server", [])}
    out = []
    for name, rows in servers.items():
        if name.startswith("trio-mlx"):
            out += [
                f"C={r['concurrency']}: {_ratio(r['tok_s'], ref.get(r['concurrency']))}"
                for r in rows
            ]
    return ", ".join(out)


def _fairness_md(results: dict[str, Any]) -> list[str]:
    data = results.get("fairness", {})
    if not data:
        return []
    lines = [
        "## 3. Fairness: a serial (seeded) request among sustained batch rows, and the reverse",
        "",
    ]
    lines += [
        "Wait = time to first token, ms.",
        "",
        "| server | serial wait p50 | serial wait p99 | batch-row wait p50 under a serial flood | p99 | batch tok during probe | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, f in data.items():
        s, r, b = (
            f["serial_wait"],
            f["batch_wait_under_serial_flood"],
            f["batch_during_serial_probe"],
        )
        failed = s["failed"] + r["failed"] + b["failed"] + f["serial_flood"]["failed"]
        lines.append(
            f"| {name} | {ms(s['ttft_p50_s'])} | {ms(s['ttft_p99_s'])} | "
            f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {b['tokens']} | {failed} |"
        )
    return [*lines, ""]


def _responsiveness_md(results: dict[str, Any]) -> list[str]:
    data = results.get("responsiveness", {})
    if not data:
        return []
    lines = ["## 4. Loop responsiveness: `GET /health` latency, ms", ""]
    lines += [
        "| server | idle p50 | idle p99 | busy p50 | busy p99 | busy max | rows |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in data.items():
        i, b = r["idle"], r["busy"]
        lines.append(
            f"| {name} | {ms(i['p50_s'])} | {ms(i['p99_s'])} | {ms(b['p50_s'])} | "
            f"{ms(b['p99_s'])} | {ms(b['max_s'])} | {r['rows']} |"
        )
    return [*lines, ""]


def _memory_md(results: dict[str, Any]) -> list[str]:
    data = results.get("memory")
    if not data:
        return []
    snaps = data["snapshots"]
    keys = sorted(snaps, key=int)
    mib = 1 << 20
    lines = ["## 5. Memory after mixed requests through the engine", ""]
    lines += [
        "| after requests | RSS MiB | peak RSS MiB | MLX active MiB | MLX cache MiB | MLX peak MiB |"
    ]
    lines += ["| ---: | ---: | ---: | ---: | ---: | ---: |"]

    def cache(s: dict[str, Any]) -> str:  # not recorded by runs before it was added
        return f"{s['mlx_cache'] / mib:,.1f}" if "mlx_cache" in s else ""

    for k in keys:
        s = snaps[k]
        lines.append(
            f"| {k} | {s['VmRSS'] / mib:,.0f} | {s['VmHWM'] / mib:,.0f} | "
            f"{s['mlx_active'] / mib:,.1f} | {cache(s)} | {s['mlx_peak'] / mib:,.1f} |"
        )
    if len(keys) >= 3:
        a, b = snaps[keys[1]], snaps[keys[-1]]
        growth = (
            f"Growth from request {keys[1]} to {keys[-1]}: RSS "
            f"{(b['VmRSS'] - a['VmRSS']) / mib:+,.1f} MiB, MLX active "
            f"{(b['mlx_active'] - a['mlx_active']) / mib:+,.2f} MiB"
        )
        if "mlx_cache" in a and "mlx_cache" in b:
            growth += f", MLX cache {(b['mlx_cache'] - a['mlx_cache']) / mib:+,.2f} MiB"
        lines += ["", growth + "."]
    return [*lines, ""]


def _cache_md(results: dict[str, Any]) -> list[str]:
    data = results.get("prompt_cache", {})
    if not data:
        return []
    lines = ["## 6. Prompt cache: TTFT of a request sharing a long prefix with the one before", ""]
    lines += [
        "`cold`: a fresh prefix (nothing cached); `warm`: the same prefix as the request "
        "before (different suffix). TTFT ms, p50 over the trials; `serial` requests carry a seed.",
        "",
        "| server | prefix words | lane | cold | warm | cold/warm | errors |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for name, p in data.items():
        for lane in ("batch", "serial"):
            c, w = p[lane]["cold_ttft_p50_s"], p[lane]["warm_ttft_p50_s"]
            errors = (p[lane].get("errors") or [""])[0].replace("|", "/")
            lines.append(
                f"| {name} | {p['prefix_words']} | {lane} | {ms(c)} | {ms(w)} | "
                f"{_ratio(c, w)} | {errors} |"
            )
    return [*lines, ""]


def _gpu_gib(row: dict[str, Any]) -> str:
    """The server process's GPU memory / the GPU's peak in use, GiB ("-" where not measured)."""
    return f"{_num(row.get('server_gpu_gib'), 1)} / {_num(row.get('gpu_memory_peak_gib'), 1)}"


def _traffic_md(results: dict[str, Any]) -> list[str]:
    data = results.get("traffic")
    if not data:
        return []
    t = data["settings"]
    lines = ["## 8. Continuous traffic: streams that come and go", ""]
    lines += [
        f"Closed loop: C streaming clients, {data['prompt_tokens']}-token chat prompts, "
        f"{t['max_tokens']} tokens each, {t['duration']:.0f} s per C (the first {t['warm']:.0f} s "
        "not timed). Bare references in the same run: a `BatchGenerator` loop of C rows inserted "
        "and finishing together (`together`), and one whose rows finish staggered and are "
        "replaced at once (`staggered`). ITL: gap between a stream's content chunks per token. "
        "GPU: `nvidia-smi` utilization, mean of 100 ms samples; GPU GiB: the memory the server "
        "process held at the end of the block / the GPU's peak in use during it (every process: "
        "the other servers stay up); worker: the MLX thread's busy fraction (trio-mlx's "
        "`/metrics`); rows/admission: rows admitted per prefill call.",
        "",
        "| C | bare together | bare staggered | server | tok/s | x together | x staggered | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | GPU busy % | GPU GiB | worker busy | rows/admission | failed | exact |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    bare = data.get("bare", {})
    for name, rows in data.get("servers", {}).items():
        for row in rows:
            b = bare.get(str(row["concurrency"]), {})
            tog, stag = b.get("together", {}), b.get("staggered", {})
            adm = row.get("admissions")
            per = (row["requests"] / adm) if adm else None
            lines.append(
                f"| {row['concurrency']} | {_num(tog.get('tok_s'))} (GPU {_num(tog.get('gpu_busy_pct'))}%) | "
                f"{_num(stag.get('tok_s'))} (GPU {_num(stag.get('gpu_busy_pct'))}%) | {name} | "
                f"{_num(row['tok_s'])} | {_ratio(row['tok_s'], tog.get('tok_s'))} | "
                f"{_ratio(row['tok_s'], stag.get('tok_s'))} | {ms(row['ttft_p50_s'])} | "
                f"{ms(row['ttft_p99_s'])} | {ms(row['itl_p50_s'])} | {ms(row['itl_p99_s'])} | "
                f"{_num(row.get('gpu_busy_pct'))} | {_gpu_gib(row)} | "
                f"{_num(row.get('worker_busy'), 2)} | {_num(per, 1)} | {row['failed']} | "
                f"{row.get('exact_tokens')} |"
            )
    if data.get("rounds", 1) > 1:
        lines += _rounds_md(data)
    servers = data.get("servers", {})
    reference = servers.get("mlx_lm.server")
    compared = [n for n in servers if n.startswith("trio-mlx")] if reference else []
    for name in compared:
        pairs = zip(servers[name], reference, strict=False)
        vs = ", ".join(f"C={a['concurrency']}: {_ratio(a['tok_s'], b['tok_s'])}" for a, b in pairs)
        lines += ["", f"{name} / mlx_lm.server tok/s: {vs}"]
    if data.get("long"):
        lines += [
            "",
            f"Long arrivals: C - 1 closed-loop streams as above while {t['long_prompts']} prompts "
            f"of {t['long_words']} words arrive one at a time; `during long`: the streams' gaps "
            "per token while a long prompt waited for its first token; the goal is its p99 <= 3x "
            "the streams' ITL p50.",
            "",
            "| server | C | tok/s | ITL p50 | ITL p99 | during long p50 | during long p99 | p99 / ITL p50 | long TTFT | GPU busy % | GPU GiB | worker busy | failed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        for name, row in data["long"].items():
            longs = ", ".join(ms(x) for x in row.get("long_ttft_s", []))
            lines.append(
                f"| {name} | {row['concurrency']} | {_num(row['tok_s'])} | {ms(row['itl_p50_s'])} | "
                f"{ms(row['itl_p99_s'])} | {ms(row['itl_during_long_p50_s'])} | "
                f"{ms(row['itl_during_long_p99_s'])} | {_num(row.get('during_p99_over_p50'), 1)} | "
                f"{longs} | {_num(row.get('gpu_busy_pct'))} | {_gpu_gib(row)} | "
                f"{_num(row.get('worker_busy'), 2)} | {row['failed']} |"
            )
        if data.get("rounds", 1) > 1:
            each = "; ".join(
                f"{name}: {', '.join(_num(x, 1) for x in row.get('rounds_ratio', []))}"
                for name, row in data["long"].items()
            )
            rates = "; ".join(
                f"{name}: {', '.join(_num(x) for x in row.get('rounds_tok_s', []))}"
                for name, row in data["long"].items()
            )
            lines += [
                "",
                f"Each round's p99 / ITL p50 (the row above is the median round, the worse of two): {each}",
                "",
                f"Each round's tok/s, in the same order: {rates}",
            ]
    if data.get("open"):
        lines += [
            "",
            f"Open loop: Poisson arrivals for {t['open_duration']:.0f} s at fractions of trio-mlx's "
            f"capacity ({_num(data.get('capacity_req_s'), 1)} req/s: a closed loop at the largest C with the same prompt mix), prompts of "
            f"{t['prompt_words_spread'][0]}-{t['prompt_words_spread'][1]} words (log-uniform) plus "
            f"{t['long_prompts']} of {t['long_words']} words; `ITL during long`: the other streams' "
            "gaps while a long prompt waited for its first token.",
            "",
            "| server | load | req/s | arrivals | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ITL during long p50 | p99 | long TTFT | GPU busy % | worker busy | failed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for name, rows in data["open"].items():
            for row in rows:
                longs = ", ".join(ms(x) for x in row.get("long_ttft_s", []))
                lines.append(
                    f"| {name} | {row['fraction']:.0%} | {row['rate']:.1f} | {row['arrivals']} | "
                    f"{_num(row['tok_s'])} | {ms(row['ttft_p50_s'])} | {ms(row['ttft_p99_s'])} | "
                    f"{ms(row['itl_p50_s'])} | {ms(row['itl_p99_s'])} | "
                    f"{ms(row['itl_during_long_p50_s'])} | {ms(row['itl_during_long_p99_s'])} | "
                    f"{longs} | {_num(row.get('gpu_busy_pct'))} | {_num(row.get('worker_busy'), 2)} | "
                    f"{row['failed']} |"
                )
    return [*lines, ""]


def _rounds_md(data: dict[str, Any]) -> list[str]:
    """Every round of the closed loops, each against its own round's bare loops."""
    lines = [
        "",
        f"{data['rounds']} rounds: every server stayed up, and each round ran the bare loops and "
        "then every server in turn (the order reversed every other round). The table above shows "
        "each server's median round (the lower of two) against the bare loops' median rounds; "
        "here is every round, each ratio against the bare loop of its own round.",
        "",
        "| C | server | tok/s, each round | x together, each round | x staggered, each round |",
        "| ---: | --- | --- | --- | --- |",
    ]
    for name, rows in data.get("servers", {}).items():
        for row in rows:
            lines.append(
                f"| {row['concurrency']} | {name} | "
                f"{', '.join(_num(x) for x in row.get('rounds_tok_s', []))} | "
                f"{', '.join(_num(x, 2) for x in row.get('rounds_x_together', []))} | "
                f"{', '.join(_num(x, 2) for x in row.get('rounds_x_staggered', []))} |"
            )
    return lines


def _structured_md(results: dict[str, Any]) -> list[str]:
    data = results.get("structured")
    if not data:
        return []
    lines = [f"## 7. Structured output on `{data['model']}`", ""]
    lines += [
        "Decode tokens/s with every row constrained to a JSON schema (one of 20, each "
        "wrapped so no row can finish within max_tokens) vs the same rows unconstrained, "
        "alternating, best of the rounds; goal: constrained/unconstrained >= 0.8.",
        "",
        "| B | unconstrained tok/s | constrained tok/s | constrained/unconstrained | rounds (free; constrained) |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for row in data["rows"]:
        free, con = row["unconstrained"], row["constrained"]
        rounds = (
            ", ".join(_num(r) for r in free["rounds"])
            + "; "
            + ", ".join(_num(r) for r in con["rounds"])
        )
        lines.append(
            f"| {row['batch']} | {_num(free['decode_tok_s'])} | {_num(con['decode_tok_s'])} | "
            f"{_ratio(con['decode_tok_s'], free['decode_tok_s'])} | {rounds} |"
        )
    compiles = data.get("compile")
    if compiles:
        times = sorted(compiles["compile_s"])
        p50 = times[len(times) // 2]
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        lines += [
            "",
            f"Schema compile (llguidance, vocab {compiles['vocab']}): p50 {p50 * 1e3:.1f} ms, "
            f"p99 {p99 * 1e3:.1f} ms over {len(times)} schemas; the tokenizer view is built "
            f"once per engine in {compiles['tokenizer_s'] * 1e3:.0f} ms.",
        ]
    return [*lines, ""]


def _yes(value: Any) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def _agent_later(result: dict[str, Any], name: str) -> Any:
    return result["servers"].get(name, {}).get("summary", {}).get("ttft_sum_later_s")


def agent_line(model: str, result: dict[str, Any]) -> str:
    """One progress line for a model's agent session: each server's TTFT over turns 2.."""
    parts = []
    for name, data in result["servers"].items():
        s = data["summary"]
        parts.append(f"{name} TTFT turns 2.. {ms(s['ttft_sum_later_s'])} ms, min cached/previous "
                     f"{_num(s['cached_of_previous_min'], 2)}")  # fmt: skip
    restart = result.get("restart") or {}
    if restart.get("cold_over_disk"):
        parts.append(f"restart cold/disk x{restart['cold_over_disk']:.1f}")
    return f"  {model}: " + "; ".join(parts)


def _agent_md(results: dict[str, Any]) -> list[str]:
    data = results.get("agent")
    if not data:
        return []
    s = data["settings"]
    lo, hi = s["tool_tokens"]
    lines = ["## 10. Agent sessions: what an agent's user waits for, turn after turn", ""]
    lines += [
        f"A coding agent's session replayed: a {s['system_tokens']:,}-token system prompt (tool "
        f"definitions), then {s['turns']} turns, each adding one tool result of {lo:,}-{hi:,} "
        "tokens; the assistant's reply goes back shortened (as a client that strips reasoning "
        "sends it), so turn n + 1 shares turn n's prompt but not its reply. One request at a "
        f"time, streamed, up to {s['max_tokens']} tokens each; tiny random models, "
        f"{data['context']:,}-token context. TTFT: request start to the first delta with "
        "output. `cached`: the server's `usage.prompt_tokens_details.cached_tokens` (else its "
        "`/metrics` prompt-cache hits; `-`: not reported); `prefilled`: prompt - cached; "
        "`/prev`: cached over the previous turn's prompt.",
        "",
    ]
    names = sorted({n for r in data["models"].values() for n in r["servers"]}, reverse=True)
    for model, result in data["models"].items():
        head = " | ".join(f"{n} TTFT ms | cached | prefilled | /prev" for n in names)
        lines += [f"`{model}`:", "", f"| turn | prompt | {head} |",
                  "| ---: | ---: |" + " ---: | ---: | ---: | ---: |" * len(names)]  # fmt: skip
        per = {n: {t["turn"]: t for t in result["servers"][n]["turns"]}
               for n in names if n in result["servers"]}  # fmt: skip
        for turn in range(1, s["turns"] + 1):
            prompt = next((p[turn]["prompt_tokens"] for p in per.values() if turn in p), None)
            cells = []
            for n in names:
                t = per.get(n, {}).get(turn, {})
                cells.append(f"{ms(t.get('ttft_s'))} | {_num(t.get('cached_tokens'))} | "
                             f"{_num(t.get('prefilled_tokens'))} | "
                             f"{_num(t.get('cached_of_previous'), 2)}")  # fmt: skip
            lines.append(f"| {turn} | {_num(prompt)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "Goals: every turn after the first finds >= 0.95 of the previous turn's prompt cached, "
        "on every model; trio-mlx's TTFT summed over turns 2.. no worse than `mlx_lm.server`'s; "
        "after a restart on the same `--prompt-cache-dir`, the last turn's first token >= 5x "
        "sooner than a cold prefill's (a server with no cache dir; the goal is set at 24k "
        "tokens on the H200).",
        "",
        "| model | server | TTFT turn 1 | TTFT sum turns 2.. | x mlx_lm.server | min /prev "
        "| cached >= 0.95 | TTFT <= mlx_lm.server | restart: disk TTFT | cold TTFT | cold/disk "
        "| >= 5x |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for model, result in data["models"].items():
        ref = _agent_later(result, "mlx_lm.server")
        for name, server in result["servers"].items():
            sm = server["summary"]
            later = sm["ttft_sum_later_s"]
            restart = (result.get("restart") or {}) if name == "trio-mlx" else {}
            disk, cold = restart.get("disk") or {}, restart.get("cold") or {}
            no_worse = (
                (later <= ref if later and ref else None) if name != "mlx_lm.server" else None
            )
            lines.append(
                f"| {model} | {name} | {ms(sm['first_ttft_s'])} | {ms(later)} | "
                f"{_ratio(later, ref)} | {_num(sm['cached_of_previous_min'], 2)} | "
                f"{_yes(sm['cached_goal_met'])} | {_yes(no_worse)} | {ms(disk.get('ttft_s'))} | "
                f"{ms(cold.get('ttft_s'))} | {_num(restart.get('cold_over_disk'), 1)} | "
                f"{_yes(restart.get('goal_met'))} |"
            )
    if not data.get("disk_tier"):
        lines += ["", "No restart: `trio-mlx serve` has no `--prompt-cache-dir` flag in this run."]
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown tables, one section per benchmark."""
    env = results["env"]
    models = ", ".join(
        f"`{n}` ({m['parameters'] / 1e6:,.1f}M params, {m['weight_bytes'] / 1e6:,.0f} MB)"
        for n, m in results["models"].items()
    )
    lines = [
        f"# trio-mlx benchmarks: {results['machine']} ({results['profile']})",
        "",
        f"{results['started']}; {env.get('device')}; mlx {env.get('mlx')}, mlx-lm "
        f"{env.get('mlx_lm')}, {env.get('cpus')} CPUs; {env.get('blas', '')}. Models: {models}. "
        f"Run took {results.get('duration_s', 0):,.0f} s."
        + "".join(
            f" Every MLX process ran with {name}={value}."
            for name, value in env.get("mlx_settings", {}).items()
        ),
        "",
    ]
    if results.get("bound"):
        b = results["bound"]
        lines += [
            f"B=1 physical bound: {b['weight_bytes'] / 1e9:.2f} GB of weights per token at "
            f"{b['bandwidth_tb_s']} TB/s = {b['bound_tok_s']:,.0f} tok/s; bare reaches "
            f"{_num(b.get('bare_tok_s'))} ({b.get('bare_fraction', 0):.0%}), the engine "
            f"{_num(b.get('engine_tok_s'))} ({(b.get('engine_fraction') or 0):.0%}).",
            "",
        ]
    for section in (
        _overhead_md,
        _server_md,
        _fairness_md,
        _responsiveness_md,
        _memory_md,
        _cache_md,
        _structured_md,
        multilora.markdown,
        embed.markdown,
        speculative.markdown,
        _traffic_md,
        _agent_md,
    ):
        lines += section(results)
    if results.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in results["notes"]] + [""]
    if results.get("not_run"):
        lines += ["## Not run", ""] + [f"- not run: {reason}" for reason in results["not_run"]]
        lines.append("")
    for plot in results.get("plots", []):
        lines += [f"![{plot}]({plot})", ""]
    return "\n".join(lines)


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """Draw the overhead and server plots into ``out``; return their file names."""
    if not results.get("overhead") and not results.get("server"):
        return []  # nothing to draw: a run without them needs no matplotlib
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    overhead = results.get("overhead", {})
    if overhead:
        fig, axes = plt.subplots(1, len(overhead), figsize=(5 * len(overhead), 4), squeeze=False)
        for ax, (model, rows) in zip(axes[0], overhead.items(), strict=True):
            bs = [r["batch"] for r in rows]
            ax.plot(
                bs, [r["bare"]["decode_tok_s"] for r in rows], "o-", label="bare BatchGenerator"
            )
            if all(r["engine"] for r in rows):
                ax.plot(
                    bs, [r["engine"]["decode_tok_s"] for r in rows], "s-", label="engine.generate"
                )
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="B (concurrent rows)",
                ylabel="decode tok/s",
                title=model,
            )
            ax.set_xticks(bs, [str(b) for b in bs])
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"Engine overhead ({results['machine']})")
        fig.tight_layout()
        fig.savefig(out / "overhead.png", dpi=100)
        plt.close(fig)
        names.append("overhead.png")
    server = results.get("server", {})
    if server:
        fig, axes = plt.subplots(2, len(server), figsize=(5.5 * len(server), 8), squeeze=False)
        for col, (model, data) in enumerate(server.items()):
            top, bottom = axes[0][col], axes[1][col]
            bare = data.get("bare", {})
            if bare:
                cs = sorted(int(c) for c in bare)
                top.plot(
                    cs, [bare[str(c)]["e2e_tok_s"] for c in cs], "k--o", label="bare BatchGenerator"
                )
            for name, rows in data.get("servers", {}).items():
                cs = [r["concurrency"] for r in rows]
                top.plot(cs, [r["tok_s"] for r in rows], "o-", label=name)
                bottom.plot(cs, [(r["ttft_p99_s"] or 0) * 1000 for r in rows], "o-", label=name)
            top.set(xscale="log", yscale="log", ylabel="output tok/s", title=model)
            bottom.set(xscale="log", xlabel="concurrent streams", ylabel="TTFT p99 (ms)")
            ticks = sorted(
                {r["concurrency"] for rows in data.get("servers", {}).values() for r in rows}
            )
            for ax in (top, bottom):
                if ticks:
                    ax.set_xticks(ticks, [str(t) for t in ticks])
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=8)
        fig.suptitle(f"Servers vs bare ({results['machine']})")
        fig.tight_layout()
        fig.savefig(out / "server.png", dpi=100)
        plt.close(fig)
        names.append("server.png")
    return names


def write(results: dict[str, Any], out: Path) -> None:
    """Write JSON, plots and Markdown into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=False))
    if results.get("agent"):  # the agent part on its own too, for tools that read only it
        (out / "agent.json").write_text(json.dumps(results["agent"], indent=1))
    (out / "results.md").write_text(markdown(results))
