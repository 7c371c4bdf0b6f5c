"""Changes to how Inductor compiles an ahead-of-time stage that Inductor has no option for, made by
patching its private internals while one stage builds: several SIMD vectors per loop iteration, loops
kept tile-shaped, fused multiply-adds, and vectorised loop tails.

Each patch is version-gated: it checks that the private attribute it replaces (or the option it sets)
exists in the installed PyTorch; if not, the stage builds without it (slower, same image) and the
missing patch is logged once (logger `nbsim.kernel.inductor_patches`). Every patch turns Inductor's own
graph cache off while it is active: that cache's key does not see the patch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import unittest.mock
from collections.abc import Iterator

import torch

LOG = logging.getLogger(__name__)

# Every ahead-of-time build lets the C++ compiler contract a multiply and an add into one fused
# multiply-add (Inductor's default forbids it): the fused kernels are chains of Horner steps and dot
# products, and with several vectors per loop iteration their time is the count of instructions
# (seed float64 21 % and float32 10 % faster, measured side by side; docs/benchmarks.md). The C
# reference, built with -O3 -march=native, contracts them too.
CONTRACTED = (("cpp.enable_floating_point_contract_flag", "fast"),)


@functools.cache
def _available(patch: str) -> bool:
    """Whether the installed PyTorch has what `patch` changes; logged once when it has not."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa
    from torch._inductor.sizevars import SizeVarAllocator

    present = {
        "vectors_per_iteration": hasattr(cpu_vec_isa, "pick_vec_isa")
        and callable(getattr(getattr(cpu_vec_isa, "VecISA", None), "nelements", None)),
        "tile_shaped_loops": callable(getattr(SizeVarAllocator, "_simplify_loops_impl", None)),
        "contracted": hasattr(getattr(inductor_config, "cpp", None), "enable_floating_point_contract_flag"),
    }[patch]
    if not present:
        LOG.warning("PyTorch %s lacks the Inductor internals of nbsim's %s patch: kernels build without it "
                    "(same images, slower)", torch.__version__, patch)
    return present


def contracted_options() -> tuple[tuple[str, object], ...]:
    """The Inductor options that allow fused multiply-adds (none where this PyTorch has no such option)."""
    return CONTRACTED if _available("contracted") else ()


def thread_options() -> tuple[tuple[str, object], ...]:
    """The Inductor option that keeps a package's loops parallel whatever the building process's thread count:
    a kernel built where torch ran one thread (a sweep job of one thread, a test worker) was otherwise serial
    code, and every process that loaded it later ran on one core."""
    from torch._inductor import config as inductor_config

    return (("cpp.dynamic_threads", True),) if hasattr(inductor_config.cpp, "dynamic_threads") else ()


@contextlib.contextmanager
def vectors_per_iteration(vectors: int, dtype: torch.dtype) -> Iterator[None]:
    """Inductor's CPU loops step over `vectors` SIMD vectors of `dtype` per iteration instead of one.

    A fused stage computes one long chain of dependent operations per pixel. With one vector per loop
    iteration an out-of-order core finds too little independent work in its window and waits on
    latencies; with several, Inductor emits each operation for all of them side by side (its
    VectorizedN), which fills those waits. Inductor's loops step by the vector ISA's float lane count,
    so that count is scaled while the stage compiles. No vector ISA, no change.
    """
    if vectors <= 1 or not _available("vectors_per_iteration"):
        yield
        return
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        yield
        return
    lanes = isa.bit_width() // (8 * dtype.itemsize)
    scale = max(1, vectors * lanes // isa.nelements(torch.float))
    unscaled = cpu_vec_isa.VecISA.nelements

    def scaled(self, dtype: torch.dtype = torch.float) -> int:
        return unscaled(self, dtype) * scale

    with unittest.mock.patch.object(cpu_vec_isa.VecISA, "nelements", scaled), \
            inductor_config.patch(fx_graph_cache=False):
        yield


@contextlib.contextmanager
def tile_shaped_loops(enabled: bool) -> Iterator[None]:
    """While enabled, Inductor keeps each loop's dimensions (dropping only those of size 1) instead of
    merging contiguous ones.

    A materialised value computed only from other per-pixel values would otherwise loop over
    rows × columns as one dimension, and Inductor's CPU backend cannot fuse such a loop into the
    two-dimensional ones around it once it has joined another: the kernel then writes those values to
    memory and reads them back in separate loops. So Inductor's loop simplification is replaced while
    the stage compiles.
    """
    if not enabled or not _available("tile_shaped_loops"):
        yield
        return
    import sympy
    from torch._inductor import config as inductor_config
    from torch._inductor.sizevars import SizeVarAllocator

    def unmerged(self, index_vars, sizes, index_formulas):
        sizes = [self.simplify(size) for size in sizes]
        kept = [size != 1 for size in sizes]

        def reindex(index):
            remaining = iter(index)
            return [next(remaining) if keep else sympy.S.Zero for keep in kept]

        def prune(index):
            return [var for var, keep in zip(index, kept, strict=True) if keep]

        return [size for size, keep in zip(sizes, kept, strict=True) if keep], reindex, prune

    with unittest.mock.patch.object(SizeVarAllocator, "_simplify_loops_impl", unmerged), \
            inductor_config.patch(fx_graph_cache=False):
        yield


@contextlib.contextmanager
def masked_tails() -> Iterator[None]:
    """Inductor computes the tail of every CPU loop (the columns past its last whole vectors) with the
    vector code under a mask, as PyTorch 2.11 does for every loop, so that a pixel's value does not depend
    on where its column falls in a tile.

    PyTorch 2.8's Inductor masks a tail only where all of the loop's dtypes are in its
    MASKED_VECTORIZABLE_DTYPES, which lacks bool (every kernel's masks) and float64; the other tails run
    as scalar C++, which the compiler contracts into fused multiply-adds differently: a region of interest
    38 columns wide then differed from the whole image by up to 3e-5 of a float32 pixel next to a lattice
    node. Where that list is absent (2.11.0, 2.13.0), every tail is masked already and nothing is patched.
    """
    from torch._inductor.codegen import cpp

    if not hasattr(cpp, "MASKED_VECTORIZABLE_DTYPES") or not hasattr(cpp, "VECTORIZABLE_DTYPES"):
        yield
        return
    from torch._inductor import config as inductor_config

    with unittest.mock.patch.object(cpp, "MASKED_VECTORIZABLE_DTYPES", list(cpp.VECTORIZABLE_DTYPES)), \
            inductor_config.patch(fx_graph_cache=False):
        yield
