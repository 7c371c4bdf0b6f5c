"""Refinement against images (docs/fitting.md): `DiffractionModel`, a PyTorch module whose parameters are
the refinable quantities and whose forward renders the selected pixels; `fit`, the whole fit (shoeboxes,
likelihood, L-BFGS, standard errors); `fit_json`, the result as the JSON other tools read; `with_oversample`,
`smooth_oversample` and `observed_oversample`, the pixel sampling of a search and of the image (the stages
of a loop of one's own).

The names below are loaded lazily, so that `nbsim.fit.names` (what `nbsim fit` and `nbsim merge` check
their `--refine` against) is read without PyTorch.
"""

from importlib import import_module

_EXPORTS = {
    "negative_log_likelihood": "likelihood", "DiffractionModel": "model", "observed_oversample": "model",
    "smooth_oversample": "model", "with_oversample": "model", "fit_json": "output", "refined_flags": "output",
    "residual_picture": "output", "FitImage": "refine", "FitOptions": "refine", "FitResult": "refine", "fit": "refine",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'nbsim.fit' has no attribute '{name}'")


__all__ = list(_EXPORTS)
