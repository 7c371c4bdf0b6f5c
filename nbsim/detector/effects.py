"""The detector's deterministic effects as pure tensor functions: point-spread kernels integrated over each
pixel and their convolution, the beam stop's shadow.

Point-spread functions as simtbx has them (Holton, J. Synchrotron Rad. 19, 1006 (2012)): a Gaussian of
the given FWHM, and the fiber-optic taper's g/(2π)·(g² + r²)^(-3/2) with g = 0.652383·FWHM. Both are
integrated analytically over each pixel. Photons spread beyond the detector's edge are lost.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FIBER_G_PER_FWHM = 0.652383013252053
GAUSSIAN_RADIUS_FWHM = 4.0
"""The Gaussian kernel reaches 4 FWHM from its centre: what lies beyond is below 1e-19 of the total."""


def gaussian_pixel_weights(fwhm_px: float, radius_px: int, dtype: torch.dtype = torch.float64,
                           device: torch.device | str = "cpu") -> torch.Tensor:
    """A unit Gaussian of FWHM `fwhm_px` integrated over pixels at offsets -radius..radius, in one
    dimension (the 2-D kernel is the outer product: the Gaussian is separable)."""
    offsets = torch.arange(-radius_px, radius_px + 1, dtype=dtype, device=device)
    scale = math.sqrt(math.log(16.0)) / fwhm_px
    return 0.5 * (torch.erf((offsets + 0.5) * scale) - torch.erf((offsets - 0.5) * scale))


def fiber_cumulative(x: torch.Tensor, y: torch.Tensor, g: float) -> torch.Tensor:
    """The fiber PSF integrated over [0, x] × [0, y]."""
    return torch.atan(x * y / (g * torch.sqrt(g * g + x * x + y * y))) / (2.0 * math.pi)


def fiber_pixel_weights(g_px: float, slow_offsets: torch.Tensor, fast_offsets: torch.Tensor) -> torch.Tensor:
    """The fiber PSF integrated over each pixel at the given offsets (slow × fast grid)."""
    y, x = torch.meshgrid(slow_offsets, fast_offsets, indexing="ij")
    return (fiber_cumulative(x + 0.5, y + 0.5, g_px) - fiber_cumulative(x + 0.5, y - 0.5, g_px)
            - fiber_cumulative(x - 0.5, y + 0.5, g_px) + fiber_cumulative(x - 0.5, y - 0.5, g_px))


def gaussian_blur(image: torch.Tensor, fwhm_px: float) -> torch.Tensor:
    """`image` (slow, fast) convolved with the pixel-integrated Gaussian (two 1-D passes)."""
    radius = min(math.ceil(GAUSSIAN_RADIUS_FWHM * fwhm_px) + 1, max(image.shape))
    weights = gaussian_pixel_weights(fwhm_px, radius, image.dtype, image.device)
    blurred = F.conv2d(image[None, None], weights.view(1, 1, 1, -1), padding=(0, radius))
    return F.conv2d(blurred, weights.view(1, 1, -1, 1), padding=(radius, 0))[0, 0]


def fiber_blur(image: torch.Tensor, fwhm_px: float) -> torch.Tensor:
    """`image` (slow, fast) convolved with the pixel-integrated fiber PSF over every offset the detector
    holds (its tail is long), by FFT on a grid twice the image's size (no wrap-around)."""
    slow, fast = image.shape
    grid = (2 * slow, 2 * fast)
    slow_offsets = torch.fft.fftfreq(grid[0], 1.0 / grid[0], dtype=image.dtype, device=image.device)
    fast_offsets = torch.fft.fftfreq(grid[1], 1.0 / grid[1], dtype=image.dtype, device=image.device)
    kernel = fiber_pixel_weights(FIBER_G_PER_FWHM * fwhm_px, slow_offsets, fast_offsets)
    product = torch.fft.rfft2(image, s=grid) * torch.fft.rfft2(kernel)
    return torch.fft.irfft2(product, s=grid)[:slow, :fast]


def beamstop_shadow(shape: tuple[int, int], pixel_size_mm: float, beam_center_px: tuple[float, float],
                    radius_mm: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """True for the pixels whose centre lies within `radius_mm` of the direct beam (fast, slow pixels from
    the corner of the first pixel)."""
    slow = (torch.arange(shape[0], dtype=torch.float64, device=device) + 0.5 - beam_center_px[1]) * pixel_size_mm
    fast = (torch.arange(shape[1], dtype=torch.float64, device=device) + 0.5 - beam_center_px[0]) * pixel_size_mm
    return slow[:, None] ** 2 + fast[None, :] ** 2 < radius_mm ** 2
