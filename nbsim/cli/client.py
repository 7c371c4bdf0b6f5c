"""The `nbsim` command, and a resident worker that runs its simulations without a new PyTorch start.

Starting Python and importing PyTorch takes seconds, often longer than rendering a detector with a
warm compile cache. `nbsim worker start` launches one background process per user and cache folder
that has PyTorch and nbsim imported and keeps loaded kernels; while it runs, each `nbsim <nanoBragg
options>` command is a light client (this module never imports torch) that sends its arguments, working
folder and NBSIM_* variables to the worker and relays its output and exit status. The worker serves one
command at a time and exits after an idle timeout, on `nbsim worker stop`, or when it finds the nbsim
sources changed. A client that is interrupted (Ctrl-C, SIGTERM, SIGHUP: one line, status 128 + the
signal) or killed hangs up, and the worker cancels its command at once (see _run_cancellable).
Without a worker, or with NBSIM_WORKER=off, the command runs in its own process, as it does when the
client sees other CUDA devices than the worker. `nbsim bench` always runs in its own process (its
timings and peak memory are per process).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..cache import cache_dir
from ..io.paths import current_umask

DEFAULT_IDLE_TIMEOUT_S = 1800.0
START_TIMEOUT_S = 120.0
ASK_TIMEOUT_S = 10.0
_HEADER = struct.Struct("!cI")
_STDOUT, _STDERR, _EXIT, _DECLINE = b"o", b"e", b"x", b"d"
_ABSENT, _BUSY = "absent", "busy"


class _Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP in a client, handled like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    """The `nbsim` entry point: worker control, else the command in the worker or in this process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = [a for a in argv if a != "--debug"]
    try:
        if command and command[0] == "worker":
            return worker_command(command[1:])
        if (command and command[0] not in ("bench", "kernels")
                and os.environ.get("NBSIM_WORKER", "").lower() != "off"):
            status = run_in_worker(argv)
            if status is not None:
                return status
        from . import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt as interrupt:
        return _interrupted(interrupt)


def _interrupted(interrupt: KeyboardInterrupt) -> int:
    """The one line and exit status of an interrupted command: 128 + the signal's number."""
    signum = interrupt.signum if isinstance(interrupt, _Interrupted) else signal.SIGINT
    by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
    print(f"nbsim: interrupted{by}", file=sys.stderr)
    return 128 + signum


@contextlib.contextmanager
def _termination_interrupts():
    """SIGTERM and SIGHUP raise _Interrupted in the main thread (where they are not ignored), so that a
    client ends like one stopped by Ctrl-C: its connection closed, one line, no traceback."""
    def interrupt(signum, _frame):
        raise _Interrupted(signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_DFL:
                saved[signum] = signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def socket_path() -> Path:
    """Where the worker for this user and cache folder listens (short enough for AF_UNIX)."""
    folder = cache_dir().expanduser().resolve()
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return Path("/tmp") / f"nbsim-{os.getuid()}" / f"worker-{digest}.sock"


def _private_folder(path: Path) -> bool:
    """Make the socket's folder (mode 700) if needed; False unless it is a real folder of this user
    that nobody else can enter."""
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(mode=0o700)
    folder = path.parent.lstat()
    return stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.getuid() and folder.st_mode & 0o077 == 0


def _refuse_shared_folder(path: Path) -> int:
    print(f"nbsim: error: {path.parent} is not a private folder of this user", file=sys.stderr)
    return 1


def source_digest() -> str:
    """The interpreter, PyTorch's version file and nbsim's sources (found without importing torch): a
    worker serves only clients with the same ones."""
    digest = hashlib.sha256(sys.executable.encode())
    torch_spec = importlib.util.find_spec("torch")
    package = Path(__file__).resolve().parents[1]
    paths = sorted(package.rglob("*.py"))
    if torch_spec is not None and torch_spec.origin is not None:
        paths.append(Path(torch_spec.origin).with_name("version.py"))
    for path in paths:
        digest.update(str(path.relative_to(package) if path.is_relative_to(package) else path.name).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _connect(timeout_s: float | None = None) -> socket.socket | None:
    path = socket_path()
    if not path.exists() or not _private_folder(path):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout_s)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    return connection


def _request(connection: socket.socket, message: dict) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


def _frames(connection: socket.socket):
    """(kind, payload) frames until the connection closes."""
    reader = connection.makefile("rb")
    while True:
        header = reader.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        kind, length = _HEADER.unpack(header)
        yield kind, reader.read(length)


def run_in_worker(argv: list[str]) -> int | None:
    """Run `nbsim argv` in the worker and relay its output; None when no worker serves this client
    (nothing was printed then, so the command can run in this process instead). Interrupted, the client
    hangs up, which cancels the command in the worker, and returns 128 + the signal's number."""
    connection = _connect()
    if connection is None:
        return None
    relayed = False
    with connection, _termination_interrupts():
        try:
            _request(connection, {
                "command": "run", "argv": argv, "cwd": os.getcwd(), "source": source_digest(),
                "env": {name: value for name, value in os.environ.items()
                        if name.startswith("NBSIM_") or name == "OMP_NUM_THREADS"},
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "umask": current_umask()})
            for kind, payload in _frames(connection):
                if kind == _EXIT:
                    return json.loads(payload)
                if kind == _DECLINE:
                    sys.stderr.write(payload.decode())
                    return None
                stream = sys.stdout if kind == _STDOUT else sys.stderr
                stream.write(payload.decode())
                stream.flush()
                relayed = True
        except KeyboardInterrupt as interrupt:
            connection.close()
            return _interrupted(interrupt)
        except OSError:
            pass
    if relayed:
        print("nbsim: error: the worker stopped during the command (see nbsim worker status)", file=sys.stderr)
        return 1
    return None


def worker_command(argv: list[str]) -> int:
    """`nbsim worker start|stop|status|serve`."""
    parser = argparse.ArgumentParser(prog="nbsim worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status", "serve"])
    parser.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                        help=f"exit after this long without a command (default {DEFAULT_IDLE_TIMEOUT_S:g})")
    options = parser.parse_args(argv)
    if not options.idle_timeout > 0:
        parser.error("--idle-timeout must be a positive number of seconds")
    if options.action == "serve":
        from .worker import serve

        return serve(options.idle_timeout)
    if options.action == "start":
        return start(options.idle_timeout)
    answer = _ask(options.action)
    if answer == _ABSENT:
        print(f"nbsim worker: not running ({socket_path()})")
        return 0 if options.action == "stop" else 1
    if answer == _BUSY:
        print("nbsim worker: running a command" + (" (it stops after that command)" if options.action == "stop"
                                                   else ""))
        return 0
    print(f"nbsim worker: {answer}")
    return 0


def _ask(command: str) -> str:
    """The worker's one-line answer to `command`, or _ABSENT, or _BUSY when it does not answer in time
    (the request stays queued and is served after the current command)."""
    connection = _connect(timeout_s=ASK_TIMEOUT_S)
    if connection is None:
        return _ABSENT
    with connection:
        try:
            _request(connection, {"command": command})
            for kind, payload in _frames(connection):
                if kind == _STDOUT:
                    return payload.decode()
        except TimeoutError:
            return _BUSY
        except OSError:
            return _ABSENT
    return _ABSENT


def start(idle_timeout_s: float) -> int:
    """Launch the worker in the background and wait until it answers."""
    running = _ask("status")
    if running != _ABSENT:
        print(f"nbsim worker: already running{'' if running == _BUSY else ': ' + running}")
        return 0
    path = socket_path()
    if not _private_folder(path):
        return _refuse_shared_folder(path)
    log = cache_dir() / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "nbsim.cli.client", "worker", "serve", "--idle-timeout",
                                    str(idle_timeout_s)], stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        answer = _ask("status")
        if answer != _ABSENT:
            print(f"nbsim worker: started{'' if answer == _BUSY else ': ' + answer}")
            return 0
        if process.poll() is not None:
            break
        time.sleep(0.1)
    print(f"nbsim: error: the worker did not start (see {log})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
