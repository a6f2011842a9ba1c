"""Distributed mode: 2 ranks on 127.0.0.1 (ring backend) against one process, token for token."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "distributed" / "check.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TIMEOUT = 60.0

pytestmark = pytest.mark.skipif(
    not (LAUNCH.exists() or shutil.which("mlx.launch")), reason="mlx.launch is missing"
)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; on timeout, kill the session (every rank)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_RANK", "MLX_HOSTFILE"))}
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    """``mlx.launch -n 2 --backend ring`` on 127.0.0.1 (its own status is 0 even when a rank fails)."""
    launch = str(LAUNCH) if LAUNCH.exists() else "mlx.launch"
    port = random.randrange(20000, 60000, 8)
    command = [launch, "-n", "2", "--backend", "ring", "--starting-port", str(port)]
    command += ["--python", sys.executable, *args]
    return _run(command, TIMEOUT)


def test_two_ranks_match_one_process(tiny_model_path: Path, tmp_path: Path) -> None:
    single, double = tmp_path / "single.json", tmp_path / "double.json"
    one = _run([sys.executable, str(SCRIPT), str(tiny_model_path), str(single)], TIMEOUT)
    assert one.returncode == 0, one.stdout[-4000:]
    two = _launch(str(SCRIPT), str(tiny_model_path), str(double))
    assert two.returncode == 0, two.stdout[-4000:]
    assert "exited with code" not in two.stdout, two.stdout[-4000:]
    expected = json.loads(single.read_text())
    got = json.loads(double.read_text())
    # Greedy, batched, with a cancellation in the middle: the same tokens.
    assert got["batched"] == expected["batched"]
    assert got["after_cancel"] == expected["after_cancel"]
    assert all(len(tokens) > 0 for tokens in got["batched"])
    # What cannot be mirrored is refused with a clear error; one process serves it.
    assert expected["refused"] == []
    assert len(got["refused"]) == 1
    assert "distributed mode" in got["refused"][0]


def test_follower_loss_closes_rank_0(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "lost.json"
    run = _launch(
        "--env",
        "TRIO_MLX_DISTRIBUTED_TIMEOUT=3",
        str(SCRIPT),
        str(tiny_model_path),
        str(out),
        "--follower-leaves-after",
        "8",
    )
    assert out.exists(), run.stdout[-4000:]
    got = json.loads(out.read_text())
    # Every request ended with an error, the engine closed, within the watchdog's bound...
    assert len(got["errors"]) == 6
    assert set(got["errors"]) <= {"EngineClosed", "GenerationFailed"}, got
    assert got["state"] == "CLOSED"
    assert got["seconds"] < 30
    # ... and rank 0 exited non-zero.
    assert "rank 0 exited with code 1" in run.stdout, run.stdout[-4000:]
