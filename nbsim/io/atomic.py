"""Atomic file writes: the content goes to a temporary file in the destination's folder, which is then
renamed over the destination (`os.replace`), so a reader sees the old file or the whole new one, never a
part; when writing fails the temporary file is removed. Used for images, the kernel cache's descriptions
and the sweep's JSON records."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .paths import check_writable, current_umask


def atomic_write(path: str | Path, *parts: bytes | memoryview) -> None:
    """Write the parts, in order, as the whole content of `path` (created with the usual permissions:
    0o666 less the umask)."""
    path = Path(path)
    check_writable(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            for part in parts:
                stream.write(part)
        os.chmod(temporary, 0o666 & ~current_umask())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """atomic_write of `text` in UTF-8."""
    atomic_write(path, text.encode())
