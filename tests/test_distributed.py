"""Distributed mode: 2 ranks on 127.0.0.1 (ring backend) against one process, token for token."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "distributed" / "check.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TIMEOUT = 60.0

#: ``nox -s tests`` sets TRIO_MLX_REQUIRE_LAUNCH=1: there a missing mlx.launch fails the tests.
pytestmark = pytest.mark.skipif(
    not (LAUNCH.exists() or shutil.which("mlx.launch"))
    and os.environ.get("TRIO_MLX_REQUIRE_LAUNCH") != "1",
    reason="mlx.launch is missing",
)


def _popen(command: list[str]) -> subprocess.Popen[str]:
    """Start ``command`` in its own session (to kill every rank at once), output in a pipe.

    mlx.launch gets :func:`_filled_stdin`.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_RANK", "MLX_HOSTFILE"))}
    stdin = _filled_stdin() if Path(command[0]).name == "mlx.launch" else None
    try:
        proc = subprocess.Popen(
            command,
            stdin=None if stdin is None else stdin[0],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
    except BaseException:
        if stdin is not None:
            os.close(stdin[1])
        raise
    finally:
        if stdin is not None:
            os.close(stdin[0])
    if stdin is not None:
        weakref.finalize(proc, os.close, stdin[1])  # open, and so never at its end, till then
    return proc


#: What mlx.launch reads on its stdin and copies to each rank's: more than a rank's stdin
#: pipe holds (64 KiB on Linux), less than ours holds (:func:`_filled_stdin`).
STDIN_FILL = 192 * 1024


def _filled_stdin() -> tuple[int, int] | None:
    """A pipe (read end, write end) holding :data:`STDIN_FILL` bytes, for mlx.launch's stdin.

    mlx.launch polls each rank's stdin pipe for room to write without pause, spinning a
    core beside the ranks for as long as they run, until that pipe is full. The ranks never
    read their stdin: these bytes fill it, and mlx.launch then waits on the ranks' output.
    None where a pipe cannot be made big enough (not Linux): mlx.launch spins there.
    """
    grow = getattr(fcntl, "F_SETPIPE_SZ", None)
    read, write = os.pipe()
    try:
        if grow is None or fcntl.fcntl(write, grow, 2 * STDIN_FILL) < STDIN_FILL:
            raise OSError("the pipe cannot hold the fill")
        if os.write(write, bytes(STDIN_FILL)) < STDIN_FILL:
            raise OSError("the pipe took part of the fill")
    except OSError:
        os.close(read)
        os.close(write)
        return None
    return read, write


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own session; on timeout, kill the session (every rank)."""
    return _wait(_popen(command), timeout)


def _wait(proc: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``proc``'s status and output; past ``timeout``, its session is killed and the test fails."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc``'s session (every rank) and reap it, if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    """``mlx.launch -n 2 --backend ring`` on 127.0.0.1 (its own status is 0 even when a rank fails)."""
    launch = str(LAUNCH) if LAUNCH.exists() else "mlx.launch"
    port = _ring_ports()
    command = [launch, "-n", "2", "--backend", "ring", "--starting-port", str(port)]
    command += ["--python", sys.executable, *args]
    return _run(command, TIMEOUT)


#: Outputs of examples/distributed/check.py that do not depend on how the model is split.
SAME = (
    "batched",
    "after_cancel",
    "serial",
    "after_serial_cancel",
    "preempted_rows",
    "preempting",
    "repeat",
    "staggered",
)


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2: mlx-lm can split it into pipeline stages (a llama only by tensor)."""
    from trio_mlx.testing import make_random_llama

    path = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    return make_random_llama(path, model_type="qwen2", num_hidden_layers=3)


def _compare(model: Path, tmp_path: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """check.py's outputs in one process and over 2 ranks (``args`` go to the 2-rank run).

    The one-process run shares nothing with the ranks but the model's files: it runs
    beside the launch, mostly while the ranks start up.
    """
    single, double = tmp_path / "single.json", tmp_path / "double.json"
    alone = _popen([sys.executable, str(SCRIPT), str(model), str(single)])
    try:
        two = _launch(str(SCRIPT), str(model), str(double), *args)
        one = _wait(alone, TIMEOUT)
    finally:
        _kill(alone)
    assert one.returncode == 0, one.stdout[-4000:]
    assert two.returncode == 0, two.stdout[-4000:]
    assert "exited with code" not in two.stdout, two.stdout[-4000:]
    return json.loads(single.read_text()), json.loads(double.read_text())


def test_tensor_parallel_ranks_match_one_process(tiny_model_path: Path, tmp_path: Path) -> None:
    # Rank 0 idles longer than the followers' timeout mid-way: its heartbeats keep them.
    expected, got = _compare(
        tiny_model_path, tmp_path, "--env", "TRIO_MLX_DISTRIBUTED_TIMEOUT=4", "--idle", "5"
    )
    # Greedy, batched and serial, with cancellations, a preemption and a
    # prompt-cache hit in the middle: the same tokens.
    for key in SAME:
        assert got[key] == expected[key], key
    assert all(len(tokens) > 0 for tokens in got["batched"])
    assert got["preemptions"] >= 1
    assert got["repeat_cached"] > 0
    assert got["after_idle"] == expected["batched"][0]
    # Sampled rows finish too (their tokens may differ in the last float bit).
    assert len(got["sampled_lengths"]) == 2
    # What cannot be mirrored is refused with a clear error.
    assert got["refused"] == [
        "InvalidRequest: distributed mode does not support LoRA adapters",
        "InvalidRequest: distributed mode does not support run_exclusive",
    ]
    assert expected["refused"] == ["NotFound: no adapter named 'x' is mounted"]


def test_pipeline_parallel_ranks_match_one_process(tiny_qwen2_path: Path, tmp_path: Path) -> None:
    # With a prefill stall bound on the 2 ranks only: rank 0 sizes each chunk from its
    # own clock and the follower cuts alike (the plan carries it), or their collectives
    # would not match; and chunked or not, the tokens are the same.
    expected, got = _compare(
        tiny_qwen2_path, tmp_path, "--parallel", "pipeline", "--prefill-stall", "1.02"
    )
    for key in SAME:
        assert got[key] == expected[key], key
    assert got["statistics"]["prompt_token_seconds"] is not None, "the bound measured"
    assert expected["statistics"]["prompt_token_seconds"] is None
    assert got["preemptions"] >= 1
    # Pipeline stages hold different layers: the prompt cache is off.
    assert got["repeat_cached"] == 0
    assert expected["repeat_cached"] > 0


def test_pipeline_parallel_refuses_a_model_without_stages(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "x.json"
    run = _launch(str(SCRIPT), str(tiny_model_path), str(out), "--parallel", "pipeline")
    # mlx-lm's llama has tensor sharding only: a clear error on every rank, no hang.
    assert "cannot shard the model" in run.stdout, run.stdout[-4000:]
    assert "does not support pipeline parallelism" in run.stdout, run.stdout[-4000:]
    assert not out.exists()


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


def test_leader_loss_ends_the_follower(tiny_model_path: Path, tmp_path: Path) -> None:
    run = _launch(
        "--env",
        "TRIO_MLX_DISTRIBUTED_TIMEOUT=3",
        str(SCRIPT),
        str(tiny_model_path),
        str(tmp_path / "x.json"),
        "--leader-leaves-after",
        "20",
    )
    # Rank 0 vanished mid-generation (status 0, no output); the follower noticed and failed.
    assert not (tmp_path / "x.json").exists()
    assert "rank 1 exited with code 1" in run.stdout, run.stdout[-4000:]


def _ring_ports(count: int = 8) -> int:
    """A first port of ``count`` free ones for the ring backend, below the ephemeral range.

    Random ports inside the kernel's ephemeral range (32768-60999 on Linux) collide
    with client sockets of whatever else runs on the machine; the ring then fails to
    bind ("error: 98"). Each candidate block is checked by binding it.
    """
    for _ in range(200):
        start = random.randrange(20000, 32000 - count, count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(start, start + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return start
    raise RuntimeError("no block of free ports for the ring backend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_pid(rank: int, marker: str) -> int | None:
    """The pid of the process of ``rank`` whose command line holds ``marker`` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and f"MLX_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_serve_over_two_ranks_answers_and_stops_on_sigterm(tiny_model_path: Path) -> None:
    import httpx
    import openai

    port = _free_port()
    launch = str(LAUNCH) if LAUNCH.exists() else "mlx.launch"
    serve = [
        str(Path(sys.executable).parent / "trio-mlx"),
        "serve",
        "--model",
        str(tiny_model_path),
    ]
    serve += ["--port", str(port), "--no-fast-blas", "--graceful-timeout", "5"]
    start = _ring_ports()
    command = [launch, "-n", "2", "--backend", "ring", "--starting-port", str(start), "--", *serve]
    proc = _popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert httpx.get(f"{url}/health").json()["ranks"] == 2
        assert "trio_mlx_ranks 2.0" in httpx.get(f"{url}/metrics").text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        batched = client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert batched.usage is not None
        assert batched.usage.completion_tokens == 4
        # A seed: the serial lane, mirrored on the follower.
        seeded = client.completions.create(model=model, prompt="Hello", max_tokens=4, seed=7)
        assert seeded.usage is not None
        assert seeded.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model=model, prompt="Hello", max_tokens=4, extra_body={"adapter": "shout"}
            )
        assert refused.value.code == "unsupported_in_distributed_mode"
        # SIGTERM to rank 0: it finishes, closes the group, and every rank exits 0.
        rank0 = _rank_pid(0, f"--port\0{port}")
        assert rank0 is not None
        os.kill(rank0, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "exited with code" not in out, out[-4000:]
    assert "stopped" in out, out[-4000:]


def test_start_up_waits_for_a_silent_rank_only_until_the_start_timeout(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    run = _launch(
        "--env",
        "TRIO_MLX_DISTRIBUTED_START_TIMEOUT=3",
        str(SCRIPT),
        str(tiny_model_path),
        str(tmp_path / "x.json"),
        "--follower-stalls",
    )
    # The follower joined the group but never loaded: rank 0 gave up, status 1.
    assert "rank 0 exited with code 1" in run.stdout, run.stdout[-4000:]
    # Not after a start timeout's wait (600 s by default): _launch fails past TIMEOUT.
    assert not (tmp_path / "x.json").exists()


def test_adapter_path_is_refused_on_every_rank_at_start(tiny_model_path: Path) -> None:
    launch = str(LAUNCH) if LAUNCH.exists() else "mlx.launch"
    serve = [str(Path(sys.executable).parent / "trio-mlx"), "serve", "--no-fast-blas"]
    serve += ["--model", str(tiny_model_path), "--port", str(_free_port())]
    serve += ["--adapter-path", str(tiny_model_path)]
    start = _ring_ports()
    run = _run(
        [launch, "-n", "2", "--backend", "ring", "--starting-port", str(start), "--", *serve],
        TIMEOUT,
    )
    # Rank 0's settings reach the follower first, so both refuse and nobody waits out
    # the start timeout (600 s); whichever rank fails first, mlx.launch ends the other.
    refusal = "trio-mlx: error: distributed mode does not support LoRA adapters"
    assert run.stdout.count(refusal) == 2, run.stdout[-4000:]  # rank 0's and the follower's
    assert "exited with code 1" in run.stdout, run.stdout[-4000:]
    # And not after the start timeout (600 s): _run fails past TIMEOUT.


def test_a_lost_group_exits_non_zero_even_when_the_program_ends_first() -> None:
    # The ring backend can raise on a lost peer instead of hanging: the engine
    # then closes cleanly and the program may end inside the exit grace.
    program = (
        "from trio_mlx._dist.leader import _exit_soon\n"
        "_exit_soon(1)\n"
        "print('program ended', flush=True)\n"
    )
    run = _run([sys.executable, "-c", program], TIMEOUT)
    assert "program ended" in run.stdout, run.stdout
    assert run.returncode == 1, run.stdout


def test_a_lost_group_makes_the_command_line_exit_non_zero() -> None:
    # ``trio-mlx serve`` ends its process with os._exit (no interpreter exit):
    # a serve that stopped inside the exit grace must not report success.
    program = (
        "from trio_mlx._dist.leader import _exit_soon\n"
        "from trio_mlx_http._cli import _exit_now\n"
        "_exit_soon(1)\n"
        "_exit_now(0)\n"
    )
    run = _run([sys.executable, "-c", program], TIMEOUT)
    assert run.returncode == 1, run.stdout


def test_every_command_but_close_has_one_follower_handler() -> None:
    from trio_mlx._dist.follower import HANDLERS
    from trio_mlx._dist.leader import Command

    # CLOSE ends the follower's loop itself; every other command has its handler.
    assert set(HANDLERS) == set(Command) - {Command.CLOSE}


@pytest.mark.parametrize("message", [("nope", ()), "step", None, ("step",)])
def test_a_follower_refuses_what_is_not_a_command(message: Any) -> None:
    from trio_mlx._dist.follower import _decode
    from trio_mlx._dist.leader import ProtocolError

    with pytest.raises(ProtocolError, match="not a command from rank 0"):
        _decode(message)
