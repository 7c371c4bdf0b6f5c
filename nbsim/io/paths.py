"""Checks on the files a run reads and writes, made before any work (no numpy, no torch: the command
line's fast answers use them), and the process's file-creation mask."""

from __future__ import annotations

import os
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
    """A one-line error, before any work, when `path` cannot be written: its folder is missing or it is a
    folder itself."""
    path = Path(path)
    if not path.parent.is_dir():
        raise NbsimError(f"cannot write {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise NbsimError(f"cannot write {path}: it is a folder")


def current_umask() -> int:
    """This process's file-creation mask (read without changing it for long)."""
    current = os.umask(0)
    os.umask(current)
    return current
