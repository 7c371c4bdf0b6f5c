"""The resident worker: same files and messages as an in-process run, a client that never imports torch,
and a clean start/stop life cycle."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from .conftest import REPO_ROOT, SEED_ARGS

ARGS = f"{SEED_ARGS} -detpixels 24 -compile off -floatfile float.bin -intfile int.img -nonoise -nopgm".split()


def _nbsim(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbsim.server.client", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def worker_env(tmp_path):
    """An environment with its own cache folder (so its own worker), stopped afterwards."""
    env = {**os.environ, "NBSIM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("NBSIM_WORKER", None)
    yield env
    _nbsim(["worker", "stop"], tmp_path, env)


@pytest.fixture
def running_worker(tmp_path, worker_env):
    """worker_env with its worker started, for a test that stops it."""
    started = _nbsim(["worker", "start", "--idle-timeout", "300"], tmp_path, worker_env)
    assert started.returncode == 0 and "started" in started.stdout, started.stdout + started.stderr
    return worker_env


@pytest.fixture(scope="module")
def shared_worker(tmp_path_factory):
    """One worker for the tests that leave it running (a worker's start is a Python and PyTorch start, 1.5 s):
    an environment with a cache folder of its own, the worker stopped after the module. These tests check
    what their own commands changed (`_counts` before and after), not the totals."""
    folder = tmp_path_factory.mktemp("shared_worker")
    env = {**os.environ, "NBSIM_CACHE_DIR": str(folder / "cache")}
    env.pop("NBSIM_WORKER", None)
    started = _nbsim(["worker", "start", "--idle-timeout", "300"], folder, env)
    assert started.returncode == 0 and "started" in started.stdout, started.stdout + started.stderr
    yield env
    _nbsim(["worker", "stop"], folder, env)


def _counts(status: str) -> tuple[int, int, int]:
    """Commands served, tables kept and table parses, from the worker's status line."""
    found = re.search(r"(\d+) commands served, (\d+) tables kept, (\d+) table parses", status)
    assert found, status
    served, kept, parses = (int(count) for count in found.groups())
    return served, kept, parses


def _status_counts(env: dict[str, str], cwd: Path) -> tuple[int, int, int]:
    return _counts(_nbsim(["worker", "status"], cwd, env).stdout)


def _client(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A Python script run as the `nbsim` command, with ARGS as its arguments."""
    return subprocess.run([sys.executable, "-c", script, *ARGS], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_worker_renders_what_the_process_renders(tmp_path, running_worker):
    """Same files and output as a run in its own process (NBSIM_WORKER=off, which the worker does not serve)."""
    alone, served = tmp_path / "alone", tmp_path / "served"
    alone.mkdir()
    served.mkdir()
    in_process = _nbsim(ARGS, alone, {**running_worker, "NBSIM_WORKER": "off"})
    assert in_process.returncode == 0, in_process.stderr
    for _ in range(2):
        by_worker = _nbsim(ARGS, served, running_worker)
        assert by_worker.returncode == 0, by_worker.stderr
    status = _nbsim(["worker", "status"], tmp_path, running_worker)
    assert status.returncode == 0 and "2 commands served" in status.stdout

    assert by_worker.stdout == in_process.stdout
    for name in ("float.bin", "int.img"):
        assert (served / name).read_bytes() == (alone / name).read_bytes()

    bad = _nbsim([*ARGS, "-lambda", "-1"], served, running_worker)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("nbsim: error:"), bad.stderr

    stopped = _nbsim(["worker", "stop"], tmp_path, running_worker)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert _nbsim(["worker", "status"], tmp_path, running_worker).returncode == 1


def test_a_waiting_process_killed_from_outside_is_replaced(tmp_path, running_worker):
    """The process forked for the next command may die before a command comes (killed by a user or the
    system): the worker forks another, and the command is served."""
    import psutil

    status = _nbsim(["worker", "status"], tmp_path, running_worker)
    worker_pid = int(status.stdout.split("pid ")[1].split(",")[0])
    [waiting] = psutil.Process(worker_pid).children()
    waiting.kill()
    deadline = time.monotonic() + 30
    while waiting.is_running() and waiting.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    served = _nbsim(ARGS, tmp_path, running_worker)
    assert served.returncode == 0, served.stderr
    assert "1 commands served" in _nbsim(["worker", "status"], tmp_path, running_worker).stdout


def test_client_does_not_import_torch(tmp_path, shared_worker):
    """With a worker running, an `nbsim` command loads neither torch nor numpy."""
    result = _client("import json, sys\nfrom nbsim.server.client import main\nstatus = main(sys.argv[1:])\n"
                     "print(json.dumps([status, 'torch' in sys.modules, 'numpy' in sys.modules]))\n",
                     tmp_path, shared_worker)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0, False, False], result.stderr
    assert np.fromfile(tmp_path / "float.bin", dtype=np.float32).max() > 0


def test_worker_with_other_sources_steps_aside(tmp_path, running_worker):
    """A worker started from other nbsim sources stops, and the command runs in its own process."""
    result = _client("import sys\nimport nbsim.server.client as client\n"
                     "client.source_digest = lambda: 'other sources'\nsys.exit(client.main(sys.argv[1:]))\n",
                     tmp_path, running_worker)
    assert result.returncode == 0 and "other nbsim sources" in result.stderr
    assert (tmp_path / "float.bin").is_file()
    assert _nbsim(["worker", "status"], tmp_path, running_worker).returncode == 1


def test_without_a_worker_the_command_runs_in_process(tmp_path, worker_env):
    result = _nbsim(ARGS, tmp_path, worker_env)
    assert result.returncode == 0, result.stderr
    assert "not running" in _nbsim(["worker", "status"], tmp_path, worker_env).stdout


@pytest.mark.parametrize("argv, message", [(["statsu"], "invalid choice: 'statsu'"),
                                           ([], "the following arguments are required: action")])
def test_a_bad_worker_command_is_one_line(argv, message, capsys):
    """`nbsim worker` misspelt or without its action: one line and exit status 2, as every nbsim error."""
    from nbsim.server import client

    with pytest.raises(SystemExit) as exit_:
        client.main(["worker", *argv])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("nbsim: error: worker: ") and message in line and line.endswith("see nbsim worker -h")


def test_a_shared_socket_folder_is_refused(tmp_path, monkeypatch, capsys):
    """The socket's folder must be this user's and private; otherwise no worker is used or started."""
    from nbsim.server import client, protocol

    folder = tmp_path / "sockets"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    monkeypatch.setattr(protocol, "socket_path", lambda: folder / "worker.sock")
    monkeypatch.setattr(client, "socket_path", protocol.socket_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(folder / "worker.sock"))
        listener.listen(1)
        listener.settimeout(1)
        assert client.run_in_worker(["-help"]) is None
        with pytest.raises(TimeoutError):
            listener.accept()
    assert client.start(idle_timeout_s=1.0) == 1
    assert "not a private folder" in capsys.readouterr().err


def test_a_bad_request_gets_an_error_and_the_worker_goes_on(tmp_path, shared_worker, monkeypatch):
    from nbsim.server import client, protocol

    monkeypatch.setenv("NBSIM_CACHE_DIR", shared_worker["NBSIM_CACHE_DIR"])
    served_before = _counts(client._ask("status"))[0]
    with protocol.connect(timeout_s=60) as connection:
        protocol.send_request(connection, {"command": "run", "argv": ["-help"], "cwd": str(tmp_path / "gone"),
                                           "source": protocol.source_digest(), "env": {}, "umask": 0o022,
                                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
        frames = list(protocol.frames(connection))
    assert frames == [(b"e", frames[0][1]), (b"x", b"2")]
    assert b"FileNotFoundError" in frames[0][1]
    assert _counts(client._ask("status"))[0] == served_before + 1


LONG_ARGS = f"{SEED_ARGS} -detpixels 3000 -oversample 16 -compile off -floatfile long.bin -nonoise -nopgm".split()
"""Minutes of rendering on a few cores (256 steps for each of 9 million pixels), run only to be cancelled."""


def _interrupt_mid_render(folder: Path, env: dict[str, str], signum: int) -> subprocess.CompletedProcess:
    """Start LONG_ARGS through the worker, send the client `signum` once the worker renders, and return the
    client's result."""
    folder.mkdir()
    # The client gets the default SIGINT action whatever this test process inherited (a run in the
    # background, or a library that ignored SIGINT, would pass SIG_IGN on, and the client would rightly
    # keep ignoring it).
    client = subprocess.Popen([sys.executable, "-m", "nbsim.server.client", *LONG_ARGS], cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in client.stdout:  # the setup summary, printed just before rendering starts
            lines.append(line)
            if line.strip().endswith("steps per pixel"):
                break
        assert lines and lines[-1].strip() == "256 steps per pixel", "".join(lines) + client.stderr.read()
        time.sleep(0.3)  # into the render, which takes minutes
        client.send_signal(signum)
        stdout, stderr = client.communicate(timeout=10)
    finally:
        client.kill()
        client.wait()
    return subprocess.CompletedProcess(client.args, client.returncode, "".join(lines) + stdout, stderr)


def _worker_log_size(env: dict[str, str]) -> int:
    return (Path(env["NBSIM_CACHE_DIR"]) / "worker.log").stat().st_size


def _worker_serves_next_command_at_once(tmp_path: Path, env: dict[str, str], long_folder: Path, served_before: int,
                                        log_before: int) -> None:
    """A short command through the same worker finishes within seconds (the cancelled one would need
    minutes), the worker goes on serving (the cancelled command and the short one served since
    `served_before`), and the cancelled command left no file at all; what the worker logged since
    `log_before` says it cancelled it."""
    started = time.monotonic()
    short = _nbsim(ARGS, tmp_path, env)
    elapsed = time.monotonic() - started
    assert short.returncode == 0, short.stderr
    assert elapsed < 8, f"the next command waited {elapsed:.1f} s"
    assert np.fromfile(tmp_path / "float.bin", dtype=np.float32).max() > 0
    status = _nbsim(["worker", "status"], tmp_path, env)
    assert status.returncode == 0 and _counts(status.stdout)[0] == served_before + 2, status.stdout + status.stderr
    assert sorted(p.name for p in long_folder.iterdir()) == []
    log = (Path(env["NBSIM_CACHE_DIR"]) / "worker.log").read_bytes()[log_before:].decode()
    assert "cancelled `nbsim" in log and "Traceback" not in log, log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_client_cancels_its_command(tmp_path, shared_worker, signum):
    """Ctrl-C (or SIGTERM) in a client mid-render: one line and status 128 + signal, and the worker drops
    the command at once, writing none of its files."""
    long_folder = tmp_path / "long"
    served_before, log_before = _status_counts(shared_worker, tmp_path)[0], _worker_log_size(shared_worker)
    interrupted = _interrupt_mid_render(long_folder, shared_worker, signum)
    assert interrupted.returncode == 128 + signum, interrupted.stdout + interrupted.stderr
    assert interrupted.stderr.startswith("nbsim: interrupted") and interrupted.stderr.count("\n") == 1, \
        interrupted.stderr
    assert "writing long.bin" not in interrupted.stdout
    _worker_serves_next_command_at_once(tmp_path, shared_worker, long_folder, served_before, log_before)


@pytest.mark.timeout(60)
def test_a_killed_client_cancels_its_command(tmp_path, shared_worker):
    """A client killed mid-render (its connection just drops) cancels its command in the worker too."""
    long_folder = tmp_path / "long"
    served_before, log_before = _status_counts(shared_worker, tmp_path)[0], _worker_log_size(shared_worker)
    killed = _interrupt_mid_render(long_folder, shared_worker, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert killed.stderr == ""
    _worker_serves_next_command_at_once(tmp_path, shared_worker, long_folder, served_before, log_before)


def _run_in_child(worker, message: dict, hang_up_after_s: float | None = None) -> tuple[int | None, list]:
    """A worker.CommandProcess run on one end of a socket pair: its status and the frames the other end
    received (that end shut after `hang_up_after_s`, if given)."""
    from nbsim.server import protocol

    served, client = socket.socketpair()
    hang_up = threading.Timer(hang_up_after_s or 0, client.shutdown, [socket.SHUT_RDWR])
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            child = worker.CommandProcess.fork(listener)
        try:
            if hang_up_after_s is not None:
                hang_up.start()
            status = child.run(served, {"argv": ["test"], "env": {}, **message})
        finally:
            child.close()
        served.close()
        return status, list(protocol.frames(client))
    finally:
        hang_up.cancel()
        served.close()
        client.close()


@pytest.mark.timeout(30)
def test_a_command_cancelled_while_writing_leaves_whole_files(tmp_path, monkeypatch, capsys):
    """Cancelled while it computes and writes files in turn, a command's process stops within a moment,
    leaving each file complete and no temporary file (SIGTERM reaches it mid-file too: atomic_write
    writes a file in many parts, and removes its temporary file when interrupted)."""
    import torch  # noqa: F401 - imported before the fork, as in the worker

    from nbsim.io.atomic import atomic_write
    from nbsim.server import worker

    parts = [bytes(1 << 20)] * 16

    def command(argv: list[str]) -> int:
        for index in itertools.count():
            sum(range(100_000))  # stands for rendering
            atomic_write(Path(f"out{index % 3}.bin"), *parts)
        return 0

    monkeypatch.setattr(worker, "_command_status", command)
    started = time.monotonic()
    status, frames = _run_in_child(worker, {"cwd": str(tmp_path), "umask": 0o022}, hang_up_after_s=1.0)
    assert status is None and frames == []
    assert time.monotonic() - started < 3
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["out0.bin", "out1.bin", "out2.bin"]
    assert all(f.stat().st_size == 16 << 20 for f in files)
    assert "cancelled `nbsim test`" in capsys.readouterr().err


def test_each_command_has_its_own_folder_umask_and_variables(tmp_path, monkeypatch):
    """Two commands in a row, each with its client's working folder, umask, NBSIM_* variables and thread
    count, see only their own; the worker's own stay as they were."""
    import torch

    from nbsim.server import worker

    def command(argv: list[str]) -> int:
        print(json.dumps([os.getcwd(), oct(os.umask(0)), sorted((k, v) for k, v in os.environ.items()
                                                                   if k.startswith("NBSIM_")),
                          torch.get_num_threads()]))
        return 7

    monkeypatch.setattr(worker, "_command_status", command)
    monkeypatch.setenv("NBSIM_WORKER_OWN", "kept")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    cwd, umask, environment, threads = os.getcwd(), os.umask(0o022), dict(os.environ), torch.get_num_threads()
    try:
        seen = []
        for folder, mask, variables in ((first, 0o077, {"NBSIM_DEBUG": "1", "OMP_NUM_THREADS": "1"}),
                                        (second, 0o002, {"NBSIM_CACHE_DIR": str(first)})):
            status, frames = _run_in_child(worker, {"cwd": str(folder), "umask": mask, "env": variables})
            assert status == 7
            seen.append(json.loads(b"".join(payload for kind, payload in frames if kind == b"o")))
        assert os.getcwd() == cwd and os.umask(0o022) == 0o022 and dict(os.environ) == environment
        assert torch.get_num_threads() == threads
    finally:
        os.umask(umask)
    assert seen[0][:3] == [str(first), oct(0o077), [["NBSIM_DEBUG", "1"]]]
    assert seen[1][:3] == [str(second), oct(0o002), [["NBSIM_CACHE_DIR", str(first)]]]
    assert seen[0][3] == 1 and seen[1][3] == threads


def _worker_process(env: dict[str, str], folder: Path) -> dict[str, str]:
    """The worker's working folder, umask and number of threads, read from /proc."""
    status = _nbsim(["worker", "status"], folder, env).stdout
    pid = status.split("pid ")[1].split(",")[0]
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"cwd": os.readlink(f"/proc/{pid}/cwd"), "umask": fields["Umask"], "threads": fields["Threads"]}


@pytest.mark.timeout(120)
def test_commands_in_a_row_keep_their_settings_apart(tmp_path, shared_worker):
    """Commands through one worker in other folders, umasks and thread counts (OpenMP with 2 threads in
    some): each writes its own files with its own permissions, and the worker itself keeps its folder,
    umask and threads (it never renders, so it never starts a thread pool its children would inherit)."""
    before = _worker_process(shared_worker, tmp_path)
    served_before = _status_counts(shared_worker, tmp_path)[0]
    for index, (mask, threads) in enumerate([(0o077, "2"), (0o022, "1"), (0o027, "2")]):
        folder = tmp_path / f"command{index}"
        folder.mkdir()
        env = {**shared_worker, "OMP_NUM_THREADS": threads}
        result = subprocess.run([sys.executable, "-m", "nbsim.server.client", *ARGS], cwd=folder, env=env,
                                capture_output=True, text=True, timeout=60,
                                preexec_fn=lambda mask=mask: os.umask(mask))
        assert result.returncode == 0, result.stderr
        assert {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()} == \
            {"float.bin": 0o666 & ~mask, "int.img": 0o666 & ~mask}
    after = _worker_process(shared_worker, tmp_path)
    assert after["cwd"] == before["cwd"] and after["umask"] == before["umask"]
    assert int(after["threads"]) <= int(before["threads"])  # NumPy's BLAS shuts its own pool at a fork
    assert _status_counts(shared_worker, tmp_path)[0] == served_before + 3


def test_the_worker_never_initialises_cuda():
    """What the worker imports before it forks asks CUDA nothing (a child could not use CUDA after a parent
    that did): the render path imported in a fresh process, with CUDA's device count watched."""
    script = ("import unittest.mock, torch\ncalls = []\n"
              "with unittest.mock.patch.object(torch._C, '_cuda_getDeviceCount', create=True,\n"
              "                                side_effect=lambda: calls.append(1) or 0):\n"
              "    from nbsim.cli import simulate\n    from nbsim.server import worker\n"
              "print(len(calls), torch.cuda.is_initialized())\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["0", "False"], result.stderr


def test_a_command_whose_process_dies_ends_in_one_line(tmp_path, monkeypatch):
    """A command's process killed by a signal (out of memory, say): one error line and status 128 + the signal."""
    from nbsim.server import worker

    monkeypatch.setattr(worker, "_command_status", lambda argv: os.kill(os.getpid(), signal.SIGKILL))
    status, frames = _run_in_child(worker, {"cwd": str(tmp_path), "umask": 0o022})
    assert status == 128 + signal.SIGKILL
    assert frames == [(b"e", b"nbsim: error: the command's process was killed by SIGKILL\n")]


def test_a_series_through_the_worker_parses_its_tables_once(tmp_path, shared_worker):
    """Commands naming the same table (an -hkl file, a -model and the |F| computed from it) find it parsed:
    the worker keeps what its commands parsed, by content hash, for the commands after; the images are
    those of commands run alone."""
    table = tmp_path / "p1.hkl"
    table.write_text("".join(f"{h} {k} {l} {1 + (h * h + 2 * k * k + 3 * l * l) % 97}\n"
                             for h in range(-8, 9) for k in range(-8, 9) for l in range(-8, 9)))
    model = REPO_ROOT / "config" / "examples" / "model.cif"
    common = "-N 3 -detpixels 24 -distance 80 -compile off -nonoise -nopgm -intfile int.img".split()
    frames = [[*"-hkl p1.hkl -cell 40 50 60 90 90 90".split(), *common, "-phi", str(phi), "-floatfile",
               f"hkl{phi}.bin"] for phi in range(3)]
    frames += [["-model", str(model), *common, "-phi", str(phi), "-floatfile", f"model{phi}.bin"] for phi in range(2)]
    before = _status_counts(shared_worker, tmp_path)
    for args in frames:
        served = _nbsim(args, tmp_path, shared_worker)
        assert served.returncode == 0, served.stderr
    after = _status_counts(shared_worker, tmp_path)
    # one parse of the table, one of the model file and one |F| computation, over five commands
    assert [now - then for now, then in zip(after, before, strict=True)] == [5, 3, 3], (before, after)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "p1.hkl").write_bytes(table.read_bytes())
    for args in (frames[2], frames[4]):
        assert _nbsim(args, alone, {**shared_worker, "NBSIM_WORKER": "off"}).returncode == 0
        name = args[-1]
        assert (alone / name).read_bytes() == (tmp_path / name).read_bytes()
