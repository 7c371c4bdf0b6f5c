"""The detector's compiled code: nanoBragg's serial noise generator (`nanobragg_noise.c`) and Philox for
the CPU (`philox.c`), built once with the system C compiler into nbsim's cache folder and loaded with ctypes.

The library's name carries a hash of the source, the compiler (its path and version) and the flags, and of
the processor (the flags ask for its instruction set), so a changed source or compiler builds anew and a
cache shared between machines never loads another processor's build. The build writes a temporary file
that is renamed into place (io/atomic.py), so processes building at once are safe.

The flags are those nanoBragg is built with (gcc -O3 -march=native): the C's float expressions round
alike only where the compiler contracts the same multiply-adds into FMAs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from ..cache import cache_dir
from ..cpu import cpu_flags, cpu_name
from ..errors import NbsimError
from ..io.atomic import atomic_write_with

SOURCES = tuple(Path(__file__).with_name(name) for name in ("nanobragg_noise.c", "philox.c"))
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
TABLE_LENGTH = 33
"""ran1's state: iy, then its 32 shuffle-table entries."""


def find_compiler() -> str:
    """$CC, else cc, gcc or clang on the PATH; NbsimError when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        found = shutil.which(name) if name else None
        if found:
            return found
    raise NbsimError("nanoBragg's noise generator needs a C compiler (set CC, or install cc, gcc or clang) to "
                     "be built once; or choose -noise_generator philox")


def library_path(compiler: str) -> Path:
    """Where the build for this source, compiler, flags and processor lives in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    parts = (*(source.read_bytes() for source in SOURCES), compiler.encode(), version.encode(),
             " ".join(FLAGS).encode(), platform.machine().encode(), cpu_name().encode(), cpu_flags().encode())
    for part in parts:
        digest.update(part + b"\0")
    return cache_dir().expanduser() / "native" / f"detector-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def compile_to(temporary: Path) -> None:
        result = subprocess.run([compiler, *FLAGS, "-o", str(temporary), *map(str, SOURCES), "-lm"],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            first = next((line for line in result.stderr.splitlines() if line.strip()), "no message")
            raise NbsimError(f"building the detector's compiled code with {compiler} failed: {first}")

    atomic_write_with(path, compile_to)


def load() -> None:
    """Build (once) and load the compiled code now: NbsimError, before any work, without a C compiler."""
    _library()


@functools.cache
def _library() -> ctypes.CDLL:
    compiler = find_compiler()
    path = library_path(compiler)
    if not path.exists():
        _build(compiler, path)
    library = ctypes.CDLL(str(path))
    function = library.nanobragg_noise
    function.argtypes = [np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS"),
                         np.ctypeslib.ndpointer(np.float64, flags="C_CONTIGUOUS"), *([ctypes.c_long] * 7),
                         np.ctypeslib.ndpointer(np.int64, flags="C"), ctypes.POINTER(ctypes.c_double)]
    function.restype = ctypes.c_double
    library.philox_words.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_void_p]
    library.philox_words.restype = None
    return library


@functools.cache
def compiled_philox_available() -> bool:
    """Whether the compiled Philox can be used (else philox.py computes the same words with torch)."""
    try:
        _library()
    except NbsimError:
        return False
    return True


def philox_words(seed: int, stream: int, draw: int, index: torch.Tensor) -> torch.Tensor:
    """philox.c's `philox_words` of a CPU int64 index tensor: int64 tensor of 32-bit words."""
    index = index.contiguous()
    out = torch.empty_like(index)
    _library().philox_words(seed & (2 ** 64 - 1), stream & 0xFFFFFFFF, draw & 0xFFFFFFFF, index.data_ptr(),
                            index.numel(), out.data_ptr())
    return out


def nanobragg_poisson(image: np.ndarray, roi: tuple[int, int, int, int], seed: int,
                      table: np.ndarray | None = None) -> tuple[np.ndarray, float, float]:
    """nanoBragg's noise loop over a float32 (slow, fast) image: the Poisson counts (float64, 0 outside the
    ROI), their sum and their maximum, as the C draws them with `poidev(floatimage[i], &seed)`.

    `seed` is the C's variable (minus the -seed value). `table` is ran1's state left by earlier draws in
    the same process (a positive seed continues it, as in the C); None: a fresh process.
    """
    image = np.ascontiguousarray(image, dtype=np.float32)
    photons = np.zeros(image.shape, dtype=np.float64)
    state = np.zeros(TABLE_LENGTH, dtype=np.int64) if table is None else np.array(table, dtype=np.int64)
    spixels, fpixels = image.shape
    xmin, xmax, ymin, ymax = roi
    maximum = ctypes.c_double()
    total = _library().nanobragg_noise(image, photons, fpixels, spixels, xmin, xmax, ymin, ymax, seed, state,
                                       ctypes.byref(maximum))
    return photons, float(total), maximum.value
