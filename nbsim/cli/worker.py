"""The resident worker (`nbsim worker serve`, started by `nbsim worker start`): PyTorch and nbsim imported
once, kernels kept loaded, one command at a time from the clients of nbsim.cli.client, each in a thread
the worker cancels when its client hangs up (see _run_cancellable)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import io
import json
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path

from .client import (
    _DECLINE,
    _EXIT,
    _HEADER,
    _STDERR,
    _STDOUT,
    _private_folder,
    _refuse_shared_folder,
    socket_path,
    source_digest,
)

CANCEL_RETRY_S = 2.0


class _Cancelled(BaseException):
    """Raised in a command's thread in the worker once its client has gone (a BaseException, so that the
    CLI's own handlers let it through)."""


class _FrameWriter(io.TextIOBase):
    """A text stream sending each write to the client as one frame. Once the client is gone (a failed
    send, or `cancel` set by the worker), a write from the command's thread raises _Cancelled: the CLI
    prints before each file it writes, so a cancelled command stops there; other threads' writes are
    dropped."""

    def __init__(self, connection: socket.socket, kind: bytes, cancel: threading.Event):
        self.connection, self.kind, self.cancel = connection, kind, cancel
        self.owner = threading.get_ident()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text and not self.cancel.is_set():
            payload = text.encode()
            try:
                self.connection.sendall(_HEADER.pack(self.kind, len(payload)) + payload)
            except OSError:
                self.cancel.set()
        if self.cancel.is_set() and threading.get_ident() == self.owner:
            raise _Cancelled
        return len(text)


def serve(idle_timeout_s: float) -> int:
    """The worker: import everything once, then serve commands one at a time until idle or stopped.
    A lock next to the socket keeps a second worker for the same folder from starting."""
    from .. import cli

    path = socket_path()
    if not _private_folder(path):
        return _refuse_shared_folder(path)
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
                _serve_connections(listener, path, cli.main)
            finally:
                path.unlink(missing_ok=True)
    return 0


def _serve_connections(listener: socket.socket, path: Path, cli_main) -> None:
    started, digest, served = time.time(), source_digest(), 0
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    while True:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            return
        with connection:
            connection.settimeout(None)
            try:
                message = json.loads(connection.makefile("rb").readline() or b"{}")
                command = message.get("command")
                if command == "status":
                    _send(connection, _STDOUT, f"pid {os.getpid()}, up {time.time() - started:.0f} s, "
                                               f"{served} commands served, socket {path}")
                elif command == "stop":
                    _send(connection, _STDOUT, f"stopped (pid {os.getpid()})")
                    return
                elif command == "run" and message.get("source") != digest:
                    _send(connection, _DECLINE, "nbsim: note: the worker was started with other nbsim sources "
                                                "and has stopped; running in this process\n")
                    return
                elif command == "run" and message.get("cuda_visible_devices") != devices:
                    _send(connection, _DECLINE, "")
                elif command == "run":
                    served += 1
                    status = _run(connection, cli_main, message)
                    if status is not None:
                        _send(connection, _EXIT, json.dumps(status))
            except Exception as error:  # noqa: BLE001 - one bad request must not end the worker
                _send(connection, _STDERR, f"nbsim: error: the worker could not run the command: "
                                           f"{type(error).__name__}: {error}\n")
                _send(connection, _EXIT, "2")


def _send(connection: socket.socket, kind: bytes, text: str) -> None:
    with contextlib.suppress(OSError):
        payload = text.encode()
        connection.sendall(_HEADER.pack(kind, len(payload)) + payload)


def _run(connection: socket.socket, cli_main, message: dict) -> int | None:
    """One command with the client's folder, umask, NBSIM_* variables, thread count and output streams;
    its exit status, or None when its client went away and it was cancelled."""
    import torch

    saved_environment = {name: value for name, value in os.environ.items() if name.startswith("NBSIM_")}
    saved_cwd, saved_threads = os.getcwd(), torch.get_num_threads()
    saved_streams = sys.stdout, sys.stderr
    saved_umask = os.umask(int(message["umask"]))
    try:
        os.chdir(message["cwd"])
        for name in saved_environment:
            del os.environ[name]
        os.environ.update({k: v for k, v in message["env"].items() if k.startswith("NBSIM_")})
        threads = message["env"].get("OMP_NUM_THREADS", "")
        threads = int(threads) if threads.isdigit() and int(threads) > 0 else saved_threads
        argv = list(message["argv"])

        def command() -> int:
            torch.set_num_threads(threads)  # the command thread's own OpenMP setting
            try:
                return cli_main(argv)
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    return stop.code or 0
                print(stop.code, file=sys.stderr)
                return 1

        return _run_cancellable(connection, command, " ".join(argv))
    finally:
        sys.stdout, sys.stderr = saved_streams
        os.umask(saved_umask)
        os.chdir(saved_cwd)
        torch.set_num_threads(saved_threads)
        for name in [n for n in os.environ if n.startswith("NBSIM_")]:
            del os.environ[name]
        os.environ.update(saved_environment)


def _run_cancellable(connection: socket.socket, command, description: str) -> int | None:
    """Run `command` in a thread of the worker while this thread watches the client's connection: a
    client sends nothing after its request, so anything readable there (end of file, a hang-up, any
    byte) means it has gone, and the command is cancelled. Returns its status, or None if cancelled.

    Cancelling raises _Cancelled in the command's thread (PyThreadState_SetAsyncExc), which the thread
    sees at its next Python step: rendering calls PyTorch tile by tile and op by op, so it stops within
    one op; its output streams raise it too (_FrameWriter). A thread rather than a child process: the
    worker keeps its imported PyTorch, loaded kernels and CUDA context, and starts no process per
    command. Output files: a thread in atomic_write (nbsim.io.images: a temporary file, renamed when
    complete) is left to finish that file, then stops at its next print ("writing ..." precedes each
    file) or Python step; so a cancelled command leaves complete files or none, and no temporary one.
    Should the thread not stop (in a long call that runs no Python), the exception is raised again every
    CANCEL_RETRY_S; the worker serves the next command once the thread has stopped.
    """
    cancel = threading.Event()
    outcome: dict = {}
    wake_read, wake_write = os.pipe()

    def run() -> None:
        try:
            try:
                sys.stdout = _FrameWriter(connection, _STDOUT, cancel)
                sys.stderr = _FrameWriter(connection, _STDERR, cancel)
                outcome["status"] = command()
            except _Cancelled:
                cancel.set()
            except BaseException as error:  # noqa: BLE001 - handed to the serving thread
                outcome["error"] = error
            finally:
                os.write(wake_write, b".")
        except _Cancelled:
            cancel.set()

    thread = threading.Thread(target=run, name="nbsim command", daemon=True)
    started = time.monotonic()
    try:
        poller = select.poll()
        poller.register(connection.fileno(), select.POLLIN | select.POLLPRI)
        poller.register(wake_read, select.POLLIN)
        thread.start()
        finished = hung_up = False
        while not finished and not cancel.is_set():
            ready = {fd for fd, _ in poller.poll(1000)}
            finished = wake_read in ready or not thread.is_alive()
            hung_up = connection.fileno() in ready
            if hung_up:
                cancel.set()
        cancelled_at = time.monotonic()
        poller.unregister(connection.fileno())
        wait_s = 0.0 if hung_up else CANCEL_RETRY_S  # a command cancelled by its stream is stopping already
        while not finished:
            finished = bool(poller.poll(int(wait_s * 1000))) or not thread.is_alive()
            if finished:
                break
            if _writing_a_file(thread):
                wait_s = 0.01
                continue
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Cancelled))
            wait_s = CANCEL_RETRY_S
        thread.join()
    finally:
        os.close(wake_read)
        os.close(wake_write)
    if "status" in outcome:
        return outcome["status"]
    if cancel.is_set():
        print(f"nbsim worker: the client went away after {cancelled_at - started:.1f} s; cancelled `nbsim "
              f"{description}` (stopped in {time.monotonic() - cancelled_at:.2f} s)", file=sys.__stderr__, flush=True)
        return None
    raise outcome["error"]


def _writing_a_file(thread: threading.Thread) -> bool:
    """Whether `thread` is in nbsim's atomic_write (nbsim.io.images), found by name: nothing to import
    or fail while a command is being cancelled."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "atomic_write" and frame.f_globals.get("__name__", "").startswith("nbsim."):
            return True
        frame = frame.f_back
    return False
