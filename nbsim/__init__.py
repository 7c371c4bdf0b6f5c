"""nbsim: nanoBragg's X-ray diffraction physics as a compiled, differentiable PyTorch module."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nbsim")
except PackageNotFoundError:
    __version__ = "0.0.0+unknown"

from .config import BeamConfig, CrystalConfig, DetectorConfig, SimulationConfig, StructureFactorConfig
from .errors import NbsimError
from .nanobragg_args import parse as parse_nanobragg_args
from .simulator import Renderer, Setup, resolve, simulate


def config_from_args(argv: list[str]) -> SimulationConfig:
    """A SimulationConfig from nanoBragg-style arguments (e.g. "-cell 100 100 100 90 90 90 ...".split())."""
    return parse_nanobragg_args(list(argv))[0]


__all__ = ["BeamConfig", "CrystalConfig", "DetectorConfig", "NbsimError", "Renderer", "Setup", "SimulationConfig",
           "StructureFactorConfig", "__version__", "config_from_args", "resolve", "simulate"]
