"""Re-execute the command line once with an optimized BLAS preloaded (Linux).

``LD_PRELOAD`` is read by the dynamic loader only when a process starts, so the
``trio-mlx`` command, before it imports MLX, re-runs itself with the BLAS that
``trio_mlx._start.blas`` finds preloaded (``design/blas.md``). That is start-up policy
for a program, not engine: it lives here, beside the CLI. A Trio program that
embeds the engine calls :func:`maybe_reexec_with_fast_blas` (public as
``trio_mlx_http.maybe_reexec_with_fast_blas``) first thing, or sets
``LD_PRELOAD`` itself.

:func:`plan_reexec` decides from the environment alone (pure, tested
per case); :func:`maybe_reexec_with_fast_blas` carries the plan out.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Literal

import attrs

from trio_mlx._start.blas import (
    OPT_OUT_VAR,
    add_preload,
    bundled_reference_blas,
    find_fast_blas,
    preloads_fast_blas,
)

__all__ = ["GUARD_VAR", "HINT", "ReexecPlan", "maybe_reexec_with_fast_blas", "plan_reexec"]

#: Set in the environment of the re-executed process, so it never re-executes again.
GUARD_VAR = "TRIO_MLX_BLAS_REEXEC"

HINT = (
    "trio-mlx: MLX is using its bundled reference BLAS (slow on CPU); "
    "`apt-get install libopenblas0-pthread` makes it 4-5x faster "
    "(TRIO_MLX_FAST_BLAS=0 silences this)"
)


@attrs.frozen
class ReexecPlan:
    """What :func:`maybe_reexec_with_fast_blas` does: ``exec`` with ``env``, print a ``hint``, or ``skip``."""

    action: Literal["exec", "hint", "skip"]
    reason: str
    env: Mapping[str, str] | None = None


def plan_reexec(
    environ: Mapping[str, str],
    *,
    fast_blas: str | None,
    bundled_reference: str | None,
    platform: str = sys.platform,
    opt_out: bool = False,
) -> ReexecPlan:
    """Decide, from the environment alone, whether to re-execute with ``fast_blas`` preloaded."""
    if not platform.startswith("linux"):
        return ReexecPlan("skip", "not Linux: MLX uses the platform's BLAS")
    if opt_out or environ.get(OPT_OUT_VAR, "1") == "0":
        return ReexecPlan("skip", "turned off (--no-fast-blas or TRIO_MLX_FAST_BLAS=0)")
    if environ.get(GUARD_VAR):
        return ReexecPlan("skip", "already re-executed once")
    if preloads_fast_blas(environ):
        return ReexecPlan("skip", "an optimized BLAS is preloaded already")
    if fast_blas is None:
        if bundled_reference is None:
            return ReexecPlan("skip", "no optimized BLAS found, and MLX bundles no reference one")
        return ReexecPlan("hint", "no optimized BLAS found; MLX runs on its reference BLAS")
    env = add_preload(dict(environ), fast_blas)
    env[GUARD_VAR] = "1"
    return ReexecPlan("exec", f"preloading {fast_blas}", env)


def maybe_reexec_with_fast_blas(
    argv: Sequence[str] | None = None, *, opt_out: bool = False, hint: bool = True
) -> bool:
    """Re-execute this process once with an optimized BLAS preloaded, when that helps.

    ``argv`` is the interpreter's arguments (default ``sys.orig_argv[1:]``), so
    ``trio-mlx ...`` and ``python -m trio_mlx_http ...`` re-run exactly as typed.
    Returns only when there is nothing to do, and then whether MLX will run on
    its reference BLAS with no optimized one found: the one-line install
    :data:`HINT` is then printed, unless ``hint`` is false (the CLI prints it
    once the model has loaded, so that a start-up error is told alone). Call it
    before anything imports MLX: a BLAS loaded after MLX serves nothing.
    """
    plan = plan_reexec(
        os.environ,
        fast_blas=find_fast_blas(),
        bundled_reference=bundled_reference_blas(),
        opt_out=opt_out,
    )
    if plan.action == "hint" and hint:
        print(HINT, file=sys.stderr)
    if plan.action == "exec" and plan.env is not None and sys.executable:
        args = list(sys.orig_argv[1:] if argv is None else argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *args], dict(plan.env))
    return plan.action == "hint"
