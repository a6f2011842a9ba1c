"""Experiment hook: GIL switch interval and GC settings from the environment, GC time logged."""

import gc
import os
import sys
import time

if os.environ.get("PROBE_SWITCH"):
    sys.setswitchinterval(float(os.environ["PROBE_SWITCH"]))
if os.environ.get("PROBE_GC_THRESHOLD"):
    gc.set_threshold(*[int(x) for x in os.environ["PROBE_GC_THRESHOLD"].split(",")])
_out = os.environ.get("PROBE_GC_LOG")
if _out and "serve" in sys.argv:
    _t = [0.0]
    _acc = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}

    def _cb(phase, info):
        if phase == "start":
            _t[0] = time.perf_counter()
            return
        a = _acc[info["generation"]]
        took = time.perf_counter() - _t[0]
        if info["generation"] == 2 and took > 0.005:
            with open(_out + ".gen2", "a") as f:
                f.write(f"{time.time():.3f} {took * 1e3:.1f}ms collected={info['collected']}\n")
        a[0] += 1
        a[1] += took
        if info["generation"] == 2 or a[0] % 50 == 0:
            with open(_out, "w") as f:
                f.write(
                    " ".join(f"gen{g}: n={n} {t * 1e3:.0f}ms" for g, (n, t) in _acc.items()) + "\n"
                )

    gc.callbacks.append(_cb)
