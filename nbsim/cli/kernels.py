"""`nbsim kernels build|list`: prebuild ahead-of-time kernels into the cache (NBSIM_CACHE_DIR) and show it."""

from __future__ import annotations

import sys

from ..errors import NbsimError
from .options import CommandParser

COMMON_LOOKUPS = ("default", "nearest", "interpolate")
USAGE = """usage: nbsim kernels build [--dtype T ...] [--device D] [-- <nanoBragg options>]
       nbsim kernels list

build: compile the ahead-of-time kernels of the common structures (a square crystal with default_F,
nearest or interpolated structure factors, one or many steps per pixel), or of the structure of the
nanoBragg options after --, into the kernel cache (NBSIM_CACHE_DIR, default $XDG_CACHE_HOME/nbsim
or ~/.cache/nbsim).
list: the cached kernels, with what each was built for."""


def main(argv: list[str]) -> int:
    """`nbsim kernels build|list` (USAGE says what each does); the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "list":
        return list_command(argv[1:])
    if argv[0] == "build":
        return build_command(argv[1:])
    raise NbsimError(f"unknown kernels command '{argv[0]}' (use build or list)")


def build_command(argv: list[str]) -> int:
    """`nbsim kernels build`: the common structures' kernels, or those of the options after --."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = CommandParser("kernels", takes_flags=True, prog="nbsim kernels build", add_help=False)
    parser.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=("float32", "float64"))
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args(argv[:split])
    from ..cache import configure_compile_cache
    from ..devices import resolve_device, resolve_dtype
    from ..kernel.aot import ensure_packages
    from ..kernel.build import build_line
    from ..kernel.cache import KernelCache

    device = resolve_device(options.device)
    structures = _structures(argv[split + 1:])
    configure_compile_cache()
    cache = KernelCache.default()
    by_dtype = {resolve_dtype(name): list({v: None for s in structures for v in s.stage_variants()})
                for name in options.dtype}
    print(f"{sum(map(len, by_dtype.values()))} kernel(s) for {len(structures)} structure(s) into {cache.kernels}",
          flush=True)
    for dtype, variants in by_dtype.items():
        for variant, built, seconds in ensure_packages(cache, variants, dtype, device):
            print(build_line(variant, dtype, device, built, seconds), flush=True)
    return 0


def _structures(nanobragg_args: list[str]):
    from ..kernel.inputs import KernelOptions
    from ..kernel.stages import Structure

    if nanobragg_args:
        from ..kernel.structure import structure_of
        from ..nanobragg import config_from_args
        from ..resolve import with_advised_sampling

        return [structure_of(with_advised_sampling(config_from_args(nanobragg_args)))]
    return [Structure(KernelOptions(lookup=lookup), single_step) for lookup in COMMON_LOOKUPS
            for single_step in (True, False)]


def list_command(argv: list[str]) -> int:
    """`nbsim kernels list`: the cached kernels, with what each was built for."""
    if argv:
        raise NbsimError(f"kernels list takes no arguments (got {' '.join(argv)})")
    from ..kernel.cache import KernelCache, runs_here

    cache = KernelCache.default()
    descriptions = cache.descriptions()
    print(f"{len(descriptions)} kernel(s) in {cache.kernels}")
    if descriptions:
        print(f"{'stage':<20} {'dtype':<8} {'device':<6} {'build s':>7}  {'built':<24} {'usable':<6} options")
    for d in descriptions:
        options = " ".join(f"{k}={v}" for k, v in sorted(d["options"].items())) or "-"
        usable = "yes" if runs_here(d) else "no"
        print(f"{d['stage']:<20} {d['dtype']:<8} {d['device']:<6} {d.get('build_s', float('nan')):>7.1f}  "
              f"{d.get('built', '?'):<24} {usable:<6} {options}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
