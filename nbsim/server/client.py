"""The `nbsim` command, and a resident worker that runs its simulations without a new PyTorch start.

Starting Python and importing PyTorch takes seconds, often longer than rendering a detector with a
warm compile cache. `nbsim worker start` launches one background process per user and cache folder
that has PyTorch and nbsim imported (nbsim.server.worker; this module talks to it through
nbsim.server.protocol and never imports it); while it runs, each `nbsim <nanoBragg options>` command is a
light client (this module never imports torch) that sends its arguments, working folder, umask and
NBSIM_* variables to the worker and relays its output and exit status. The worker serves one
command at a time and exits after an idle timeout, on `nbsim worker stop`, or when it finds the nbsim
sources changed. A client that is interrupted (Ctrl-C, SIGTERM, SIGHUP: one line, status 128 + the
signal) or killed hangs up, and the worker cancels its command at once (see nbsim.server.worker).
Without a worker, or with NBSIM_WORKER=off, the command runs in its own process, as it does when the
client sees other CUDA devices than the worker. `nbsim bench` always runs in its own process (its
timings and peak memory are per process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import NoReturn

from ..cache import cache_dir
from ..io.paths import current_umask
from .protocol import (
    DECLINE,
    DEFAULT_IDLE_TIMEOUT_S,
    EXIT,
    STDOUT,
    connect,
    frames,
    idle_timeout,
    private_folder,
    refuse_shared_folder,
    send_request,
    socket_path,
    source_digest,
)

START_TIMEOUT_S = 120.0
ASK_TIMEOUT_S = 10.0
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
        from ..cli import main as cli_main

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


def run_in_worker(argv: list[str]) -> int | None:
    """Run `nbsim argv` in the worker and relay its output; None when no worker serves this client
    (nothing was printed then, so the command can run in this process instead). Interrupted, the client
    hangs up, which cancels the command in the worker, and returns 128 + the signal's number."""
    connection = connect()
    if connection is None:
        return None
    relayed = False
    with connection, _termination_interrupts():
        try:
            send_request(connection, {
                "command": "run", "argv": argv, "cwd": os.getcwd(), "source": source_digest(),
                "env": {name: value for name, value in os.environ.items()
                        if name.startswith("NBSIM_") or name == "OMP_NUM_THREADS"},
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "umask": current_umask()})
            for kind, payload in frames(connection):
                if kind == EXIT:
                    return json.loads(payload)
                if kind == DECLINE:
                    sys.stderr.write(payload.decode())
                    return None
                stream = sys.stdout if kind == STDOUT else sys.stderr
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


class _WorkerParser(argparse.ArgumentParser):
    """argparse whose errors are nbsim's one line and exit status 2 (the client imports no nbsim.cli)."""

    def error(self, message: str) -> NoReturn:
        """One line, as every nbsim error, in place of argparse's usage and message."""
        print(f"nbsim: error: worker: {message}; see nbsim worker -h", file=sys.stderr)
        sys.exit(2)


def worker_command(argv: list[str]) -> int:
    """`nbsim worker start|stop|status|serve` (serve: the worker in the foreground, in place of this process)."""
    parser = _WorkerParser(prog="nbsim worker",
                           description="A resident process that runs nbsim commands without a new PyTorch start "
                                       "each (README.md, docs/architecture.md).")
    parser.add_argument("action", choices=["start", "stop", "status", "serve"],
                        help="start one in the background, stop it, show its state, or serve in the foreground")
    parser.add_argument("--idle-timeout", type=idle_timeout, default=DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                        help=f"exit after this long without a command (default {DEFAULT_IDLE_TIMEOUT_S:g})")
    options = parser.parse_args(argv)
    if options.action == "serve":
        sys.stdout.flush()
        os.execv(sys.executable, _worker_command_line(options.idle_timeout))
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
    connection = connect(timeout_s=ASK_TIMEOUT_S)
    if connection is None:
        return _ABSENT
    with connection:
        try:
            send_request(connection, {"command": command})
            for kind, payload in frames(connection):
                if kind == STDOUT:
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
    if not private_folder(path):
        return refuse_shared_folder(path)
    log = cache_dir() / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as log_file:
        process = subprocess.Popen(_worker_command_line(idle_timeout_s), stdin=subprocess.DEVNULL, stdout=log_file,
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


def _worker_command_line(idle_timeout_s: float) -> list[str]:
    """The worker's own process (nbsim.server.worker, which this torch-free module does not import)."""
    return [sys.executable, "-m", "nbsim.server.worker", "--idle-timeout", repr(idle_timeout_s)]


if __name__ == "__main__":
    sys.exit(main())
