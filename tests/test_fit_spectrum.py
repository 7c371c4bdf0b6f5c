"""Per-shot spectra in a fit (docs/fitting.md, "Spectra"): -spectrum_shift and -spectrum_stretch move a
spectrum's channels, `--refine spectrum` fits them (on the fit's kernel and through autograd alike), a still
whose spectrum the start places 5 eV off comes back within 0.5 eV with its crystal as well fitted as from the
true spectrum, the spectrum a frame carries (NXmx, a store's shot) is the model's, and bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import nbsim
from nbsim.fit.model import DiffractionModel
from nbsim.fit.output import standard_errors
from nbsim.fit.parameters import held_scale_basis, misorientation_deg
from nbsim.fit.refine import FitImage, FitOptions, fit
from nbsim.io.text import HC_EV_A
from nbsim.model.spectra import sase_spectrum
from nbsim.resolve import resolve

SPECTRUM = sase_spectrum(1.0, 0.3, 6, 7)
"""A SASE-like spectrum at 12.4 keV: 0.3 % bandwidth (37 eV), six channels."""
STILL = "-default_F 100 -distance 40 -detpixels 128 -pixel 0.1 -oversample 1".split()
TRUTH = "-cell 40 50 60 90 90 90 -misset 10 20 30 -N 10 -fluence 3e28".split()
START = "-cell 40 50 60 90 90 90 -misset 10.03 20.02 29.98 -N 8 -fluence 3e28".split()
"""The start: the true cell (the data set's), 0.04° off in orientation, N 20 % low."""


def _spectrum_file(folder: Path, name: str, offset_eV: float = 0.0) -> str:
    path = folder / name
    path.write_text("energy_eV weight\n" + "".join(f"{HC_EV_A / wavelength + offset_eV!r} {weight!r}\n"
                                                   for wavelength, weight in SPECTRUM))
    return str(path)


@pytest.fixture(scope="module")
def spectra(tmp_path_factory) -> Path:
    """The true spectrum and one 5 eV above it (a spectrometer's calibration off)."""
    folder = tmp_path_factory.mktemp("spectra")
    _spectrum_file(folder, "true.txt")
    _spectrum_file(folder, "off.txt", 5.0)
    return folder


def test_the_shift_and_stretch_move_the_channels_energies(spectra):
    """E' = Ē + shift + stretch·(E − Ē) for every channel (Ē the weighted mean energy), the nominal wavelength
    the moved channels' mean; without a spectrum, or moving an energy to or below zero, one line."""
    config = nbsim.config_from_args([*STILL, *TRUTH, "-spectrumfile", str(spectra / "true.txt"),
                                     "-spectrum_shift", "-3", "-spectrum_stretch", "1.5"])
    energies = HC_EV_A / resolve(config).sources.wavelength_A.numpy()
    given = np.array([HC_EV_A / wavelength for wavelength, _ in SPECTRUM])
    weights = np.array([weight for _, weight in SPECTRUM])
    mean = (given * weights).sum() / weights.sum()
    np.testing.assert_allclose(energies, mean - 3 + 1.5 * (given - mean), rtol=1e-12)
    moved = HC_EV_A / energies
    assert float(config.beam.wavelength_A) == pytest.approx((moved * weights).sum() / weights.sum(), rel=1e-12)
    for flags, message in ((["-spectrum_shift", "2"], "give -spectrumfile"),
                           (["-spectrumfile", str(spectra / "true.txt"), "-spectrum_stretch", "1000"], "non-positive"),
                           (["-spectrumfile", str(spectra / "true.txt"), "-spectrum_stretch", "0"], "above 0")):
        with pytest.raises(nbsim.NbsimError, match=message):
            nbsim.config_from_args([*STILL, *TRUTH, *flags])


def test_the_spectrums_gradients_on_the_fits_kernel_are_autograds(spectra):
    """--refine spectrum renders on fixed scattering vectors scaled per source (the fit's kernel, its
    derivatives in R source by source) and through the general model's autograd alike, and the cell refined
    beside it keeps its scale (one coordinate fewer)."""
    setup = resolve(nbsim.config_from_args([*STILL[:5], "48", *STILL[6:], *TRUTH, "-spectrumfile",
                                            str(spectra / "true.txt"), "-spectrum_shift", "2"]))
    image = nbsim.simulate(setup.config, dtype=torch.float64, compile="off").numpy()
    rows, cols = np.nonzero(image > 0.01 * image.max())
    refine = ["orientation", "cell", "N", "scale", "spectrum"]
    kernel = DiffractionModel([setup], [(rows, cols)], refine, compile="off")
    general = DiffractionModel([setup], [(rows, cols)], refine, compile="off")
    general.scattering = None
    assert kernel.scattering is not None and kernel.size == 3 + 2 + 3 + 1 + 2
    weights = torch.as_tensor(np.random.default_rng(0).uniform(0.5, 1.5, len(rows)))
    x = torch.linspace(-2, 2, kernel.size, dtype=torch.float64)
    gradients = []
    for model in (kernel, general):
        point = x.clone().requires_grad_(True)
        gradients.append(torch.autograd.grad((model(point)[0] * weights).sum(), point)[0])
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-8, atol=1e-10)
    cell = kernel.cell(0, kernel.natural(x)[0])[:3]
    assert float(torch.log(cell).sum()) == pytest.approx(float(np.log([40, 50, 60]).sum()), abs=1e-12)
    basis = held_scale_basis(3)
    torch.testing.assert_close(basis.T @ basis, torch.eye(2, dtype=torch.float64))


def test_a_spectrum_5_eV_off_comes_back_with_the_crystal(spectra):
    """Issue 39's spectra case at small scale: a still rendered with a SASE spectrum, fitted from a start whose
    spectrum is 5 eV off: the shift comes back within 0.5 eV, and the crystal as well as from the true
    spectrum."""
    truth = resolve(nbsim.config_from_args([*STILL, *TRUTH, "-spectrumfile", str(spectra / "true.txt")]))
    image = nbsim.simulate(truth.config, dtype=torch.float64, compile="off").numpy()
    counts = np.random.default_rng(1).poisson(image).astype(np.float64)
    outcomes = {}
    for name, refine in (("true", ("orientation", "cell", "N", "scale")),
                         ("off", ("orientation", "cell", "N", "scale", "spectrum"))):
        start = resolve(nbsim.config_from_args([*STILL, *START, "-spectrumfile", str(spectra / f"{name}.txt")]))
        result = fit([FitImage(name, start, counts, np.ones_like(counts, bool))],
                     FitOptions(refine=refine, search_deg=0, max_spots=50))
        assert result.converged, result.reason
        values = {key: value.detach() for key, value in result.model.natural()[0].items()}
        outcomes[name] = (misorientation_deg(result.model.a_matrix(0, values), truth.lattice.reciprocal_per_A),
                          np.abs(result.model.cell(0, values)[:3].numpy() / [40, 50, 60] - 1).max(),
                          np.abs(values["N"].numpy() - 10).max(), values["spectrum"].tolist(),
                          standard_errors(result, 0)["spectrum"])
    (orientation, length, n_cells, _, _), (off_orientation, off_length, off_n, spectrum, sigma) = outcomes.values()
    assert abs(spectrum[0] + 5.0) <= 0.5 and abs(spectrum[0] + 5.0) <= 4 * sigma[0], (spectrum, sigma)
    assert abs(spectrum[1] - 1.0) <= 4 * sigma[1], (spectrum, sigma)
    assert off_orientation <= 1.5 * orientation + 0.002, outcomes
    assert off_length <= 1.5 * length + 5e-5 and off_n <= 1.5 * n_cells + 0.05, outcomes


def test_the_frames_spectrum_is_the_models_and_bad_spectra_are_one_line(tmp_path, spectra, monkeypatch, capsys):
    """A frame that carries a spectrum (NXmx's polychromatic beam) gives the fit's model its spectrum; the JSON
    reports each shot's shift and stretch. --refine spectrum on a shot of one wavelength, a spectrum without
    weight, and -spectrum_stretch making an energy negative are one line and exit 2."""
    from nbsim.cli import main
    from nbsim.cli.fit import with_frame_spectrum

    monkeypatch.chdir(tmp_path)
    flags = [*STILL[:5], "32", *STILL[6:], *TRUTH]
    quiet = ["-nopgm", "-floatfile", "/dev/null", "-intfile", "/dev/null"]
    assert main([*flags, "-spectrumfile", str(spectra / "true.txt"), "-nxmxfile", "shot.h5", "-noisefile",
                 "/dev/null", *quiet]) == 0
    config = with_frame_spectrum(nbsim.config_from_args(flags), "shot.h5", flags)
    np.testing.assert_allclose(np.array(config.beam.spectrum), np.array(SPECTRUM), rtol=1e-9)
    assert main(["fit", "shot.h5", "--refine", "scale,spectrum", "--search-deg", "0", "--max-iterations", "3",
                 "--json", "fit.json", "--", *flags]) in (0, 3)
    shot = json.loads((tmp_path / "fit.json").read_text())["shots"][0]
    assert set(shot["spectrum"]) == {"shift_eV", "stretch", "sigma"} and set(shot["spectrum"]["sigma"]) == {
        "shift_eV", "stretch"}

    (tmp_path / "zero.txt").write_text("1.0 0\n1.001 0\n")
    assert main([*flags, "-noisefile", "plain.img", *quiet]) == 0
    capsys.readouterr()
    for options, model_flags, message in (
            (["--refine", "orientation,spectrum"], [], "needs the shot's spectrum"),
            ([], ["-spectrumfile", "zero.txt"], "the weights sum to 0"),
            ([], ["-spectrumfile", str(spectra / "true.txt"), "-spectrum_stretch", "1000"], "non-positive")):
        assert main(["fit", "plain.img", *options, "--json", "bad.json", "--", *flags, *model_flags]) == 2
        error = capsys.readouterr().err
        assert message in error and len(error.strip().splitlines()) == 1, error
        assert not (tmp_path / "bad.json").exists()
