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
import ctypes
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from .cache import cache_dir

DEFAULT_IDLE_TIMEOUT_S = 1800.0
START_TIMEOUT_S = 120.0
ASK_TIMEOUT_S = 10.0
_HEADER = struct.Struct("!cI")
_STDOUT, _STDERR, _EXIT, _DECLINE = b"o", b"e", b"x", b"d"
_ABSENT, _BUSY = "absent", "busy"
CANCEL_RETRY_S = 2.0


class _Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP in a client, handled like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Cancelled(BaseException):
    """Raised in a command's thread in the worker once its client has gone (a BaseException, so that the
    CLI's own handlers let it through)."""


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
        from .cli import main as cli_main

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
    paths = sorted(Path(__file__).parent.glob("*.py"))
    if torch_spec is not None and torch_spec.origin is not None:
        paths.append(Path(torch_spec.origin).with_name("version.py"))
    for path in paths:
        digest.update(path.name.encode())
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
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "umask": _current_umask()})
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


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
        process = subprocess.Popen([sys.executable, "-m", "nbsim.worker", "worker", "serve", "--idle-timeout",
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
    from . import cli

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


if __name__ == "__main__":
    sys.exit(main())
