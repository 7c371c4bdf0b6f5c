"""The persistent compile cache: where Inductor keeps compiled kernels between processes."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """NBSIM_CACHE_DIR, else the user's cache folder (XDG_CACHE_HOME or ~/.cache) / nbsim."""
    explicit = os.environ.get("NBSIM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nbsim"


def configure_compile_cache() -> Path:
    """Point Inductor's caches at nbsim's folder (unless the user chose one) and return it."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
