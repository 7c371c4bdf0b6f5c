"""Atomic file writes: the content goes to a temporary file in the destination's folder (inside a temporary
folder there, so that writers which record the file's name see the real one), which is then
renamed over the destination (`os.replace`), so a reader sees the old file or the whole new one, never a
part; when writing fails the temporary file is removed and the failure (a full disk, a folder that takes
no files) is a one-line NbsimError naming the destination. Used for images, the kernel cache's descriptions
and the sweep's JSON records.

What is renamed over is only ever a regular file or a new name. A symbolic link is followed: its target is
replaced (atomically, beside the target) and the link kept. A FIFO or a character or block device (say,
/dev/null) is written into, never replaced: the bytes are streamed into it, and a library's file (HDF5,
CBF: written by name, seeking) is built whole in a temporary folder first, then copied in, so a failed
write sends nothing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import NbsimError
from .paths import check_writable, current_umask, is_stream, write_destination

COPY_CHUNK_BYTES = 1 << 20


def atomic_write(path: str | Path, *parts: bytes | memoryview) -> None:
    """Write the parts, in order, as the whole content of `path` (created with the usual permissions:
    0o666 less the umask)."""
    if is_stream(path):
        check_writable(path)
        _stream_into(Path(path), parts)
        return

    def write_parts(temporary: Path) -> None:
        with open(temporary, "wb") as stream:
            for part in parts:
                stream.write(part)

    atomic_write_with(path, write_parts)


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Let `write` (a library's writer: fabio, h5py) create the file under its own name in a temporary
    folder beside `path` (its target, for a symbolic link), then rename it over that; on failure the
    temporary folder is removed. Into a FIFO or device the finished file is copied instead."""
    path = Path(path)
    check_writable(path)
    streamed = is_stream(path)
    destination = write_destination(path)
    folder = None
    with _default_termination_raised():
        try:
            with _termination_deferred():
                folder = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp",
                                               dir=None if streamed else destination.parent))
            temporary = folder / destination.name
            write(temporary)
            if streamed:
                with open(temporary, "rb") as built:
                    _stream_into(path, iter(lambda: built.read(COPY_CHUNK_BYTES), b""))
            else:
                os.chmod(temporary, 0o666 & ~current_umask())
            with _termination_deferred():  # renamed and cleaned up in one step: no cancel lands between
                if not streamed:
                    os.replace(temporary, destination)
                shutil.rmtree(folder, ignore_errors=True)
                folder = None
        except OSError as error:  # a full disk, a folder that takes no new files (/proc): the user's to fix
            raise NbsimError(f"cannot write {path}: {error.strerror or error}") from None
        finally:
            if folder is not None:
                with _termination_deferred():
                    shutil.rmtree(folder, ignore_errors=True)


def _stream_into(path: Path, parts: Iterable[bytes | memoryview]) -> None:
    """Write the parts into an existing FIFO or device, in order. Opened without O_CREAT, so a path that
    vanished meanwhile is an error, never a new file; a FIFO's open waits for its reader."""
    try:
        with open(os.open(path, os.O_WRONLY), "wb") as stream:
            for part in parts:
                stream.write(part)
    except OSError as error:
        raise NbsimError(f"cannot write {path}: {error.strerror or error}") from None


class _Terminated(BaseException):
    """SIGTERM, raised where its default action would end the process at once (see _default_termination_raised)."""


@contextlib.contextmanager
def _default_termination_raised() -> Iterator[None]:
    """Where SIGTERM has its default action (a plain `nbsim` process that Snakemake, SLURM or `kill` ends), it
    raises _Terminated for the while, so that the temporary folder is removed; the process then ends by SIGTERM
    as it would have. A handler of the program's own (the worker's cancel) is left as it is."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, terminate)
    terminated = False
    try:
        yield
    except _Terminated:
        terminated = True
        raise
    finally:
        terminated |= isinstance(_restored(signal.SIGTERM, signal.SIG_DFL), _Terminated)
        if terminated:
            signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def _termination_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT (the worker's cancel, Ctrl-C) held back while the temporary folder is made and
    recorded, or renamed and removed: a cancel lands before or after, never between the folder's creation and
    its cleanup, which would leave it behind. Their handlers are swapped for one that notes the signal, raised
    again once they are back. A signal mask would not do: it holds a signal back from this thread only, and
    in a process with other threads (a render's OpenMP pool, in the worker's command processes) one of them
    takes it and Python runs the handler here all the same. Python runs handlers in the main thread only, so
    elsewhere nothing is swapped (a signal's default action there is the process's end whatever this does)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    swapped: dict[int, Any] = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            handler = signal.getsignal(signum)
            if handler is not None:  # None: a handler not installed from Python, left alone
                swapped[signum] = handler
                signal.signal(signum, lambda received, _frame: noted.append(received))
        yield
    finally:
        interrupts = [_restored(signum, handler) for signum, handler in swapped.items()]
        interrupt = next((raised for raised in interrupts if raised is not None), None)
        if interrupt is not None:
            raise interrupt
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)


def _restored(signum: int, handler: Any) -> BaseException | None:
    """Put `handler` back for `signum`. Python runs a pending signal's handler before it installs another
    and installs nothing if that handler raises (a cancel that arrived just now, to a handler put back a
    moment before), so this tries again until it is installed; the first exception raised meanwhile, or None."""
    interrupt = None
    while True:
        try:
            signal.signal(signum, handler)
            return interrupt
        except BaseException as raised:  # noqa: BLE001 - a cancel, raised by the caller once every handler is back
            interrupt = interrupt or raised


def atomic_write_text(path: str | Path, text: str) -> None:
    """atomic_write of `text` in UTF-8."""
    atomic_write(path, text.encode())
