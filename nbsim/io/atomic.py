"""Atomic file writes: the content goes to a temporary file in the destination's folder (inside a temporary
folder there, so that writers which record the file's name see the real one), which is then
renamed over the destination (`os.replace`), so a reader sees the old file or the whole new one, never a
part; when writing fails the temporary file is removed. Used for images, the kernel cache's descriptions
and the sweep's JSON records."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .paths import check_writable, current_umask


def atomic_write(path: str | Path, *parts: bytes | memoryview) -> None:
    """Write the parts, in order, as the whole content of `path` (created with the usual permissions:
    0o666 less the umask)."""

    def write_parts(temporary: Path) -> None:
        with open(temporary, "wb") as stream:
            for part in parts:
                stream.write(part)

    atomic_write_with(path, write_parts)


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Let `write` (a library's writer: fabio, h5py) create the file under its own name in a temporary
    folder beside `path`, then rename it over `path`; on failure the temporary folder is removed."""
    path = Path(path)
    check_writable(path)
    folder = None
    try:
        with _termination_deferred():
            folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        temporary = folder / path.name
        write(temporary)
        os.chmod(temporary, 0o666 & ~current_umask())
        os.replace(temporary, path)
    finally:
        if folder is not None:
            with _termination_deferred():
                shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _termination_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT held back (this thread's signal mask) while the temporary folder is made and
    recorded, or removed: a cancel (the worker's SIGTERM, Ctrl-C) lands before or after, never between the
    folder's creation and its cleanup, which would leave it behind."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def atomic_write_text(path: str | Path, text: str) -> None:
    """atomic_write of `text` in UTF-8."""
    atomic_write(path, text.encode())
