"""The resident worker (`python -m nbsim.server.worker`, started by `nbsim worker start`): PyTorch and nbsim's
render path imported once, then one command at a time from the clients of nbsim.server.client, each in a
child process of its own (CommandProcess).

The child owns everything a command may change: it takes the client's working folder, umask, NBSIM_*
variables and OMP_NUM_THREADS (torch's thread count), sends its output to the client as frames on the
client's connection (which the worker passes it), and reports the command's exit status, which the
worker relays to the client. So no command sees another's settings, and the worker's own stay as they
were. The child is forked while the worker waits for a client, and the worker answers the client before
it reaps the child, so neither the fork nor the child's exit (milliseconds each) adds to a command's
time; what remains is the child's first touch of memory it shares with the worker.

Cancelling: when the client hangs up (anything readable on its connection), the worker sends the child
SIGTERM, which raises _Cancelled at the child's next Python step (rendering calls PyTorch tile by tile
and op by op); `finally` blocks run, so atomic_write (nbsim.io.atomic: a temporary file, renamed when
complete) removes its temporary file, and a cancelled command leaves complete files or none. A child
still running CANCEL_GRACE_S later (stuck in one long call that runs no Python) is killed, which may
leave a temporary file behind.

Tables kept: a command's child hands the worker, after its status, the reflection tables and models its
command parsed (nbsim.io.structure_files.TABLES and MODELS, explicit caches keyed by the file's SHA-256),
as a pickle in an unnamed temporary file whose descriptor it passes; the worker keeps them, so every later
child finds them parsed. A series of commands naming one table parses it once (`nbsim worker status`
counts the parses), and each frame costs its render.

What the worker must never do, so that its children work: render, or start OpenMP or PyTorch thread
pools any other way (a forked child cannot use the pool of a parent that ran a parallel region, and can
deadlock in it), or initialise CUDA (a forked child cannot use CUDA once its parent did). The worker only
imports, and opens the CPU kernels the cache holds (which runs none of them), so that its children find
them loaded; a child asked for `-device cuda` initialises CUDA and opens its kernels itself.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import pickle
import select
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from ..errors import signal_name
from .protocol import (
    DECLINE,
    DEFAULT_IDLE_TIMEOUT_S,
    EXIT,
    STDERR,
    STDOUT,
    idle_timeout,
    private_folder,
    read_request,
    refuse_shared_folder,
    send_frame,
    socket_path,
    source_digest,
)

CANCEL_GRACE_S = 10.0
UNSTARTED_STATUS = 2
"""A child's status when it could not start the command (its working folder is gone, say)."""


class _Cancelled(BaseException):
    """Raised in a child by SIGTERM, the worker's cancel (a BaseException, so that the CLI's own handlers
    let it through and only `finally` blocks run)."""


class _FrameWriter(io.TextIOBase):
    """A text stream sending each write to the client as one frame; writes after the client has gone are
    dropped (the worker cancels the command then)."""

    def __init__(self, connection: socket.socket, kind: bytes):
        self.connection, self.kind = connection, kind

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            _send(self.connection, self.kind, text)
        return len(text)


def main(argv: list[str] | None = None) -> int:
    """`python -m nbsim.server.worker [--idle-timeout SECONDS]`: serve in the foreground."""
    parser = argparse.ArgumentParser(prog="nbsim worker serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-timeout", type=idle_timeout, default=DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                        help=f"exit after this long without a command (default {DEFAULT_IDLE_TIMEOUT_S:g})")
    return serve(parser.parse_args(argv).idle_timeout)


def serve(idle_timeout_s: float) -> int:
    """Import the render path once, then serve commands one at a time until idle or stopped. A lock next
    to the socket keeps a second worker for the same folder from starting."""
    from ..cli import simulate  # noqa: F401 - PyTorch and the render path, imported once for every child

    path = socket_path()
    if not private_folder(path):
        return refuse_shared_folder(path)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("nbsim worker: another worker serves this cache folder", file=sys.stderr)
            return 0
        path.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(path))
            os.chmod(path, 0o600)
            listener.listen(16)
            listener.settimeout(idle_timeout_s)
            try:
                _serve_connections(listener, path)
            finally:
                path.unlink(missing_ok=True)
    return 0


def _serve_connections(listener: socket.socket, path: Path) -> None:
    started, digest, served, parses = time.time(), source_digest(), 0, 0
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    child = _next_child(listener)
    try:
        while True:
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                return
            with connection:
                connection.settimeout(None)
                try:
                    message = read_request(connection)
                    command = message.get("command")
                    if command == "status":
                        kept = sum(len(files) for files in _parsed_files())
                        _send(connection, STDOUT, f"pid {os.getpid()}, up {time.time() - started:.0f} s, "
                                                  f"{served} commands served, {kept} tables kept, {parses} "
                                                  f"table parses, socket {path}")
                    elif command == "stop":
                        _send(connection, STDOUT, f"stopped (pid {os.getpid()})")
                        return
                    elif command == "run" and message.get("source") != digest:
                        _send(connection, DECLINE, "nbsim: note: the worker was started with other nbsim "
                                                   "sources and has stopped; running in this process\n")
                        return
                    elif command == "run" and message.get("cuda_visible_devices") != devices:
                        _send(connection, DECLINE, "")
                    elif command == "run":
                        served += 1
                        if not child.waiting():
                            child.close()
                            child = _next_child(listener)
                        status = child.run(connection, message)
                        if status is not None:
                            _send(connection, EXIT, json.dumps(status))
                except Exception as error:  # noqa: BLE001 - one bad request must not end the worker
                    _send(connection, STDERR, _could_not_run(error))
                    _send(connection, EXIT, str(UNSTARTED_STATUS))
            if child.used:
                parses += child.adopt_tables()
                child.close()
                child = _next_child(listener)
    finally:
        child.close()


def _next_child(listener: socket.socket) -> CommandProcess:
    """The process for the next command, forked once the worker has opened the kernels the cache holds."""
    open_cached_kernels()
    return CommandProcess.fork(listener)


def open_cached_kernels() -> None:
    """Open every CPU kernel package the cache holds for this installation (nbsim.kernel.aot), so each
    forked command finds them open; opening loads code and constants and runs nothing, so no thread
    pool starts."""
    import torch

    from ..kernel.aot import open_cached_packages
    from ..kernel.cache import KernelCache

    open_cached_packages(KernelCache.default(), torch.device("cpu"))


def _parsed_files() -> tuple[Any, ...]:
    """The process's caches of parsed tables and models (keyed by content hash), which the worker keeps."""
    from ..io.structure_files import MODELS, TABLES

    return TABLES, MODELS


def _send(connection: socket.socket, kind: bytes, text: str) -> None:
    """A frame to a client that may have gone."""
    with contextlib.suppress(OSError):
        send_frame(connection, kind, text)


def _could_not_run(error: Exception) -> str:
    return f"nbsim: error: the worker could not run the command: {type(error).__name__}: {error}\n"


class CommandProcess:
    """A child of the worker that runs one command. It is forked ahead of its command, while the worker
    waits for a client, and reports the command's status before it exits: neither the fork nor the
    child's exit adds to a command's time."""

    def __init__(self, pid: int, control: socket.socket):
        self.pid, self.control, self.used = pid, control, False

    @classmethod
    def fork(cls, listener: socket.socket) -> CommandProcess:
        """A child waiting for its command (the worker's `listener` closed in it)."""
        control, child_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                control.close()
                listener.close()
                _run_command(child_control)
            finally:
                os._exit(UNSTARTED_STATUS)  # never back into the worker's own code, whatever was raised
        child_control.close()
        return cls(pid, control)

    def waiting(self) -> bool:
        """Whether the child still waits for its command (one killed from outside is replaced)."""
        with contextlib.suppress(ChildProcessError):
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        return False

    def run(self, connection: socket.socket, message: dict) -> int | None:
        """Hand the child the client's connection and request and wait for its status; None when the
        client hung up and the command was cancelled."""
        self.used = True
        socket.send_fds(self.control, [json.dumps(message).encode()], [connection.fileno()])
        started = time.monotonic()
        cancelled_at = self._wait_or_cancel(connection)
        if cancelled_at is not None:
            print(f"nbsim worker: the client went away after {cancelled_at - started:.1f} s; cancelled `nbsim "
                  f"{' '.join(message.get('argv', []))}` (stopped in {time.monotonic() - cancelled_at:.2f} s)",
                  file=sys.stderr, flush=True)
            return None
        reported = self._reported_status()
        if reported is not None:
            return reported
        status = os.waitstatus_to_exitcode(self._reap())
        if status < 0:
            _send(connection, STDERR, f"nbsim: error: the command's process was killed by "
                                      f"{signal_name(-status)}\n")
            return 128 - status
        return status

    def _wait_or_cancel(self, connection: socket.socket) -> float | None:
        """Wait until the child reports or exits; should its client hang up first, send it SIGTERM (and
        SIGKILL after CANCEL_GRACE_S). The time of the cancel, or None."""
        child_exit = os.pidfd_open(self.pid)
        try:
            poller = select.poll()
            poller.register(self.control, select.POLLIN)
            poller.register(child_exit, select.POLLIN)
            poller.register(connection, select.POLLIN | select.POLLPRI)
            cancelled_at = None
            while True:
                timeout_ms = None if cancelled_at is None else CANCEL_GRACE_S * 1000
                ready = {fd for fd, _ in poller.poll(timeout_ms)}
                if ready & {self.control.fileno(), child_exit}:
                    return cancelled_at
                if cancelled_at is None:
                    os.kill(self.pid, signal.SIGTERM)
                    cancelled_at = time.monotonic()
                    poller.unregister(connection)
                else:
                    os.kill(self.pid, signal.SIGKILL)
        finally:
            os.close(child_exit)

    def _reported_status(self) -> int | None:
        """The status the child reported before it exited; None if it did not (it was killed)."""
        with contextlib.suppress(BlockingIOError):
            report = self.control.recv(64, socket.MSG_DONTWAIT)
            return int(report) if report else None
        return None

    def _reap(self) -> int:
        """The child's wait status, once it has exited."""
        self.control.close()
        return os.waitpid(self.pid, 0)[1]

    def adopt_tables(self) -> int:
        """Keep the tables and models the child's command parsed (`_hand_over_tables`: its message after the
        status) in this process's caches; the parses it reports (0 from a child that handed nothing over)."""
        with contextlib.suppress(OSError):
            while True:
                message, descriptors, _, _ = socket.recv_fds(self.control, 64, 1)
                if descriptors:
                    with os.fdopen(descriptors[0], "rb") as stream:
                        handed = pickle.load(stream)
                    for files, entries in zip(_parsed_files(), handed["entries"], strict=True):
                        for key, value in entries:
                            files.keep(key, value)
                    return handed["parses"]
                if not message:  # the child closed its end without handing anything over
                    return 0
        return 0

    def close(self) -> None:
        """Let the child end (one that has no command yet exits when its control socket closes)."""
        with contextlib.suppress(ChildProcessError):
            self._reap()


def _run_command(control: socket.socket) -> NoReturn:
    """In the child: wait for the command, take the client's settings and streams, run it, report its
    status and exit (os._exit: nothing of the worker's, no atexit handler or buffered stream, runs twice)."""
    status = 1
    before = [({key for key, _ in files.items()}, files.parses) for files in _parsed_files()]
    try:
        signal.signal(signal.SIGTERM, _cancel)
        request, descriptors, _, _ = socket.recv_fds(control, 1 << 20, 1)
        if not descriptors:
            os._exit(0)
        connection = socket.socket(fileno=descriptors[0])
        try:
            argv = _take_client_settings(json.loads(request))
        except Exception as error:  # noqa: BLE001 - reported to the client like a bad request
            _send(connection, STDERR, _could_not_run(error))
            status = UNSTARTED_STATUS
        else:
            sys.stdout = _FrameWriter(connection, STDOUT)
            sys.stderr = _FrameWriter(connection, STDERR)
            status = _command_status(argv)
    except _Cancelled:
        status = 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a late cancel (taken by any thread) must not skip the exit
        with contextlib.suppress(OSError):
            control.send(str(status).encode())
        with contextlib.suppress(OSError, pickle.PicklingError):
            _hand_over_tables(control, before)
        os._exit(status)


def _hand_over_tables(control: socket.socket, before: list[tuple[set, int]]) -> None:
    """In the child, after its status: the entries its command added to the table and model caches and how
    many parses it made, pickled into an unnamed temporary file whose descriptor goes to the worker."""
    entries = [[(key, value) for key, value in files.items() if key not in kept]
               for files, (kept, _) in zip(_parsed_files(), before, strict=True)]
    parses = sum(files.parses - parsed for files, (_, parsed) in zip(_parsed_files(), before, strict=True))
    with tempfile.TemporaryFile() as stream:
        pickle.dump({"entries": entries, "parses": parses}, stream, protocol=pickle.HIGHEST_PROTOCOL)
        stream.seek(0)
        socket.send_fds(control, [b"tables"], [stream.fileno()])


def _cancel(_signum: int, _frame) -> None:
    raise _Cancelled


def _take_client_settings(message: dict) -> list[str]:
    """The client's working folder, umask, NBSIM_* variables and OMP_NUM_THREADS, taken by this child;
    the command's arguments. torch.set_num_threads is called only for another count than the worker's:
    after it, even with the count unchanged, a process renders a small image several times slower
    (measured: 60 ms of CPU instead of 15 for the 24-pixel seed image)."""
    import torch

    os.chdir(message["cwd"])
    os.umask(int(message["umask"]))
    for name in [name for name in os.environ if name.startswith("NBSIM_")]:
        del os.environ[name]
    environment = message["env"]
    os.environ.update({name: value for name, value in environment.items() if name.startswith("NBSIM_")})
    threads = environment.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        os.environ["OMP_NUM_THREADS"] = threads
        if int(threads) != torch.get_num_threads():
            torch.set_num_threads(int(threads))
    return list(message["argv"])


def _command_status(argv: list[str]) -> int:
    """`nbsim argv`'s exit status, SystemExit included."""
    from ..cli import main as cli_main

    try:
        return cli_main(argv)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
