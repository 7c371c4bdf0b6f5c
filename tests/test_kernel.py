"""Kernel properties: float32 accuracy, device/dtype neutrality, one graph without breaks."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import nbsim
from nbsim.kernel.inputs import kernel_inputs
from nbsim.kernel.physics import pixel_kernel, sin_pi_polynomial, sincg_parts
from nbsim.render import Renderer
from nbsim.resolve import resolve
from nbsim.rng import Ran1

from .conftest import SEED_ARGS

SEED = f"{SEED_ARGS} -detpixels 64".split()


def test_lattice_factor_is_accurate_in_float32_near_large_indices():
    """sin(Nπh)/sin(πh) taken from h − round(h): float32 keeps its digits where the naive form loses them."""
    h64 = torch.tensor([57.0001, 113.00003, -200.0002, 89.5, 12.25], dtype=torch.float64)
    n = 10.0
    exact = torch.sin(n * math.pi * h64) / torch.sin(math.pi * h64)
    h32 = h64.to(torch.float32)
    fraction = h32 - torch.ceil(h32 - 0.5)
    ours = torch.div(*sincg_parts(fraction, torch.tensor(n)))
    naive = torch.sin(n * math.pi * h32) / torch.sin(math.pi * h32)
    # Both see the same float32 rounding of h; only the formula differs.
    reference = torch.sin(n * math.pi * h32.double()) / torch.sin(math.pi * h32.double())
    assert torch.allclose(ours.double().abs(), reference.abs(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(naive.double().abs(), reference.abs(), rtol=1e-2, atol=1e-4)
    assert torch.allclose(reference.abs(), exact.abs(), rtol=0.2, atol=1e-4)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 3e-5), (torch.float64, 1e-10)])
def test_lattice_factor_differentiates_smoothly_through_its_peak(dtype, tolerance):
    """d/dδ of sin(Nπδ)/sin(πδ) next to the node (a sample on a lattice plane, δ ~ rounding) is its Taylor
    series' (the quotient's where Nδ ≥ 1e-3), and the value is the quotient to the dtype's rounding: the
    quotient's own derivative there is two terms of order N/δ that cancel into rounding (1e15 at δ = 1e-17)."""
    for n in (5.0, 7.3, 10.0):
        fraction = torch.tensor([1e-17, 1e-12, 1e-9, 1e-6, 1e-4, 3e-3, 1e-2], dtype=dtype, requires_grad=True)
        ratio = torch.div(*sincg_parts(fraction, torch.tensor(n, dtype=dtype)))
        derivative = torch.autograd.grad(ratio.sum(), fraction)[0].double()
        delta = fraction.detach().double()
        exact = torch.sin(n * math.pi * delta) / torch.sin(math.pi * delta)
        slope = (n * math.pi * torch.cos(n * math.pi * delta) - math.pi * torch.cos(math.pi * delta) * exact) \
            / torch.sin(math.pi * delta)
        angle = math.pi * delta
        series = n * math.pi * (n * n - 1.0) * (-angle / 3.0 + (3.0 * n * n - 7.0) * angle ** 3 / 90.0)
        expected = torch.where(n * delta < 1e-3, series, slope)
        torch.testing.assert_close(ratio.detach().double(), exact, rtol=2 * torch.finfo(dtype).eps, atol=0.0)
        torch.testing.assert_close(derivative, expected, rtol=tolerance, atol=0.0)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 3e-7), (torch.float64, 1e-15)])
def test_compiled_sine_polynomial_is_accurate(dtype, tolerance):
    x = torch.linspace(-0.5, 0.5, 10001, dtype=torch.float64)
    exact = torch.sin(math.pi * x)
    assert torch.allclose(sin_pi_polynomial(x.to(dtype)).double(), exact, rtol=0, atol=tolerance)


def test_float32_and_float64_agree():
    setup = resolve(nbsim.config_from_args(SEED))
    image32 = Renderer(setup, dtype=torch.float32, compile=False)()
    image64 = Renderer(setup, dtype=torch.float64, compile=False)()
    assert image32.dtype == torch.float32 and image64.dtype == torch.float64
    np.testing.assert_allclose(image32.double().numpy(), image64.numpy(), rtol=1e-3, atol=1e-3 * float(image64.max()))


def test_kernel_traces_as_one_graph():
    """No .item()/.cpu()/Python branching on tensor values in the hot path: Dynamo sees one graph."""
    setup = resolve(nbsim.config_from_args(SEED + ["-mosaic", "0.3", "-mosaic_dom", "3", "-round_xtal"]))
    inputs = kernel_inputs(setup, "cpu", torch.float32)
    kernel = functools.partial(pixel_kernel, options=inputs.options)
    rows, cols = torch.arange(4.0), torch.arange(64.0)
    explanation = torch._dynamo.explain(kernel)(rows, cols, inputs.tensors)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_tiles_do_not_change_the_image():
    setup = resolve(nbsim.config_from_args(SEED + ["-oversample", "2"]))
    whole = Renderer(setup, dtype=torch.float64, compile=False)()
    tiled = Renderer(setup, dtype=torch.float64, compile=False, tile_elements=64 * 3)()
    assert torch.equal(whole, tiled)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_matches_cpu(compile):
    setup = resolve(nbsim.config_from_args(SEED))
    cpu = Renderer(setup, dtype=torch.float32, compile=False)()
    gpu = Renderer(setup, device="cuda", dtype=torch.float32, compile=compile)()
    assert gpu.device.type == "cuda"
    np.testing.assert_allclose(gpu.cpu().numpy(), cpu.numpy(), rtol=1e-4, atol=1e-4 * float(cpu.max()))


def test_ran1_first_deviate_and_shared_state():
    """ran1(-1) starts with Numerical Recipes' 0.41599935; a positive seed continues the same table."""
    generator = Ran1()
    first, seed = generator.draw(-1)
    assert first == pytest.approx(0.41599935, abs=1e-7)
    second, _ = generator.draw(seed)
    restarted, _ = Ran1().draw(-1)
    assert restarted == first and second != first


def test_mosaic_domains_are_seeded_and_domain_zero_is_identity():
    config = nbsim.config_from_args(SEED + ["-mosaic", "0.5", "-mosaic_dom", "4", "-mosaic_seed", "9"])
    first, again = resolve(config).mosaic, resolve(config).mosaic
    assert np.array_equal(first.axes, again.axes)
    matrices = first.matrices()
    assert torch.equal(matrices[0], torch.eye(3, dtype=torch.float64))
    assert not torch.allclose(matrices[1], torch.eye(3, dtype=torch.float64))
    other = resolve(nbsim.config_from_args(SEED + ["-mosaic", "0.5", "-mosaic_dom", "4", "-mosaic_seed", "10"]))
    assert not np.array_equal(first.axes, other.mosaic.axes)


def test_interpolation_switch_within_a_narrow_region(tmp_path):
    """Where nanoBragg stops interpolating (a step leaves the HKL grid), a region of interest narrower
    than the detector renders what masking the same columns renders: both skip those pixels, so the
    switch comes at the same pixel, and the pixels interpolated before it land in a strided view."""
    from nbsim.io.images import write_smv

    hkl = tmp_path / "small.hkl"
    hkl.write_text("".join(f"{h} {k} {l} {10 + abs(h) + 2 * abs(k) + 3 * abs(l)}\n"
                           for h in range(-6, 7) for k in range(-6, 7) for l in range(-6, 7)))
    args = (f"-hkl {hkl} -cell 30 30 30 90 90 90 -N 3 -lambda 1 -distance 150 -detpixels_x 16 -detpixels_y 64 "
            "-pixel 0.5 -interpolate -Xbeam 1 -Ybeam 1").split()
    mask = np.zeros((64, 16), dtype=np.uint16)
    mask[:, 2:14] = 1
    write_smv(tmp_path / "mask.img", mask, [])
    by_roi = Renderer(resolve(nbsim.config_from_args([*args, "-roi", "2", "13", "0", "63"])), dtype=torch.float64,
                      compile=False)
    by_mask = Renderer(resolve(nbsim.config_from_args([*args, "-mask", str(tmp_path / "mask.img")])),
                       dtype=torch.float64, compile=False)
    interpolated = by_roi._interpolation_switch()[0][0][1]
    assert interpolated >= 2 * 12, "the switch must come after two or more rows for this test to mean anything"
    np.testing.assert_array_equal(by_roi().numpy(), by_mask().numpy())


def test_interpolation_switch_at_the_first_step_looks_up_nearest_from_there_on(tmp_path):
    """When the run's very first step (pixel (0, 0), first sub-pixel) leaves the HKL grid, nanoBragg turns
    interpolation off there, and its F_cell = default_F is overwritten by the nearest-node lookup that
    follows: that step, the rest of the pixel and the whole image are the -nointerpolate ones (bit for
    bit in nanoBragg). Here that step's nearest node (3, 4, -5) is inside the grid and the pixel has
    2×2 sub-pixels, so neither default_F nor more interpolation would pass."""
    hkl = tmp_path / "small.hkl"
    hkl.write_text("".join(f"{h} {k} {l} {10 + abs(h) + 2 * abs(k) + 3 * abs(l)}\n"
                           for h in range(-6, 7) for k in range(-6, 7) for l in range(-6, 7)))
    args = (f"-hkl {hkl} -cell 30 30 30 90 90 90 -misset 10 20 30 -N 2 -lambda 1 -distance 50 -detpixels 32 "
            "-pixel 0.5").split()
    for threads in (1, 2):
        auto = Renderer(resolve(nbsim.config_from_args(args)), dtype=torch.float64, compile=False,
                        reference_threads=threads)
        nearest = Renderer(resolve(nbsim.config_from_args([*args, "-nointerpolate"])), dtype=torch.float64,
                           compile=False, reference_threads=threads)
        assert auto.inputs.options.lookup == "interpolate" and auto.setup.oversample == 2
        assert auto._interpolation_switch()[1] == (0, 0)
        np.testing.assert_allclose(auto().numpy(), nearest().numpy(), rtol=1e-12, atol=0)


def test_interpolation_ignores_the_table_beyond_steps_cut_by_dmin(tmp_path):
    """Steps cut by -dmin are computed with the rest and may reach far outside the HKL table (before,
    an IndexError in eager and reads past the table compiled). Their neighbourhoods are clamped into
    the table, so the image is the same as with a table that extends there, whatever it holds."""

    def amplitude(h: int, k: int, l: int) -> int:
        return 10 + abs(h) + 2 * abs(k) + 3 * abs(l) if max(abs(h), abs(k), abs(l)) <= 6 else 999

    def image(extent: int, path) -> np.ndarray:
        indices = range(-extent, extent + 1)
        path.write_text("".join(f"{h} {k} {l} {amplitude(h, k, l)}\n"
                                for h in indices for k in indices for l in indices))
        args = (f"-hkl {path} -cell 30 30 30 90 90 90 -misset 0 0 90 -N 5 -interpolate -dmin 8 -lambda 1 "
                "-distance 20 -detpixels 24 -pixel 2").split()
        renderer = Renderer(resolve(nbsim.config_from_args(args)), dtype=torch.float64, compile=False)
        assert renderer._interpolation_switch() is None
        return renderer().numpy()

    small, large = image(6, tmp_path / "small.hkl"), image(22, tmp_path / "large.hkl")
    assert np.isfinite(small).all() and small.max() > 0
    np.testing.assert_array_equal(small, large)


def test_renderer_refuses_an_output_buffer_of_the_wrong_kind():
    from nbsim.errors import NbsimError

    renderer = Renderer(resolve(nbsim.config_from_args(SEED)), dtype=torch.float32, compile=False)
    for wrong in (torch.empty(64, 63), torch.empty(64, 64, dtype=torch.float64)):
        with pytest.raises(NbsimError, match="out must be a 64x64 torch.float32 tensor on cpu"):
            renderer(out=wrong)
    buffer = torch.empty(64, 64)
    assert renderer(out=buffer) is buffer
