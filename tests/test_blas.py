"""The optimized BLAS on Linux: it is found, preloaded, active, and never changes a result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_mlx import backend_info
from trio_mlx._start.blas import classify_blas, find_fast_blas, preload_env
from trio_mlx_http._fast_blas import GUARD_VAR, HINT, maybe_reexec_with_fast_blas, plan_reexec

ROOT = Path(__file__).parent.parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
REFERENCE = "/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _mlx_on_gpu() -> bool:
    """Whether this MLX build runs on a GPU by default (its CUDA build here)."""
    import mlx.core as mx

    return bool(mx.default_device() == mx.gpu)


def _env(**changes: str | None) -> dict[str, str]:
    """os.environ without any BLAS preload or re-exec state, then ``changes``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", GUARD_VAR, "TRIO_MLX_FAST_BLAS", "TRIO_MLX_BLAS")
    }
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _reference_env() -> dict[str, str]:
    return _env(TRIO_MLX_FAST_BLAS="0")


def _fast_env() -> dict[str, str]:
    """The environment of a process on the optimized BLAS (``TRIO_MLX_BLAS`` chooses one)."""
    env = _env(TRIO_MLX_BLAS=os.environ.get("TRIO_MLX_BLAS"))
    if find_fast_blas(env) is None:
        pytest.skip("no optimized BLAS on this machine (apt-get install libopenblas0-pthread)")
    return preload_env(env)


# --- which library: pure functions ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        (OPENBLAS, "openblas"),
        ("/usr/lib64/libopenblasp.so.0", "openblas"),
        ("/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so.2", "mkl"),
        (REFERENCE, "reference"),
        ("/System/Library/Frameworks/Accelerate.framework/Accelerate", "accelerate"),
        ("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", "unknown"),
        (None, "unknown"),
    ],
)
def test_classify_blas_by_library_name(path: str | None, kind: str) -> None:
    assert classify_blas(path) == kind


def test_find_fast_blas_honours_an_existing_override(tmp_path: Path) -> None:
    lib = tmp_path / "libcustomblas.so"
    lib.write_bytes(b"")
    assert find_fast_blas({"TRIO_MLX_BLAS": str(lib)}) == str(lib)


def test_find_fast_blas_ignores_a_missing_override_instead_of_guessing(tmp_path: Path) -> None:
    assert find_fast_blas({"TRIO_MLX_BLAS": str(tmp_path / "absent.so")}) is None


def test_find_fast_blas_finds_nothing_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert find_fast_blas({"TRIO_MLX_BLAS": sys.executable}) is None


@linux_only
def test_find_fast_blas_finds_debian_openblas_when_installed() -> None:
    if not os.path.exists(OPENBLAS):
        pytest.skip(f"{OPENBLAS} not installed")
    assert find_fast_blas({}) == OPENBLAS


@pytest.fixture
def fake_openblas(tmp_path: Path) -> str:
    lib = tmp_path / "openblas-pthread" / "libblas.so.3"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    return str(lib)


@linux_only
def test_preload_env_puts_the_fast_blas_first_and_sets_threads(fake_openblas: str) -> None:
    env = preload_env({"TRIO_MLX_BLAS": fake_openblas, "LD_PRELOAD": "/lib/libjemalloc.so.2"})
    assert env["LD_PRELOAD"] == f"{fake_openblas}:/lib/libjemalloc.so.2"
    assert env["OPENBLAS_NUM_THREADS"] == str(os.cpu_count())


@linux_only
def test_preload_env_is_idempotent_and_keeps_explicit_threads(fake_openblas: str) -> None:
    once = preload_env({"TRIO_MLX_BLAS": fake_openblas, "OPENBLAS_NUM_THREADS": "3"})
    twice = preload_env(dict(once))
    assert twice == once
    assert once["LD_PRELOAD"] == fake_openblas
    assert once["OPENBLAS_NUM_THREADS"] == "3"


@linux_only
def test_preload_env_keeps_a_users_own_optimized_blas(fake_openblas: str) -> None:
    mine = "/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so.2"
    env = {"TRIO_MLX_BLAS": fake_openblas, "LD_PRELOAD": mine}
    assert preload_env(dict(env)) == env


@linux_only
def test_preload_env_selects_mkls_lp64_interface(tmp_path: Path) -> None:
    mkl = tmp_path / "libmkl_rt.so.2"
    mkl.write_bytes(b"")
    env = preload_env({"TRIO_MLX_BLAS": str(mkl)})
    assert env["LD_PRELOAD"] == str(mkl)
    assert env["MKL_INTERFACE_LAYER"] == "LP64"


def test_preload_env_does_nothing_when_turned_off(fake_openblas: str) -> None:
    env = {"TRIO_MLX_BLAS": fake_openblas, "TRIO_MLX_FAST_BLAS": "0"}
    assert preload_env(dict(env)) == env


# --- whether to re-execute: a pure decision on the environment ------------------------------


def _plan(environ: dict[str, str], **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "fast_blas": OPENBLAS,
        "bundled_reference": REFERENCE,
        "platform": "linux",
    }
    options.update(kwargs)
    return plan_reexec(environ, **options)


def test_plan_reexec_preloads_the_fast_blas_with_a_guard() -> None:
    environ = {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/libjemalloc.so.2"}
    plan = _plan(environ, fast_blas=sys.executable)
    assert plan.action == "exec"
    assert plan.env["LD_PRELOAD"] == f"{sys.executable}:/lib/libjemalloc.so.2"
    assert plan.env[GUARD_VAR] == "1"
    assert plan.env["PATH"] == "/usr/bin"
    assert environ == {"PATH": "/usr/bin", "LD_PRELOAD": "/lib/libjemalloc.so.2"}


@pytest.mark.parametrize(
    ("environ", "kwargs", "reason"),
    [
        ({}, {"platform": "darwin"}, "not Linux"),
        ({"TRIO_MLX_FAST_BLAS": "0"}, {}, "turned off"),
        ({}, {"opt_out": True}, "turned off"),
        ({GUARD_VAR: "1"}, {}, "already re-executed"),
        ({"LD_PRELOAD": OPENBLAS}, {}, "preloaded already"),
        ({"LD_PRELOAD": "/x/libmkl_rt.so.2"}, {}, "preloaded already"),
        ({}, {"fast_blas": None, "bundled_reference": None}, "no optimized BLAS found"),
    ],
)
def test_plan_reexec_skips(environ: dict[str, str], kwargs: dict[str, Any], reason: str) -> None:
    plan = _plan(environ, **kwargs)
    assert (plan.action, plan.env) == ("skip", None)
    assert reason in plan.reason


def test_plan_reexec_hints_on_a_reference_blas_machine_without_a_fast_one() -> None:
    assert _plan({}, fast_blas=None).action == "hint"
    assert _plan({GUARD_VAR: "1"}, fast_blas=None).action == "skip"


@linux_only
def test_maybe_reexec_runs_the_same_interpreter_arguments(
    monkeypatch: pytest.MonkeyPatch, fake_openblas: str
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda exe, args, env: calls.append((exe, args, env)))
    for key in ("LD_PRELOAD", GUARD_VAR, "TRIO_MLX_FAST_BLAS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRIO_MLX_BLAS", fake_openblas)
    maybe_reexec_with_fast_blas()
    maybe_reexec_with_fast_blas(["-m", "trio_mlx_http", "--version"])
    maybe_reexec_with_fast_blas(["-m", "trio_mlx_http"], opt_out=True)
    assert [args for _, args, _ in calls] == [
        [sys.executable, *sys.orig_argv[1:]],
        [sys.executable, "-m", "trio_mlx_http", "--version"],
    ]
    exe, _, env = calls[0]
    assert exe == sys.executable
    assert env["LD_PRELOAD"] == fake_openblas
    assert env[GUARD_VAR] == "1"


@linux_only
def test_maybe_reexec_prints_one_hint_line_when_no_fast_blas(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    for key in ("LD_PRELOAD", GUARD_VAR, "TRIO_MLX_FAST_BLAS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRIO_MLX_BLAS", str(tmp_path / "absent.so"))
    monkeypatch.setattr("trio_mlx_http._fast_blas.bundled_reference_blas", lambda: REFERENCE)
    maybe_reexec_with_fast_blas()
    out, err = capsys.readouterr()
    assert (out, err) == ("", HINT + "\n")
    assert "apt-get install libopenblas0-pthread" in err


# --- the optimized BLAS is active, and agrees with float64 numpy ----------------------------


@linux_only
def test_optimized_blas_is_active_when_installed() -> None:
    """Under ``nox -s tests`` (which preloads it) MLX runs on OpenBLAS when it exists."""
    if not os.path.exists(OPENBLAS):
        pytest.skip(f"{OPENBLAS} not installed")
    if os.environ.get("TRIO_MLX_FAST_BLAS") == "0":
        pytest.skip("TRIO_MLX_FAST_BLAS=0")
    info = backend_info()
    assert (info.blas, info.preloaded) == ("openblas", True), (
        f"{info.describe()}: run the tests with `nox -s tests`, or "
        f"LD_PRELOAD={OPENBLAS} pytest (TRIO_MLX_FAST_BLAS=0 to test the reference BLAS)"
    )
    assert info.threads is not None
    assert info.threads >= 1


def _mlx_matmul(a: np.ndarray, b: np.ndarray, how: str) -> np.ndarray:
    """``a @ b`` (``0.5 a @ b + 2`` for addmm) computed by MLX, as float64."""
    import mlx.core as mx

    x, y = mx.array(a), mx.array(b)
    if how == "transposed":  # (b^T a^T)^T: BLAS gets transposed views of both operands
        out = mx.swapaxes(mx.swapaxes(y, -1, -2) @ mx.swapaxes(x, -1, -2), -1, -2)
    elif how == "addmm":  # exercises BLAS's alpha and beta
        out = mx.addmm(mx.full((a.shape[-2], b.shape[-1]), 2.0), x, y, alpha=0.5, beta=1.0)
    else:
        out = x @ y
    return np.array(out, dtype=np.float64)


def _error_vs_bound(got: np.ndarray, a: np.ndarray, b: np.ndarray, how: str) -> float:
    """The worst error of ``got`` against float64, in units of the float32 error bound.

    Rounding errors of a k-term float32 dot product grow like sqrt(k) * eps,
    relative to the sum of the absolute terms (k * eps at worst). OpenBLAS and
    the reference BLAS stay below 3% of 16 sqrt(k + 2) eps on every shape here;
    a product that misses or misplaces a term is far outside.
    """
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want, scale = a64 @ b64, np.abs(a64) @ np.abs(b64)
    if how == "addmm":
        want, scale = 0.5 * want + 2.0, 0.5 * scale + 2.0
    assert got.shape == want.shape
    bound = 16 * np.sqrt(a.shape[-1] + 2) * np.finfo(np.float32).eps * scale + 1e-30
    return float(np.max(np.abs(got - want) / bound))


def _check_matmul(shape_a: tuple[int, ...], shape_b: tuple[int, ...], how: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape_a).astype(np.float32)
    b = rng.standard_normal(shape_b).astype(np.float32)
    worst = _error_vs_bound(_mlx_matmul(a, b, how), a, b, how)
    assert worst <= 1.0, f"{shape_a} @ {shape_b} ({how}): error {worst:.3g}x the float32 bound"


MATMUL_SHAPES = [
    pytest.param((1, 1), (1, 1), id="1x1x1"),
    pytest.param((1, 256), (256, 2048), id="1-row (decode)"),
    pytest.param((2048, 256), (256, 1), id="1-col"),
    pytest.param((4096, 64), (64, 16), id="tall"),
    pytest.param((16, 64), (64, 4096), id="wide"),
    pytest.param((8, 4096), (4096, 8), id="skinny long k"),
    pytest.param((127, 251), (251, 383), id="odd"),
    pytest.param((1024, 1024), (1024, 1024), id="1024 cube"),
    pytest.param((3, 65, 33), (3, 33, 17), id="batched"),
    pytest.param((2, 3, 7, 5), (5, 9), id="broadcast"),
]


@pytest.mark.parametrize("how", ["plain", "transposed", "addmm"])
@pytest.mark.parametrize(("shape_a", "shape_b"), MATMUL_SHAPES)
def test_mlx_matmul_agrees_with_float64_numpy(
    shape_a: tuple[int, ...], shape_b: tuple[int, ...], how: str
) -> None:
    if how == "addmm" and len(shape_a) > 2:
        pytest.skip("addmm takes matrices")
    _check_matmul(shape_a, shape_b, how, seed=len(shape_a) * 1000 + shape_a[-1])


@given(
    m=st.integers(1, 70),
    k=st.integers(1, 70),
    n=st.integers(1, 70),
    batch=st.sampled_from([(), (1,), (3,)]),
    how=st.sampled_from(["plain", "transposed"]),
    seed=st.integers(0, 2**16),
)
def test_mlx_matmul_of_any_small_shape_agrees_with_float64_numpy(
    m: int, k: int, n: int, batch: tuple[int, ...], how: str, seed: int
) -> None:
    _check_matmul((*batch, m, k), (*batch, k, n), how, seed)


@pytest.mark.parametrize("how", ["plain", "addmm"])
def test_float32_bound_catches_a_wrong_product(how: str) -> None:
    """The tolerance above passes numpy's float32 product and fails one missing a term."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 4096)).astype(np.float32)
    b = rng.standard_normal((4096, 32)).astype(np.float32)
    alpha, beta = (0.5, np.float32(2.0)) if how == "addmm" else (1.0, np.float32(0.0))
    right = (np.float32(alpha) * (a @ b) + beta).astype(np.float64)
    wrong = right - alpha * np.outer(a[:, 7], b[7])
    assert _error_vs_bound(right, a, b, how) <= 1.0
    assert _error_vs_bound(wrong, a, b, how) > 1.0


# --- a greedy generation is the same on either BLAS -----------------------------------------

_GENERATE = """
import json, sys
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, generate_step
from trio_mlx import backend_info

model, tokenizer = mlx_lm.load(sys.argv[1])
prompt = tokenizer.encode("The for statement in Python")
single = []
for (token, logprobs), _ in zip(generate_step(mx.array(prompt), model, max_tokens=48), range(48)):
    single.append(int(token))
prompts = [tokenizer.encode(t) for t in ("def f(x):", "Exceptions", "class A", "import os")]
gen = BatchGenerator(model, max_tokens=24)
uids = gen.insert(prompts)
batched = {uid: [] for uid in uids}
while any(len(v) < 24 for v in batched.values()):
    for r in gen.next_generated():
        batched[r.uid].append(int(r.token))
gen.close()
logits = model(mx.array(prompt)[None])[0, -1]
print(json.dumps({
    "blas": backend_info().blas,
    "single": single,
    "batched": [batched[u] for u in uids],
    "logits": logits.tolist(),
}))
"""


def _generate(model_path: Path, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _GENERATE, str(model_path)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@linux_only
@pytest.mark.model
def test_greedy_generation_is_identical_with_and_without_the_fast_blas(
    tiny_model_path: Path,
) -> None:
    fast = _generate(tiny_model_path, _fast_env())
    reference = _generate(tiny_model_path, _reference_env())
    assert (fast["blas"], reference["blas"]) == ("openblas", "reference")
    assert len(set(fast["single"])) > 3, "the fixture model should produce varied tokens"
    assert fast["single"] == reference["single"]
    assert fast["batched"] == reference["batched"]
    np.testing.assert_allclose(fast["logits"], reference["logits"], rtol=1e-4, atol=1e-4)


# --- the command line re-executes itself once ------------------------------------------------

_PROBE = """
import os, sys
print("guard", os.environ.get("TRIO_MLX_BLAS_REEXEC"), sys.flags.utf8_mode, flush=True)
from trio_mlx_http._cli import _fast_blas
_fast_blas(None)
from trio_mlx import backend_info
print("blas", backend_info().blas)
"""


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("args", "env"),
    [
        pytest.param([], {}, id="re-exec path"),
        pytest.param(["--no-fast-blas"], {}, id="--no-fast-blas"),
        pytest.param([], {"TRIO_MLX_FAST_BLAS": "0"}, id="TRIO_MLX_FAST_BLAS=0"),
        pytest.param([], {"LD_PRELOAD": OPENBLAS}, id="preloaded already"),
    ],
)
def test_cli_version_works_with_and_without_the_reexec(
    args: list[str], env: dict[str, str]
) -> None:
    from trio_mlx import __version__

    if env.get("LD_PRELOAD") and not os.path.exists(OPENBLAS):
        pytest.skip(f"{OPENBLAS} not installed")
    if not args and not env:
        _fast_env()  # skips where there is no optimized BLAS (the CLI would print a hint)
    result = _run(["-m", "trio_mlx_http", *args, "--version"], _env(**env))
    assert (result.returncode, result.stdout, result.stderr) == (0, f"trio-mlx {__version__}\n", "")


@linux_only
def test_cli_reexecutes_once_with_the_same_interpreter_options() -> None:
    _fast_env()
    result = _run(["-X", "utf8", "-c", _PROBE], _env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["guard None 1", "guard 1 1", "blas openblas"]


@linux_only
def test_cli_opt_out_runs_once_on_the_reference_blas() -> None:
    result = _run(["-X", "utf8", "-c", _PROBE, "--no-fast-blas"], _env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["guard None 1", "blas reference"]


@linux_only
def test_cli_without_a_fast_blas_prints_one_hint_line_once_loaded_and_carries_on(
    tmp_path: Path,
) -> None:
    env = _env(TRIO_MLX_BLAS=str(tmp_path / "absent.so"))
    # A command that runs (--help and --version end before the BLAS is looked at).
    result = _run(["-m", "trio_mlx_http", "generate", "--max-tokens", "2", "--raw", "Hi"], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hi") or result.stdout.strip(), result.stdout
    lines = result.stderr.splitlines()
    # On a GPU build the model does not run on the CPU's BLAS: no hint is due.
    assert lines.count(HINT) == (0 if _mlx_on_gpu() else 1), result.stderr
    # The summary line; on CUDA the traced step's INFO line may follow it.
    assert any(re.match(r"\[\d+ prompt tokens, 2 generated", line) for line in lines[-2:]), (
        result.stderr
    )


@linux_only
@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"TRIO_MLX_BLAS": "/absent/libblas.so"}, id="no fast BLAS: hint due"),
        pytest.param({}, id="re-exec path"),
    ],
)
def test_cli_start_up_error_is_told_without_blas_lines(env: dict[str, str]) -> None:
    result = _run(
        ["-m", "trio_mlx_http", "serve", "--port", "0", "--model", "/absent/m"], _env(**env)
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0] == "trio-mlx: error: model '/absent/m' not found: no such folder"
    assert lines[1].startswith("trio-mlx: --model takes a local folder"), result.stderr


@linux_only
def test_maybe_reexec_without_hint_returns_that_one_is_due_and_prints_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    for key in ("LD_PRELOAD", GUARD_VAR, "TRIO_MLX_FAST_BLAS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TRIO_MLX_BLAS", str(tmp_path / "absent.so"))
    monkeypatch.setattr("trio_mlx_http._fast_blas.bundled_reference_blas", lambda: REFERENCE)
    assert maybe_reexec_with_fast_blas(hint=False) is True
    assert maybe_reexec_with_fast_blas(hint=False, opt_out=True) is False
    assert capsys.readouterr() == ("", "")


def test_cli_main_called_in_process_never_reexecutes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trio_mlx_http._cli import main

    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("trio-mlx ")


def test_embedding_programs_reach_the_reexec_through_the_http_package_without_mlx() -> None:
    code = (
        "import sys, trio_mlx, trio_mlx_http\n"
        "f = trio_mlx_http.maybe_reexec_with_fast_blas\n"
        "assert f.__module__ == 'trio_mlx_http._fast_blas', f.__module__\n"
        "assert 'maybe_reexec_with_fast_blas' not in trio_mlx.__all__\n"
        "assert 'mlx.core' not in sys.modules and 'quart' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
