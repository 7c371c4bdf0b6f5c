"""Weighted spectra (-spectrumfile): the file, the image against nanoBragg's sources, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nbsim.cli import main
from nbsim.config import spectrum_mean_wavelength_A
from nbsim.errors import InputFileError, NbsimError
from nbsim.io.text import HC_EV_A, read_spectrum_file
from nbsim.kernel.structure import structure_of
from nbsim.nanobragg import parse
from nbsim.render import simulate

BASE = ("-default_F 100 -cell 60 60 60 90 90 90 -N 6 -distance 80 -detpixels 40 -pixel 0.4 -oversample 1 "
        "-mosaic 0.3 -mosaic_dom 2 -mosaic_seed 5 -misset 5 10 15").split()
WAVELENGTHS_A = (1.0, 1.03, 1.07)


def _file(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def _spectrum(folder: Path, weights: tuple[float, ...], name: str = "spectrum.txt") -> str:
    return _file(folder, name, "".join(f"{lam} {w}\n" for lam, w in zip(WAVELENGTHS_A, weights, strict=True)))


def _render(argv: list[str]) -> torch.Tensor:
    return simulate(parse(argv)[0], dtype=torch.float64, compile="off")


def test_reader_takes_wavelengths_energies_headers_and_comments(tmp_path):
    plain = _file(tmp_path, "a.txt", "# wavelength_A weight\n1.0 1\n\n1.1, 0.5  # comment\n")
    assert read_spectrum_file(plain) == ((1.0, 1.0), (1.1, 0.5))
    energies = _file(tmp_path, "b.txt", "# a SASE shot\n# energy_eV weight\n9000 1\n9100 0\n")
    assert read_spectrum_file(energies) == ((HC_EV_A / 9000, 1.0), (HC_EV_A / 9100, 0.0))
    bare_header = _file(tmp_path, "c.txt", "energy_eV weight\n12398.42 2\n")
    assert read_spectrum_file(bare_header) == ((1.0, 2.0),)


def test_nominal_wavelength_is_the_weighted_mean_unless_lambda_is_given(tmp_path):
    path = _spectrum(tmp_path, (1.0, 2.0, 1.0))
    config = parse(BASE + ["-spectrumfile", path])[0]
    assert config.beam.spectrum == tuple(zip(WAVELENGTHS_A, (1.0, 2.0, 1.0), strict=True))
    assert config.beam.wavelength_A == pytest.approx(spectrum_mean_wavelength_A(config.beam.spectrum))
    assert parse(BASE + ["-spectrumfile", path, "-lambda", "1.2"])[0].beam.wavelength_A == 1.2


def test_new_channel_counts_and_weights_keep_the_kernel_structure(tmp_path):
    """Channels are sources, a run-time count, and weights are values: one compiled kernel serves all."""
    structures = {structure_of(parse(BASE + ["-spectrumfile", path, "-lambda", "1"])[0])
                  for path in (_spectrum(tmp_path, (1, 1, 1), "a.txt"), _spectrum(tmp_path, (0.2, 3, 1), "b.txt"),
                               _file(tmp_path, "c.txt", "1.0 1\n1.1 2\n"))}
    assert structures == {structure_of(parse(BASE + ["-lambda", "1"])[0])}


def test_one_channel_is_nanobraggs_image(tmp_path):
    spectrum = _file(tmp_path, "one.txt", "1.05 0.3\n")
    assert torch.equal(_render(BASE + ["-spectrumfile", spectrum]), _render(BASE + ["-lambda", "1.05"]))


def test_equal_weights_are_nanobraggs_sources(tmp_path):
    """Equal weights render what nanoBragg renders for the same sources (-sourcefile along the beam), water
    background and polarization included."""
    extra = ["-water", "200", "-polar", "0.9", "-lambda", "1.02"]
    sources = _file(tmp_path, "sources.txt", "".join(f"-10 0 0 1 {lam * 1e-10}\n" for lam in WAVELENGTHS_A))
    spectrum = _spectrum(tmp_path, (2.0, 2.0, 2.0))
    assert torch.equal(_render(BASE + extra + ["-spectrumfile", spectrum]),
                       _render(BASE + extra + ["-sourcefile", sources]))


@pytest.mark.parametrize("divergence", [[], ["-hdivrange", "0.3", "-hdivsteps", "3"]], ids=["beam", "divergence"])
def test_unequal_weights_are_the_weighted_sum_of_single_wavelength_images(tmp_path, divergence):
    weights = (0.5, 3.0, 1.25)
    image = _render(BASE + divergence + ["-spectrumfile", _spectrum(tmp_path, weights)])
    expected = sum(w * _render(BASE + divergence + ["-lambda", str(lam)])
                   for lam, w in zip(WAVELENGTHS_A, weights, strict=True)) / sum(weights)
    assert image.max() > 0
    assert torch.max(torch.abs(image - expected)) <= 1e-6 * expected.max()
    assert not torch.allclose(image, _render(BASE + divergence + ["-spectrumfile", _spectrum(tmp_path, (1, 1, 1))]))


def test_config_checks_a_spectrum_given_without_a_file():
    config = parse(BASE)[0]
    for spectrum, message in [((), "no channels"), (((1.0, -1.0),), "must not be negative"),
                              (((0.0, 1.0),), "must be positive"), (((1.0, 0.0),), "sum to 0")]:
        with pytest.raises(NbsimError, match=message):
            simulate(config.with_options(spectrum=spectrum), dtype=torch.float64, compile="off")


BAD_FILES = {
    "negative weight": ("1.0 1\n1.1 -0.5\n", "bad.txt:2: weight -0.5 must not be negative"),
    "zero sum": ("1.0 0\n1.1 0\n", "bad.txt: the weights sum to 0"),
    "zero wavelength": ("1.0 1\n0 1\n", "bad.txt:2: wavelength 0 A must be positive"),
    "negative energy": ("# energy_eV weight\n-9000 1\n", "bad.txt:2: energy -9000 eV must be positive"),
    "empty": ("# nothing here\n\n", "bad.txt: no spectrum channels in file"),
    "unparsable": ("1.0 1\n1.1 heavy\n", "bad.txt:2: 'heavy' is not a number"),
    "one column": ("1.0\n", "bad.txt:1: expected 2 numbers, wavelength (A) and weight, found 1"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_spectrum_file_is_one_line_exit_2_nothing_written(name, tmp_path, capsys, monkeypatch):
    text, expected = BAD_FILES[name]
    path = _file(tmp_path, "bad.txt", text)
    with pytest.raises(InputFileError):
        read_spectrum_file(path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    status = main(BASE + ["-spectrumfile", path, "-compile", "off", "-floatfile", "f.bin", "-nxmxfile", "f.h5"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.strip().splitlines() == [f"nbsim: error: {tmp_path / expected}"]
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("flags, message", [
    (["-sourcefile", "S"], "conflicting options -sourcefile and -spectrumfile"),
    (["-dispersion", "1"], "conflicting options -dispersion and -spectrumfile"),
])
def test_spectrum_conflicts_with_other_wavelength_sources(tmp_path, capsys, flags, message):
    flags = [str(tmp_path / "s.txt") if value == "S" else value for value in flags]
    _file(tmp_path, "s.txt", "-10 0 0 1 1e-10\n")
    assert main(BASE + ["-spectrumfile", _spectrum(tmp_path, (1, 1, 1)), *flags]) == 2
    assert message in capsys.readouterr().err


def test_nxmx_holds_the_wavelengths_and_their_weights(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    nxmx = pytest.importorskip("nxmx")
    monkeypatch.chdir(tmp_path)
    weights = (1.0, 2.0, 1.0)
    assert main(BASE + ["-spectrumfile", _spectrum(tmp_path, weights), "-compile", "off", "-nonoise",
                        "-nxmxfile", "image.nxs"]) == 0
    with h5py.File(tmp_path / "image.nxs") as handle:
        beam = nxmx.NXmx(handle).entries[0].instruments[0].beams[0]
        assert beam.incident_wavelength.to("angstrom").magnitude.tolist() == list(WAVELENGTHS_A)
        stored = handle["/entry/instrument/beam/incident_wavelength_weights"][()]
    assert stored.tolist() == pytest.approx([w / sum(weights) for w in weights], rel=1e-15)


def test_a_sweep_axis_of_spectrum_files_plans_and_records_each_spectrum(tmp_path):
    from nbsim.sweep.plan import point_spec, sweep_points
    from nbsim.sweep.spec import PointSpec
    from nbsim.sweep.validate import validate_config

    from .conftest import REPO_ROOT
    from .test_sweep import config_with

    files = [_spectrum(tmp_path, (1, 1, 1), "flat.txt"), _spectrum(tmp_path, (0.1, 1, 5), "tilted.txt")]
    config = config_with({"-spectrumfile": files})
    validate_config(config, REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml", tmp_path)
    points = sweep_points(config)
    specs = [point_spec(config, point, tmp_path, {point: "kernel"}) for point in points]
    assert [spec.config.beam.spectrum for spec in specs] == [read_spectrum_file(path) for path in files]
    assert [PointSpec.from_dict(spec.to_dict()) for spec in specs] == specs
    bad = config_with({"-spectrumfile": [files[0], _file(tmp_path, "bad.txt", "1.0 -1\n")]})
    with pytest.raises(NbsimError, match="bad.txt:1: weight -1 must not be negative"):
        validate_config(bad, REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml", tmp_path)


def test_sase_spectrum_is_seeded_spiky_and_normalised():
    from nbsim.model.spectra import sase_spectrum

    spectrum = sase_spectrum(1.3, 0.5, 100, seed=7)
    assert spectrum == sase_spectrum(1.3, 0.5, 100, seed=7)
    assert spectrum != sase_spectrum(1.3, 0.5, 100, seed=8)
    wavelengths, weights = zip(*spectrum, strict=True)
    assert len(spectrum) == 100 and sum(weights) == pytest.approx(1.0, rel=1e-12) and min(weights) >= 0
    assert wavelengths[0] < 1.3 < wavelengths[-1]
    assert abs(wavelengths[-1] - wavelengths[0] - 3 * 1.3 * 0.005) < 1e-12
    peaks = sum(1 for i in range(1, 99) if weights[i - 1] < weights[i] > weights[i + 1])
    assert 2 <= peaks <= 10
    assert sase_spectrum(1.3, 0.5, 1, seed=7) == ((1.3, 1.0),)
    with pytest.raises(NbsimError, match="bandwidth"):
        sase_spectrum(1.3, 0.0, 100, seed=7)


SASE = {"sase": {"centre_eV": 9500, "bandwidth_percent": 0.5, "channels": 20, "spikes": 4}}


def test_a_sase_draw_gives_each_shot_its_own_recorded_spectrum(tmp_path):
    from nbsim.model.spectra import sase_spectrum
    from nbsim.sweep import plan
    from nbsim.sweep.spec import PointSpec
    from nbsim.sweep.validate import validate_config

    from .test_dataset import SCHEMA, dataset_config

    config = dataset_config({"count": 3, "seed": 11, "values": {"spectrum": SASE}}, detector=None)
    validate_config(config, SCHEMA, tmp_path)
    specs = [plan.point_spec(config, point, tmp_path, {}) for point in plan.sweep_points(config)]
    spectra = [spec.config.beam.spectrum for spec in specs]
    assert len(set(spectra)) == 3 and all(len(spectrum) == 20 for spectrum in spectra)
    assert spectra == [plan.point_spec(config, point, tmp_path, {}).config.beam.spectrum
                       for point in plan.sweep_points(config)]
    wavelengths = [lam for lam, _ in sase_spectrum(HC_EV_A / 9500, 0.5, 20, seed=1, spikes=4)]
    assert all([lam for lam, _ in spectrum] == wavelengths for spectrum in spectra)
    for spec, spectrum in zip(specs, spectra, strict=True):
        assert spec.labels["spectrum_mean_A"] == pytest.approx(spectrum_mean_wavelength_A(spectrum))
        assert [spec.labels[f"spectrum_weight_{i:03d}"] for i in range(20)] == [w for _, w in spectrum]
        assert PointSpec.from_dict(spec.to_dict()) == spec
    image = simulate(specs[0].config, dtype=torch.float64, compile="off")
    assert image.max() > 0


@pytest.mark.parametrize("values, message", [
    ({"spectrum": {"sase": {"centre_A": 1.3, "bandwidth_percent": 0.5}}},
     "sweep.draws.values.spectrum.sase: 'channels' is a required property"),
    ({"spectrum": {"sase": {"centre_A": 1.3, "centre_eV": 9000, "bandwidth_percent": 0.5, "channels": 5}}},
     "give one of centre_A and centre_eV"),
    ({"spectrum": {"sase": {"centre_A": -1.3, "bandwidth_percent": 0.5, "channels": 5}}},
     "sase.centre_A: -1.3 is not valid here (exclusiveMinimum: 0)"),
    ({"spectrum": {"sase": {"centre_A": 1.3, "bandwidth_percent": 0.5, "channels": 2.5}}},
     "sase.channels: 2.5 is not valid here (type: \"integer\")"),
    ({"-N": SASE}, "sweep.draws.values.-N: 'sase' draws a spectrum"),
    ({"spectrum": {"uniform": [1, 2]}}, "sweep.draws.values.spectrum: 'sase' draws a spectrum"),
])
def test_bad_sase_draws_fail_with_one_line(tmp_path, values, message):
    from nbsim.sweep.validate import validate_config

    from .test_dataset import SCHEMA, dataset_config

    with pytest.raises(NbsimError) as error:
        validate_config(dataset_config({"count": 2, "values": values}, detector=None), SCHEMA, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_spectrum_reader_never_crashes(tmp_path):
    """Any text ends in channels or a one-line InputFileError."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    words = st.one_of(st.sampled_from(["#", "energy_eV", "weight", "wavelength_A", "nan", "inf", "-1", "0", ",", "\n"]),
                      st.from_regex(r"-?[0-9]{1,5}(\.[0-9]{0,3})?(e-?[0-9])?", fullmatch=True), st.text(max_size=6))
    path = tmp_path / "fuzz.txt"

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(words, max_size=16))
    def check(tokens):
        path.write_text(" ".join(tokens), errors="surrogateescape")
        try:
            channels = read_spectrum_file(path)
        except InputFileError as error:
            assert "\n" not in str(error)
            return
        assert channels and all(lam > 0 and w >= 0 for lam, w in channels) and sum(w for _, w in channels) > 0

    check()
