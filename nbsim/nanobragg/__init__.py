"""nanoBragg's command line as data: its flags (`flags`), its substring matching (`rules`) and the typed
configuration they describe (`arguments.parse`). The one place argv becomes a `SimulationConfig`: the CLI,
the sweep's planning and validation, and `nbsim.config_from_args` all call it; torch-free."""

from __future__ import annotations

from ..config import SimulationConfig
from .arguments import RunOptions, parse


def config_from_args(argv: list[str]) -> SimulationConfig:
    """A SimulationConfig from nanoBragg-style arguments (e.g. "-cell 100 100 100 90 90 90 ...".split())."""
    return parse(list(argv))[0]


__all__ = ["RunOptions", "config_from_args", "parse"]
