"""Checks on the files a run reads and writes, made before any work (no numpy, no torch: the command
line's fast answers use them), and the process's file-creation mask."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import InputFileError, NbsimError


def require_file(path: str | Path) -> None:
    """A one-line error, before any work, when an input file is missing, a folder or unreadable."""
    target = Path(path)
    if not target.exists():
        raise InputFileError(str(path), "no such file")
    if target.is_dir():
        raise InputFileError(str(path), "is a directory, not a file")
    if not os.access(target, os.R_OK):
        raise InputFileError(str(path), "cannot be read (permission denied)")


def check_writable(path: str | Path) -> None:
    """A one-line error, before any work, when `path` cannot be written: its folder (for a symbolic link, its
    target's) is missing, or it is a folder or a socket. A FIFO or device is written into (io/atomic.py)."""
    path = Path(path)
    folder = write_destination(path).parent
    if not is_stream(path) and not folder.is_dir():
        raise NbsimError(f"cannot write {path}: folder {folder} does not exist")
    if path.is_dir():
        raise NbsimError(f"cannot write {path}: it is a folder")
    if path.is_socket():
        raise NbsimError(f"cannot write {path}: it is a socket")


def write_destination(path: str | Path) -> Path:
    """The file a write to `path` lands in: `path` itself, or the file its symbolic links lead to (written
    there, so the links are kept). A link that leads round in a loop is a one-line error."""
    path = Path(path)
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if target.is_symlink():
        raise NbsimError(f"cannot write {path}: its symbolic links lead round in a loop")
    return target


def is_stream(path: str | Path) -> bool:
    """Whether `path` (links followed) is a FIFO or a character or block device: something a write goes
    into as a stream of bytes, never a file to be renamed over."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def current_umask() -> int:
    """This process's file-creation mask (read without changing it for long)."""
    current = os.umask(0)
    os.umask(current)
    return current


@contextlib.contextmanager
def removed_on_failure(paths: Iterable[str | Path]) -> Iterator[None]:
    """Remove the files among `paths` that the block wrote (created or replaced) when it fails, so that a run
    ending in an error leaves none of its outputs beside the ones it could not write: each file is whole, but
    the set would read as a finished run. Streams (/dev/null, FIFOs) are left alone."""
    files = [Path(path) for path in paths if not is_stream(path)]
    before = {path: _identity(path) for path in files}
    try:
        yield
    except BaseException:
        for path in files:
            if _identity(path) not in (before[path], None):
                path.unlink(missing_ok=True)
        raise


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells a file replaced or rewritten from the one that was there: device, inode and modification
    time (None: no file)."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_mtime_ns
