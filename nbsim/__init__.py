"""nbsim: nanoBragg's X-ray diffraction physics as a compiled, differentiable PyTorch module.

The public names below are imported lazily, so that light users of the package (the workflow's
comparison and collation steps) do not pay for importing torch.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nbsim")
except PackageNotFoundError:
    __version__ = "0.0.0+unknown"

_EXPORTS = {
    "BeamConfig": "config", "CrystalConfig": "config", "DetectorConfig": "config", "SimulationConfig": "config",
    "StructureFactorConfig": "config", "NbsimError": "errors", "Renderer": "simulator", "Setup": "simulator",
    "resolve": "simulator", "simulate": "simulator",
}


def config_from_args(argv: list[str]):
    """A SimulationConfig from nanoBragg-style arguments (e.g. "-cell 100 100 100 90 90 90 ...".split())."""
    from .nanobragg_args import parse

    return parse(list(argv))[0]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'nbsim' has no attribute '{name}'")


__all__ = [*_EXPORTS, "__version__", "config_from_args"]
