"""-physics corrected (nanoBragg's known defects fixed), the amorphous background from a scattering curve, and
anomalous scattering per channel (docs/physics.md). Expected values come from independent hand computations:
simtbx's background formula evaluated here from the geometry, and a direct summation of the model's
structure factors with complex scattering factors written here from gemmi's IT92 coefficients."""

from __future__ import annotations

import math
import subprocess
import sys

import gemmi
import numpy as np
import pytest
import torch

from nbsim.model.background import AIR_CURVE, AVOGADRO, R_E_SQR_M2, WATER_CURVE
from nbsim.nanobragg import parse
from nbsim.render import Renderer
from nbsim.resolve import resolve

from .conftest import one_line_error_here

CRYSTAL = "-cell 50 60 70 90 90 90 -default_F 10 -N 3 -lambda 1 -distance 100 -detpixels 48 -pixel 0.1".split()
MODEL_CRYSTAL = "-N 3 -distance 100 -detpixels 48 -pixel 0.1".split()
QUIET = ["-nonoise", "-nopgm", "-floatfile", "unused.bin"]

MODEL = """\
CRYST1   30.000   35.000   40.000  90.00  95.00  90.00 P 1 21 1
ATOM      1  N   ALA A   1       1.000   2.000   3.000  1.00 15.00           N
ATOM      2  CA  ALA A   1       2.400   2.300   3.200  1.00 16.00           C
ATOM      3  O   ALA A   1       4.200   3.800   2.900  0.80 18.00           O
ATOM      4 SE   MSE A   2       6.000   5.000   7.000  1.00 20.00          SE
END
"""
SE_K_EDGE_EV = 12658.0


def render(argv: list[str], dtype: torch.dtype = torch.float64) -> tuple[np.ndarray, object]:
    config, _ = parse(argv)
    setup = resolve(config)
    return Renderer(setup, dtype=dtype, compile="off")().numpy(), setup


BACKGROUND_FLAGS = {"-water": 1, "-background": 1, "-background_thick": 1, "-background_density": 1,
                    "-background_mw": 1}


def background_of(extra: list[str]) -> np.ndarray:
    """The background alone: the image with it minus the image without (the spots are the same)."""
    with_bg, _ = render(CRYSTAL + extra)
    without, skip = [], 0
    for arg in extra:
        if skip:
            skip -= 1
        elif arg in BACKGROUND_FLAGS:
            skip = BACKGROUND_FLAGS[arg]
        else:
            without.append(arg)
    base, _ = render(CRYSTAL + without)
    return with_bg - base


@pytest.mark.parametrize("flag", [["-oversample", "3"], ["-mosaic_dom", "4", "-mosaic", "0.5"],
                                  ["-phisteps", "3", "-osc", "0.3"]])
def test_corrected_water_is_linear_in_fluence_and_independent_of_sampling(flag):
    corrected = ["-physics", "corrected", "-water", "3"]
    low = background_of(corrected + ["-fluence", "4e26"])
    high = background_of(corrected + ["-fluence", "4e28"])
    np.testing.assert_allclose(high, 100.0 * low, rtol=1e-9)
    sampled = background_of(corrected + ["-fluence", "4e26"] + flag)
    np.testing.assert_allclose(sampled, low, rtol=1e-9)
    assert low.min() > 0


def test_default_water_keeps_nanobraggs_fluence_squared_and_warns():
    low = background_of(["-water", "3", "-fluence", "4e26"])
    high = background_of(["-water", "3", "-fluence", "4e28"])
    np.testing.assert_allclose(high, 1e4 * low, rtol=1e-6)
    _, setup = render(CRYSTAL + ["-water", "3"])
    defects = [w for w in setup.warnings if "-physics corrected" in w]
    assert len(defects) == 1 and "-water" in defects[0]
    _, corrected = render(CRYSTAL + ["-water", "3", "-physics", "corrected"])
    assert not any("-physics corrected" in w for w in corrected.warnings)


def test_corrected_first_phi_image_does_not_depend_on_threads():
    argv = CRYSTAL + ["-phi", "0", "-osc", "0.5", "-phisteps", "2", "-physics", "corrected"]
    config, _ = parse(argv)
    setup = resolve(config)
    images = [Renderer(setup, dtype=torch.float64, compile="off", reference_threads=threads)().numpy()
              for threads in (1, 2, 7)]
    np.testing.assert_array_equal(images[0], images[1])
    np.testing.assert_array_equal(images[0], images[2])
    nanobragg = resolve(parse(argv[:-2])[0])
    differ = [Renderer(nanobragg, dtype=torch.float64, compile="off", reference_threads=t)().numpy() for t in (1, 7)]
    assert not np.array_equal(differ[0], differ[1])  # the C's stale vectors do depend on the threads


def test_corrected_oversample_omega_multiplies_each_contribution():
    argv = CRYSTAL + ["-oversample", "2", "-distance", "30"]
    plain, _ = render(argv + ["-physics", "corrected"])
    per_step, _ = render(argv + ["-physics", "corrected", "-oversample_omega"])
    nanobragg, _ = render(argv + ["-oversample_omega"])
    # per contribution: each sub-pixel's own ω, close to the first sub-pixel's; the C's running product is not
    np.testing.assert_allclose(per_step, plain, rtol=0.05)
    assert np.abs(nanobragg / plain - 1).max() > 0.5


def test_nopolar_holds_under_oversample_polar_only_when_corrected():
    """nanoBragg recomputes the polarization per sub-pixel under -oversample_polar, -nopolar or not (the C case
    nopolar_oversample_polar holds its image); -physics corrected keeps -nopolar: no polarization at all."""
    argv = CRYSTAL + ["-oversample", "2", "-distance", "30", "-nopolar"]
    plain, _ = render(argv + ["-physics", "corrected"])
    per_step, _ = render(argv + ["-physics", "corrected", "-oversample_polar"])
    polarized, _ = render(argv[:-1] + ["-physics", "corrected", "-oversample_polar"])
    np.testing.assert_allclose(per_step, plain, rtol=1e-12)
    assert np.abs(polarized / plain - 1).max() > 0.005  # ½(1 + cos²2θ) at the corners, 2θ ≈ 6.5°


def test_nbsim_background_keeps_nopolar_under_oversample_polar():
    """Only nanoBragg's sub-pixel loop recomputes the polarization that -nopolar turns off; nbsim's own
    -background, which nanoBragg has not, stays unpolarized under -nopolar whatever -oversample_polar says."""
    extra = ["-background", "water", "-background_thick", "1", "-distance", "30", "-nopolar"]
    plain = background_of(extra)
    np.testing.assert_allclose(background_of([*extra, "-oversample_polar"]), plain, rtol=1e-12)
    assert np.abs(background_of(extra[:-1]) / plain - 1).max() > 0.005  # polarized without -nopolar


def test_corrected_misset_random_uses_degrees():
    argv = CRYSTAL + ["-misset_seed", "5", "-misset", "random"]
    from nbsim.model.crystal import build_lattice
    from nbsim.rng import Ran1

    config, _ = parse(argv)
    default = build_lattice(config.crystal, 1.0, Ran1())
    corrected = build_lattice(config.crystal, 1.0, Ran1(), corrected=True)
    unrotated = build_lattice(parse(CRYSTAL)[0].crystal, 1.0, Ran1())

    def angle(lattice) -> float:
        rotation = torch.linalg.solve(unrotated.real_A.T, lattice.real_A.T).T
        return math.degrees(math.acos(max(-1.0, min(1.0, (float(torch.trace(rotation)) - 1) / 2))))
    assert angle(corrected) <= 90.0 + 1e-6
    assert angle(default) != pytest.approx(angle(corrected))


def test_corrected_pix0_vector_mm_places_the_detector():
    argv = CRYSTAL + ["-pix0_vector_mm", "100", "2.4", "-2.4"]
    config, run = parse(argv + ["-physics", "corrected"])
    pix0 = resolve(config).geometry.pix0_m.detach().numpy()
    np.testing.assert_allclose(pix0, [0.1, 0.0024, -0.0024])
    _, run = parse(argv)
    assert any("-pix0_vector_mm" in note for note in run.notes)


BACKGROUND_DISTANCE_MM = 6.0


def _simtbx_pixel(curve, fast: int, slow: int, thickness_mm: float, density: float, mw: float,
                  fluence: float, beamsize_mm: float) -> float:
    """simtbx's add_background for one pixel, by hand: MOSFLM geometry, distance 6 mm, 0.1 mm pixels, 48x48,
    λ 1 Å, unpolarized (Kahn 0), polint over the padded curve."""
    pixel, distance = 1e-4, BACKGROUND_DISTANCE_MM * 1e-3
    beam_centre = (48 * pixel + pixel) / 2 + pixel / 2
    # MOSFLM: f̂ = (0, 0, 1), ŝ = (0, -1, 0), beam along x; pixel centre relative to the sample
    position = np.array([distance, -((slow + 0.5) * pixel - beam_centre), (fast + 0.5) * pixel - beam_centre])
    airpath = np.linalg.norm(position)
    omega = pixel * pixel / airpath ** 2 * distance / airpath
    diffracted = position / airpath
    incident = np.array([1.0, 0.0, 0.0])
    stol = 0.5 * np.linalg.norm(diffracted - incident)  # per Å at λ = 1 Å
    xs = [-1e99, -1e98, *[row[0] for row in curve], 1e98, 1e99]
    ys = [curve[0][1]] * 2 + [row[1] for row in curve] + [curve[-1][1]] * 2
    nearest = max(i for i in range(len(xs)) if xs[i] <= stol)
    px, py = xs[nearest - 1:nearest + 3], ys[nearest - 1:nearest + 3]
    F = sum(py[i] * math.prod((stol - px[j]) / (px[i] - px[j]) for j in range(4) if j != i) for i in range(4))
    cos2theta = diffracted @ incident
    polar = 0.5 * (1 + cos2theta ** 2)
    molecules = thickness_mm * 1e-3 * (beamsize_mm * 1e-3) ** 2 * density * 1e6 * AVOGADRO / mw
    return R_E_SQR_M2 * fluence * molecules * F * F * polar * omega


@pytest.mark.parametrize("name, curve, density, mw", [("water", WATER_CURVE, 1.0, 18.0),
                                                      ("air", AIR_CURVE, 1.2e-3, 14.0)])
def test_background_curve_matches_simtbx_formula(name, curve, density, mw):
    extra = ["-background", name, "-background_thick", "0.5", "-fluence", "1e24", "-distance",
             f"{BACKGROUND_DISTANCE_MM}", "-oversample", "1"]
    image = background_of(extra)
    for fast, slow in ((24, 24), (3, 40), (47, 0)):  # sin(theta)/lambda 0.006, 0.21 and 0.25 per A
        expected = _simtbx_pixel(curve, fast, slow, 0.5, density, mw, 1e24, 0.1)
        assert image[slow, fast] == pytest.approx(expected, rel=1e-6)


def test_background_file_is_linear_in_fluence_and_independent_of_sampling(tmp_path):
    curve = tmp_path / "curve.txt"
    curve.write_text("0 3\n0.1 5\n0.3 2\n0.6 1\n")
    extra = ["-background", str(curve), "-background_thick", "1", "-background_density", "2",
             "-background_mw", "40"]
    one = background_of(extra + ["-fluence", "1e24"])
    np.testing.assert_allclose(background_of(extra + ["-fluence", "3e24"]), 3 * one, rtol=1e-12)
    np.testing.assert_allclose(background_of(extra + ["-fluence", "1e24", "-oversample", "2", "-phisteps", "2",
                                                      "-osc", "0.1"]), one, rtol=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["-background", "water", "-background_thick", "-1"], "must not be negative"),
    (["-background", "water"], "needs a thickness"),
    (["-background", "CURVE1", "-background_thick", "1"], "at least two points"),
    (["-background", "water", "-background_thick", "1", "-water", "2"], "use one"),
    (["-physics", "exact"], "expects one of nanobragg, corrected"),
    (["-anomalous"], "give -model"),
    (["-model", "MODEL.pdb", "-anomalous", "-fp_fdp", "TABLE", "-energy", "9000"], "no f' and f'' of Se at 9000 eV"),
])
def test_bad_values_are_one_line_errors_with_status_2(tmp_path, argv, message, capsys):
    (tmp_path / "CURVE1").write_text("0 2.5\n")
    (tmp_path / "MODEL.pdb").write_text(MODEL)
    (tmp_path / "TABLE").write_text("Se 12000 -5 0.5\nSe 13000 -6 3.8\n")
    argv = [str(tmp_path / a) if a in ("CURVE1", "MODEL.pdb", "TABLE") else a for a in argv]
    crystal = MODEL_CRYSTAL if "-model" in argv else CRYSTAL
    assert message in one_line_error_here(crystal + argv + QUIET, tmp_path, capsys)


def _direct_summation(structure: gemmi.Structure, hkl: np.ndarray, energy_eV: float) -> np.ndarray:
    """F(h) = Σ_atoms Σ_ops occ·(f0(s) + f′ + i·f″)·exp(−B s²)·exp(2πi h·(R x + t)), s = sin θ/λ, f0 from
    IT92, f′ and f″ from Cromer–Liberman: written here, independently of nbsim's partial sums."""
    cell = structure.cell
    ops = (structure.find_spacegroup() or gemmi.SpaceGroup("P 1")).operations()
    total = np.zeros(len(hkl), np.complex128)
    for atom in (a for chain in structure[0] for residue in chain for a in residue):
        fp, fpp = gemmi.cromer_liberman(z=atom.element.atomic_number, energy=energy_eV)
        frac = np.array(cell.fractionalize(atom.pos).tolist())
        for index, h in enumerate(hkl):
            stol_sqr = cell.calculate_1_d2([int(v) for v in h]) / 4.0
            f = atom.element.it92.calculate_sf(stol_sqr) + fp + 1j * fpp
            for op in ops:
                position = np.array(op.apply_to_xyz(frac.tolist()))
                total[index] += atom.occ * f * math.exp(-atom.b_iso * stol_sqr) * np.exp(
                    2j * math.pi * float(h @ position))
    return total


def test_anomalous_friedel_differences_match_direct_summation_either_side_of_the_edge(tmp_path):
    model = tmp_path / "se.pdb"
    model.write_text(MODEL)
    structure = gemmi.read_structure(str(model))
    for energy in (SE_K_EDGE_EV - 150.0, SE_K_EDGE_EV + 150.0):
        config, _ = parse(["-model", str(model), "-anomalous", "-energy", f"{energy}", "-N", "3", "-distance", "60",
                           "-detpixels", "64"])
        setup = resolve(config)
        table = setup.p1_table.reflections
        lookup = {tuple(int(v) for v in row[:3]): row[3] for row in table}
        hkl = np.array([h for h in lookup if h > tuple(-v for v in h)][:40], np.int64)
        expected = _direct_summation(structure, np.vstack([hkl, -hkl]), setup.channels.energies_eV[0])
        plus, minus = np.abs(expected[:len(hkl)]), np.abs(expected[len(hkl):])
        got_plus = np.array([lookup[tuple(h)] for h in hkl])
        got_minus = np.array([lookup[tuple(-h)] for h in hkl])
        np.testing.assert_allclose(got_plus, plus, rtol=1e-4)
        np.testing.assert_allclose(got_minus, minus, rtol=1e-4)
        difference = got_plus ** 2 - got_minus ** 2
        expected_difference = plus ** 2 - minus ** 2
        assert np.abs(expected_difference).max() > 1e-3 * (plus ** 2).max()  # F(+) != F(-): anomalous signal
        np.testing.assert_allclose(difference, expected_difference, rtol=1e-4,
                                   atol=1e-4 * np.abs(expected_difference).max())


def test_spectrum_renders_each_channel_with_its_own_table_in_one_pass(tmp_path):
    model = tmp_path / "se.pdb"
    model.write_text(MODEL)
    spectrum = tmp_path / "spectrum.txt"
    below, above = SE_K_EDGE_EV - 100.0, SE_K_EDGE_EV + 100.0
    spectrum.write_text(f"energy_eV weight\n{below} 1\n{above} 3\n")
    base = ["-model", str(model), "-anomalous", "-N", "4", "-distance", "60", "-detpixels", "40", "-pixel", "0.2",
            "-misset", "10", "20", "30", "-oversample", "1"]
    both, setup = render(base + ["-spectrumfile", str(spectrum)])
    assert len(setup.channel_grids) == 2
    first, _ = render(base + ["-energy", f"{below}"])
    second, _ = render(base + ["-energy", f"{above}"])
    np.testing.assert_allclose(both, 0.25 * first + 0.75 * second, rtol=1e-9, atol=1e-12 * both.max())
    binned, binned_setup = render(base + ["-spectrumfile", str(spectrum), "-energy_bins", "1"])
    assert len(binned_setup.channel_grids) == 1
    assert not np.allclose(binned, both)


def test_user_table_overrides_cromer_liberman(tmp_path):
    from nbsim.model.anomalous import read_factor_table, scattering_factors

    path = tmp_path / "fp.txt"
    path.write_text("# element eV f' f''\nSe 12000 -5 0.5\nSe 13000 -6 3.5\n")
    factors = scattering_factors(("Se", "C"), 12500.0, read_factor_table(str(path)), str(path))
    assert factors["Se"] == pytest.approx((-5.5, 2.0))
    assert factors["C"] == pytest.approx(gemmi.cromer_liberman(z=6, energy=12500.0))


def test_step_ordered_evaluation_reads_each_sources_table(tmp_path):
    """The loop-ordered path (here -oversample_omega, one sub-pixel: the same ω at every step) looks up each
    source's own table, as the fused kernel does."""
    model = tmp_path / "se.pdb"
    model.write_text(MODEL)
    spectrum = tmp_path / "spectrum.txt"
    spectrum.write_text(f"energy_eV weight\n{SE_K_EDGE_EV - 100.0} 1\n{SE_K_EDGE_EV + 100.0} 2\n")
    base = ["-model", str(model), "-anomalous", "-spectrumfile", str(spectrum), "-N", "4", "-distance", "60",
            "-detpixels", "24", "-pixel", "0.4", "-misset", "10", "20", "30", "-oversample", "1", "-physics",
            "corrected"]
    fused, _ = render(base)
    ordered, _ = render(base + ["-oversample_omega"])
    np.testing.assert_allclose(ordered, fused, rtol=1e-12)


def test_corrected_changes_nothing_where_no_defect_is_met():
    default, setup = render(CRYSTAL + ["-mosaic", "0.3", "-mosaic_dom", "3", "-oversample", "2"])
    corrected, _ = render(CRYSTAL + ["-mosaic", "0.3", "-mosaic_dom", "3", "-oversample", "2", "-physics", "corrected"])
    np.testing.assert_array_equal(default, corrected)
    assert not any("-physics corrected" in w for w in setup.warnings)


@pytest.mark.parametrize("extra, named", [
    (["-phi", "0", "-osc", "0.5", "-phisteps", "2"], "phi step at 0"),
    (["-oversample_thick", "-oversample_omega"], "-oversample_thick/-oversample_omega"),
    (["-misset_seed", "5", "-misset", "random"], "-misset random"),
    (["-nopolar", "-oversample_polar"], "recomputes the polarization that -nopolar turns off"),
])
def test_default_physics_names_each_defect_met_in_one_warning(extra, named):
    config, _ = parse(CRYSTAL + extra)
    defects = [w for w in resolve(config).warnings if "-physics corrected" in w]
    assert len(defects) == 1 and named in defects[0]


def test_default_physics_names_the_interpolation_decided_on_the_counts_given(tmp_path):
    """-N 3 with a crystal size of two cells a side: nanoBragg decides on the 3 given (nearest), -physics
    corrected on the crystal's 2 (interpolate); the default names the difference, a size that agrees does not."""
    hkl = tmp_path / "f.hkl"
    hkl.write_text("".join(f"{h} {k} {l} {10 + h + k + l}\n" for h in range(-4, 5) for k in range(-4, 5)
                           for l in range(-4, 5)))
    named = "counts the cells -N gives"
    for size_mm, differs in (("0.00001", True), ("0.0001", False)):
        config, _ = parse([*CRYSTAL, "-hkl", str(hkl), "-xtalsize", size_mm])
        assert any(named in w for w in resolve(config).warnings) is differs
        corrected = resolve(config.with_options(physics="corrected"))
        assert corrected.lookup == ("interpolate" if differs else "nearest")


CCTBX_F_CALC = """
import json, sys
import iotbx.pdb
from cctbx import miller
from cctbx.array_family import flex
request = json.load(sys.stdin)
structure = iotbx.pdb.input(file_name=request["model"]).xray_structure_simple()
structure.scattering_type_registry(table="it1992")
for scatterer in structure.scatterers():
    scatterer.fp, scatterer.fdp = request["factors"][scatterer.scattering_type]
indices = miller.set(structure.crystal_symmetry(), flex.miller_index([tuple(h) for h in request["hkl"]]),
                     anomalous_flag=True)
f_calc = indices.structure_factors_from_scatterers(structure, algorithm="direct").f_calc()
print(json.dumps([abs(f) for f in f_calc.data()]))
"""
"""cctbx's f_calc in a process of its own: its boost.python extensions crash a process that has loaded torch."""


def test_anomalous_table_matches_cctbx_f_calc(tmp_path):
    """cctbx's f_calc (direct summation, IT1992 form factors) with the same Cromer–Liberman f′ and f″ per
    scatterer: |F(+)| and |F(−)| as nbsim's table holds them."""
    import importlib.util
    import json

    if importlib.util.find_spec("cctbx") is None:
        pytest.skip("cctbx-base is not installed (pip install cctbx-base)")
    model = tmp_path / "se.pdb"
    model.write_text(MODEL)
    energy = SE_K_EDGE_EV + 150.0
    config, _ = parse(["-model", str(model), "-anomalous", "-energy", f"{energy}", "-N", "3", "-distance", "60",
                       "-detpixels", "64"])
    setup = resolve(config)
    lookup = {tuple(int(v) for v in row[:3]): row[3] for row in setup.p1_table.reflections}
    hkl = [h for h in lookup if h != (0, 0, 0)][::7]
    channel_eV = float(setup.channels.energies_eV[0])
    factors = {name: gemmi.cromer_liberman(z=gemmi.Element(name).atomic_number, energy=channel_eV)
               for name in ("N", "C", "O", "Se")}
    request = json.dumps({"model": str(model), "hkl": hkl, "factors": factors})
    result = subprocess.run([sys.executable, "-c", CCTBX_F_CALC], input=request, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    expected = json.loads(result.stdout)
    np.testing.assert_allclose([lookup[h] for h in hkl], expected, rtol=1e-4)


def test_background_is_computed_in_float64_whatever_the_render_dtype():
    from nbsim.kernel.background import background_rows

    config, _ = parse(CRYSTAL + ["-background", "water", "-background_thick", "0.5", "-distance", "6"])
    setup = resolve(config)
    images = []
    for dtype in (torch.float32, torch.float64):
        renderer = Renderer(setup, dtype=dtype, compile="off")
        rows = torch.arange(48, dtype=dtype)
        image = background_rows(rows, renderer.cols, renderer.background, renderer.inputs.options)
        assert image.dtype == dtype
        images.append(image.double().numpy())
    np.testing.assert_allclose(images[0], images[1], rtol=1e-6)


@pytest.mark.parametrize("curve", ["water", "air", "0 2\n0.05 -1\n0.1 3\n0.3 2.5\n"])
def test_channel_moments_equal_the_sum_over_channels(tmp_path, curve):
    """A spectrum's channels summed through their moments (one polynomial per pixel where they share a curve
    segment) equal simtbx's per-channel sum, for every sin θ across the curve and past its ends."""
    from nbsim.kernel.background import curve_sum, polint

    if "\n" in curve:
        path = tmp_path / "curve.txt"
        path.write_text(curve)
        curve = str(path)
    spectrum = tmp_path / "spectrum.txt"
    spectrum.write_text("".join(f"{1.0 + 0.002 * i} {1 + (i % 3)}\n" for i in range(40)))
    config, _ = parse(CRYSTAL + ["-background", curve, "-background_thick", "1", "-spectrumfile", str(spectrum)])
    renderer = Renderer(resolve(config), dtype=torch.float64, compile="off")
    b = renderer.background
    assert len(b.weight) == 1 and len(b.weight[0]) == 40
    sin_theta = torch.linspace(0.0, 1.0, 4001, dtype=torch.float64).view(1, -1)
    F = polint(b.curve, sin_theta.unsqueeze(-1) * b.inv_wavelength[0])
    expected = (torch.sign(F) * F * F * b.weight[0]).sum(-1)
    np.testing.assert_allclose(curve_sum(b, 0, sin_theta).numpy(), expected.numpy(), rtol=1e-9,
                               atol=1e-12 * float(expected.abs().max()))
