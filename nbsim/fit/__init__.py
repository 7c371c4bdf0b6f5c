"""Refinement against images (docs/fitting.md): `DiffractionModel`, a PyTorch module whose parameters are
the refinable quantities and whose forward renders the selected pixels; `fit`, the whole fit (shoeboxes,
likelihood, L-BFGS, standard errors); `fit_json`, the result as the JSON other tools read; `with_oversample`,
`smooth_oversample` and `observed_oversample`, the pixel sampling of a search and of the image (the stages
of a loop of one's own)."""

from .likelihood import negative_log_likelihood
from .model import DiffractionModel, observed_oversample, smooth_oversample, with_oversample
from .output import fit_json, refined_flags, residual_picture
from .refine import FitImage, FitOptions, FitResult, fit

__all__ = ["DiffractionModel", "FitImage", "FitOptions", "FitResult", "fit", "fit_json", "negative_log_likelihood",
           "observed_oversample", "refined_flags", "residual_picture", "smooth_oversample", "with_oversample"]
