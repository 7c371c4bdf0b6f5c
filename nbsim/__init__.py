"""nbsim: nanoBragg's X-ray diffraction physics as a compiled, differentiable PyTorch module.

The public names below (and __version__) are loaded lazily, so that light users of the package (the
`nbsim` client of a worker, the workflow's comparison and collation steps) do not pay for importing
torch.
"""

from functools import cache
from importlib import import_module

_EXPORTS = {
    "BeamConfig": "config", "CrystalConfig": "config", "DetectorConfig": "config", "SimulationConfig": "config",
    "StructureFactorConfig": "config", "NbsimError": "errors", "Renderer": "render", "Setup": "resolve",
    "p1_reflections": "resolve", "simulate": "render", "config_from_args": "nanobragg",
}
"""`resolve` is not among them: `nbsim.resolve` is the module (`from nbsim.resolve import resolve`)."""


@cache
def _version() -> str:
    """The installed package's version (read on first use: importlib.metadata costs the light
    `nbsim` client tens of milliseconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nbsim")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        return _version()
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'nbsim' has no attribute '{name}'")


__all__ = [*_EXPORTS, "__version__"]
