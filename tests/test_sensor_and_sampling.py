"""The sensor as simulated (material, attenuation at λ, the headers) and the sampling advice (φ steps and
mosaic domains for the spots' angular width)."""

from __future__ import annotations

import math
import shutil
import subprocess

import fabio
import pytest

from nbsim.cli import main
from nbsim.nanobragg import config_from_args, parse
from nbsim.resolve import SINC_FWHM, config_sampling_advice, resolve
from nbsim.sensors import MATERIALS, sensor_material

SMALL = ["-cell", "70", "80", "90", "90", "90", "90", "-default_F", "100", "-N", "4", "-detpixels", "40",
         "-pixel", "0.2", "-distance", "90", "-lambda", "1.0", "-compile", "off", "-seed", "7", "-nopgm",
         "-floatfile", "float.bin", "-intfile", "int.img", "-nonoise"]


def test_silicon_at_one_angstrom_matches_an_independent_table():
    """237.6 µm: Elam's table (xraydb 4.5.8, material_mu('Si', 12398.42 eV, 2.329 g/cm³)) gives 237.57 µm,
    from other data than NIST's that nbsim copies."""
    assert sensor_material("Si").attenuation_length_um(1.0) == pytest.approx(237.6, rel=0.01)


def test_absorption_edges_are_steps():
    """Just above an edge the material absorbs several times more than just below it."""
    silicon, cdte = sensor_material("Si"), sensor_material("CdTe")
    edge_A = 12398.42 / 1838.9
    assert silicon.attenuation_length_um(edge_A * 1.001) > 5 * silicon.attenuation_length_um(edge_A * 0.999)
    cd_k_edge_A = 12398.42 / 26711.0
    assert cdte.attenuation_length_um(cd_k_edge_A * 1.001) > 2 * cdte.attenuation_length_um(cd_k_edge_A * 0.999)


@pytest.mark.skipif(shutil.which("cctbx.python") is None, reason="cctbx (DIALS) not installed: apt-get install dials")
@pytest.mark.parametrize("material", sorted(MATERIALS))
def test_attenuation_is_what_dxtbx_models_parallax_with(material):
    """dxtbx takes μ from cctbx's tables at the wavelength: nbsim's sensor absorbs the same (0.5 %)."""
    wavelengths_A = (0.45, 0.62, 0.8, 0.9795, 1.0, 1.3, 1.54, 2.0)
    script = ("from cctbx.eltbx import attenuation_coefficient as a\n"
              f"t = a.get_table('{material}')\n"
              f"print(*[1e4 / t.mu_at_angstrom(w) for w in {wavelengths_A!r}])")
    done = subprocess.run(["cctbx.python", "-c", script], capture_output=True, text=True, check=True)
    expected_um = [float(v) for v in done.stdout.split()]
    found_um = [sensor_material(material).attenuation_length_um(w) for w in wavelengths_A]
    assert found_um == pytest.approx(expected_um, rel=5e-3)


SENSOR = "-default_F 1 -cell 50 50 50 90 90 90 -detpixels 16 -detector_thick 450".split()


@pytest.mark.parametrize("flags, material, wavelength_A, source", [
    ("-sensor_material Si", "Si", 1.0, "-sensor_material"),
    ("-sensor_material CdTe -lambda 0.8", "CdTe", 0.8, "-sensor_material"),
    ("-physics corrected -lambda 0.5", "Si", 0.5, "-physics corrected"),
    ("-detector_model eiger2cdte16m", "CdTe", 1.0, "-detector_model eiger2cdte16m"),
])
def test_a_physical_sensor_takes_the_materials_attenuation_length(flags, material, wavelength_A, source):
    """-sensor_material, a -detector_model or -physics corrected: a thickness without -detector_abs absorbs as
    the material does at λ, and the command line says so."""
    config, run = parse([*SENSOR, *flags.split()])
    assert config.detector.sensor_material == material
    length_um = sensor_material(material).attenuation_length_um(wavelength_A)
    assert config.detector.sensor_absorption_depth_um == length_um
    assert resolve(config).sensor.mu_per_m == pytest.approx(1e6 / length_um)
    assert run.sensor_attenuation_source == f"{material}'s at {wavelength_A:g} A ({source})"


@pytest.mark.parametrize("flags", ["", "-lambda 0.5", "-detector_thicksteps 4"])
def test_nanobraggs_physics_keeps_its_attenuation_depth(flags):
    """Under -physics nanobragg with no material asked for, nanoBragg's rule: μ = 1/thickness (its log prints
    mu= 2222.22 for 450 µm; tests/data/c_cases hold the C's images)."""
    config, run = parse([*SENSOR, *flags.split()])
    assert config.detector.sensor_absorption_depth_um is None
    assert resolve(config).sensor.mu_per_m == pytest.approx(1 / 450e-6)
    assert run.sensor_attenuation_source.startswith("nanoBragg's default, the thickness")


def test_a_given_attenuation_depth_wins():
    for flags in ("", "-physics corrected", "-sensor_material CdTe"):
        config, run = parse([*SENSOR, "-detector_abs", "100", *flags.split()])
        assert config.detector.sensor_absorption_depth_um == 100 and run.sensor_attenuation_source == \
            "given by -detector_abs"
    config, run = parse([])
    assert config.detector.sensor_absorption_depth_um is None and run.sensor_attenuation_source is None


def test_unknown_material_is_a_one_line_error(capsys):
    assert main([*SMALL, "-detector_thick", "450", "-sensor_material", "Ge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "-sensor_material expects one of Si, CdTe" in err and "\n" not in err


@pytest.mark.parametrize("material, header", [("Si", "Silicon"), ("CdTe", "CdTe")])
def test_headers_describe_the_simulated_sensor(material, header, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*SMALL, "-detector_thick", "300", "-sensor_material", material, "-cbffile", "image.cbf"]) == 0
    contents = fabio.open("image.cbf").header["_array_data.header_contents"]
    assert f"# {header} sensor, thickness 0.000300 m" in contents
    length_m = sensor_material(material).attenuation_length_um(1.0) * 1e-6
    line = next(line for line in contents.splitlines() if line.startswith("# nbsim sensor "))
    words = line.split()
    assert words[3] == material and float(words[5]) == pytest.approx(300e-6)
    assert float(words[7]) == pytest.approx(length_m, rel=1e-5)


def test_sampling_advice_follows_the_spot_width():
    """The narrowest spot is 0.886·d_min/(N·cell) wide; the advice puts 3 φ steps across it."""
    args = "-cell 100 100 100 90 90 90 -N 10 -lambda 1 -distance 200 -detpixels 256 -pixel 0.4 -osc 0.5".split()
    advice = config_sampling_advice(config_from_args(args))
    half_diagonal_mm = (51.2 + 0.4) * math.sqrt(2)  # MOSFLM's beam: Fbeam = Sbeam = centre + one pixel
    d_min_A = 1.0 / (2 * math.sin(math.atan(half_diagonal_mm / 200) / 2))
    assert advice.d_min_A == pytest.approx(d_min_A, rel=1e-3)
    assert advice.spot_width_deg == pytest.approx(math.degrees(SINC_FWHM * d_min_A / 1000), rel=1e-3)
    assert advice.phi_steps == math.ceil(3 * 0.5 / advice.spot_width_deg)
    assert config_sampling_advice(config_from_args([*args, "-N", "20"])).phi_steps >= 2 * advice.phi_steps - 1
    assert config_sampling_advice(config_from_args(args[:-2])).phi_steps == 1  # a still
    assert advice.mosaic_domains == 1
    mosaic = config_sampling_advice(config_from_args([*args, "-mosaic", "0.5"]))
    assert mosaic.mosaic_domains == math.ceil((3 * 0.5 / advice.spot_width_deg) ** 2)


def test_coarse_sampling_is_warned_about_and_advised_sampling_is_not():
    args = ("-cell 100 100 100 90 90 90 -default_F 1 -N 10 -lambda 1 -distance 200 -detpixels 64 -pixel 1.6 "
            "-osc 0.5").split()
    advice = config_sampling_advice(config_from_args(args))
    coarse = resolve(config_from_args([*args, "-phisteps", str(advice.phi_steps - 1)])).warnings
    assert any(f"recommend -phisteps {advice.phi_steps}" in w for w in coarse)
    fine = resolve(config_from_args([*args, "-phisteps", str(advice.phi_steps)])).warnings
    assert not any("phisteps" in w for w in fine)
    few_domains = resolve(config_from_args([*args, "-phisteps", str(advice.phi_steps), "-mosaic", "0.5",
                                            "-mosaic_dom", "2"])).warnings
    assert any("recommend -mosaic_domains" in w for w in few_domains)


def test_the_shipped_model_reads_the_same_in_both_formats():
    """config/examples ships the model as mmCIF and PDB (docs/formats.md): both give the same P1 table."""
    from pathlib import Path

    import numpy as np

    from nbsim.resolve import p1_reflections

    examples = Path(__file__).resolve().parents[1] / "config" / "examples"
    tables = [p1_reflections(config_from_args(["-model", str(examples / name), "-N", "2", "-detpixels", "32",
                                               "-pixel", "0.4", "-distance", "60"]))
              for name in ("model.cif", "model.pdb")]
    assert tables[0].shape == tables[1].shape and len(tables[0]) > 1000
    np.testing.assert_allclose(tables[0], tables[1], rtol=1e-3, atol=1e-3)


def test_advised_sampling_renders_the_advised_counts_and_keeps_given_ones():
    """-sampling advised: the φ steps and mosaic domains the flags leave out are the advice's (the set-up
    renders them and warns no more), never below nanoBragg's defaults; -phisteps, -phistep and -mosaic_dom
    given are kept."""
    args = ("-cell 100 100 100 90 90 90 -default_F 1 -N 10 -lambda 1 -distance 200 -detpixels 64 -pixel 1.6 "
            "-osc 0.5 -mosaic 0.4 -sampling advised").split()
    advice = config_sampling_advice(config_from_args(args))
    assert advice.phi_steps > 2 and advice.mosaic_domains > 10
    setup = resolve(config_from_args(args))
    assert (setup.phi.steps, setup.mosaic.count) == (advice.phi_steps, advice.mosaic_domains)
    assert not any("recommend -phisteps" in w or "recommend -mosaic_domains" in w for w in setup.warnings)
    given = resolve(config_from_args([*args, "-phisteps", "3", "-mosaic_dom", "4"]))
    assert (given.phi.steps, given.mosaic.count) == (3, 4)
    assert resolve(config_from_args([*args, "-phistep", "0.25"])).phi.steps == 2
    nanobragg = resolve(config_from_args([*args[:-2]]))
    assert (nanobragg.phi.steps, nanobragg.mosaic.count) == (2, 10)
    broad = resolve(config_from_args([*args, "-N", "1", "-mosaic", "0.01"]))  # the advice: 1 step, 1 domain
    assert (broad.phi.steps, broad.mosaic.count) == (2, 10)


def test_sampling_takes_only_its_two_words():
    from nbsim.errors import NbsimError

    with pytest.raises(NbsimError, match="-sampling expects one of nanobragg, advised"):
        config_from_args(["-sampling", "fine"])


@pytest.mark.parametrize("geometry", ["-fdet_vector 0 0 1 -sdet_vector 1 0 0 -odet_vector 0 1 0", "-twotheta 90"])
def test_automatic_oversample_is_one_where_the_beam_runs_along_the_detector(geometry):
    """A detector normal across the beam puts the detector at distance 0 (custom vectors) or 1e-17 m (-twotheta
    90): nanoBragg's automatic oversample, 3·crystal size/distance cast to int (INT_MIN past its range), comes out
    1, as its log of these geometries says ("auto-selected 1-fold")."""
    setup = resolve(config_from_args(f"-default_F 10 -cell 100 100 100 90 90 90 -N 2 -detpixels 8 {geometry}".split()))
    assert abs(float(setup.geometry.distance_m)) < 1e-12 and setup.oversample == 1
