"""Running streams' inter-token latency while long prompts arrive, per prefill budget.

``python bench/experiments/prefill_budget.py [MODEL] [C] [BUDGET ...]`` starts
``trio-mlx serve --prefill-budget B`` for each budget and runs the bench
suite's long-arrival measure (C - 1 closed-loop streams while three long
prompts arrive one at a time; the GPU profile's settings) twice, printing the
second: the streams' ITL median, their ITL p99 while a long prompt waited for
its first token and the ratio of the two (the issue's goal: at most 3), the
long prompts' TTFT and the throughput. It chose ``GPU_PREFILL_BUDGET``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.suite import models, report, servers, traffic
from bench.suite.__main__ import PROFILES, client_processes, model_env, traffic_profile


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    c = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    budgets = [int(b) for b in sys.argv[3:]] or [512, 1024, 1536]
    model = models.prepare(name)
    p = traffic_profile({**PROFILES["gpu"], "client_processes": client_processes()}, model)
    t = p["traffic"]
    warm = {**p, "traffic": {**t, "duration": 5.0, "warm": 1.0, "long_prompts": 1}}
    for budget in budgets:
        extra = ["--prefill-budget", str(budget)]
        with servers.trio_mlx_server(
            model.path, max_batch=c, env=model_env(), log_dir=Path(tempfile.mkdtemp()), extra=extra
        ) as server:
            traffic.long_arrival(server, warm, c)
            row = traffic.long_arrival(server, p, c)
        ttft = ", ".join(report.ms(x) for x in row["long_ttft_s"])
        print(
            f"budget {budget:>5}: ITL p50 {report.ms(row['itl_p50_s'])} ms, during long p99 "
            f"{report.ms(row['itl_during_long_p99_s'])} ms "
            f"(x{report._num(row['during_p99_over_p50'], 1)}), long TTFT {ttft} ms, "
            f"{report._num(row.get('tok_s'))} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
