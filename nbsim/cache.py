"""nbsim's cache folder (compiled kernels, Inductor's intermediate files, the worker's files), and how a
process's entry point points Inductor's own cache into it."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """NBSIM_CACHE_DIR, else the user's cache folder (XDG_CACHE_HOME or ~/.cache) / nbsim."""
    explicit = os.environ.get("NBSIM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nbsim"


def configure_compile_cache(folder: Path | None = None) -> Path:
    """Point Inductor's caches at `folder` (default: cache_dir()) / inductor unless the user chose one, and
    return the folder Inductor uses.

    For a process's entry point only (nbsim's commands, the kernel builder, the sweep's jobs): Inductor
    reads TORCHINDUCTOR_CACHE_DIR from the environment, so this sets it, and a library function must not
    (see nbsim.kernel.aot)."""
    folder = cache_dir() if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


@functools.cache
def sources_digest() -> str:
    """SHA-256 of nbsim's Python sources, names and contents, found without importing torch: what the
    worker and the sweep's memo of kernel structures are valid for."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def torch_version_file() -> Path | None:
    """The installed PyTorch's `torch/version.py`, found without importing torch (None: no PyTorch)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).with_name("version.py") if spec is not None and spec.origin else None
