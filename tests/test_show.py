"""`nbsim show`: what a command resolves to, without rendering or writing anything."""

from __future__ import annotations

import re

import pytest
import torch

from nbsim.cli import main
from nbsim.config import SimulationConfig, option_names
from nbsim.kernel.cache import KernelCache
from nbsim.kernel.structure import structure_of
from nbsim.nanobragg import config_from_args
from nbsim.sensors import sensor_material

ARGS = ("-default_F 100 -cell 100 100 100 90 90 90 -N 10 -lambda 1.0 -distance 200 -pixel 0.4 -mosaic 0.5 "
        "-mosaic_dom 3 -phi 0 -osc 0.5 -phisteps 2 -oversample 2 -detpixels 32 -divergence 1 -divsteps 2 "
        "-square_div -detector_thick 100 -detector_thicksteps 2 -detector_abs 50 -dtype float32").split()


def test_show_resolves_a_command_without_rendering(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["show", "--", *ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert list(tmp_path.iterdir()) == [], "show writes no file"
    text = "\n".join(lines)
    assert "detector: 32 x 32 pixels" in text
    assert ("steps per pixel: 192 = 4 source(s) x 3 mosaic domain(s) x 2 phi step(s) x 2 sensor layer(s) x "
            "4 sub-pixel(s)") in lines
    assert "oversample: 2 (-oversample)" in lines
    assert "sources: 4 = 4 divergence point(s) x 1 wavelength(s)" in lines
    structure = structure_of(config_from_args(ARGS))
    assert f"kernel structure: {structure.name}" in lines
    missing = KernelCache.default().missing(structure, torch.float32, torch.device("cpu"))
    variants = structure.stage_variants()
    cached = "all 2 cached" if not missing else f"{len(missing)} of {len(variants)} not cached"
    assert [line for line in lines if line.startswith("kernels (float32, cpu)")][0].split(": ", 1)[1].startswith(cached)
    [expected] = [line for line in lines if line.startswith("expected render:")]
    eager_s, compiled_s = map(float, re.findall(r"(?:eager|compiled) ([0-9.e+-]+) s", expected))
    assert eager_s > 0 and compiled_s > 0
    [advice] = [line for line in lines if line.startswith("sampling advice:")]
    assert advice.endswith("rendering 2 and 3, -sampling nanobragg)")
    assert not any(line.startswith("  warning:") for line in lines)  # sampled as finely as advised


def test_show_tells_what_advised_sampling_renders_and_where_flags_override_it(capsys):
    """-sampling advised fills the counts the flags leave out (no warning left); a count the flags give that is
    coarser than the advice is still warned about."""
    advised = ("-default_F 100 -cell 70 80 90 75 85 95 -N 20 -detpixels 256 -mosaic 0.5 -osc 0.5 -phisteps 3 "
               "-sampling advised").split()
    assert main(["show", "--", *advised]) == 0
    lines = capsys.readouterr().out.splitlines()
    [advice] = [line for line in lines if line.startswith("sampling advice:")]
    domains = re.search(r"(\d+) mosaic domain\(s\)", advice).group(1)
    assert advice.endswith(f"rendering 3 and {domains}, -sampling advised)") and int(domains) > 10
    assert not any("recommend -mosaic_domains" in line for line in lines)
    assert any("recommend -phisteps" in line for line in lines)  # -phisteps 3 given, coarser than advised


@pytest.mark.parametrize("flags, length", [
    ("", "100 um: nanoBragg's default, the thickness"),
    ("-detector_abs 50", "50 um: given by -detector_abs"),
    ("-sensor_material CdTe", f"{sensor_material('CdTe').attenuation_length_um(1.0):.4g} um: CdTe's at 1 A "
                              "(-sensor_material)"),
    ("-physics corrected", f"{sensor_material('Si').attenuation_length_um(1.0):.4g} um: Si's at 1 A "
                           "(-physics corrected)"),
])
def test_show_says_where_the_sensors_attenuation_length_comes_from(flags, length, capsys):
    args = "-default_F 100 -cell 100 100 100 90 90 90 -N 5 -detpixels 16 -pixel 0.4 -detector_thick 100".split()
    assert main(["show", "--", *args, *flags.split()]) == 0
    [sensor] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sensor:")]
    assert sensor.startswith(f"sensor: {'CdTe' if 'CdTe' in flags else 'Si'} 100 um in 2 layers, attenuation length "
                             f"{length}")


def test_show_lists_the_simulator_options(capsys):
    assert main(["show", "--options"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert listed == option_names()


def test_show_needs_a_command(capsys):
    assert main(["show"]) == 2
    assert capsys.readouterr().err.strip() == ("nbsim: error: show needs the nanoBragg options of a command: "
                                               "nbsim show -- <options>")
    assert main(["show", "--", "-lamda", "1"]) == 2
    assert "did you mean -lambda?" in capsys.readouterr().err


def test_a_misspelt_option_names_the_closest_and_the_command_listing_them():
    with pytest.raises(KeyError) as error:
        SimulationConfig().with_options(mosaic_spred_deg=0.2)
    assert "mosaic_spred_deg (did you mean mosaic_spread_deg?); nbsim show --options lists them" in str(error.value)


def test_the_render_command_names_the_kernel_mode_it_used(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    arguments = [*ARGS[:ARGS.index("-mosaic")], "-detpixels", "16", "-compile", "off", "-nonoise", "-nopgm"]
    assert main(arguments) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  kernel: ")]
    assert line.startswith("  kernel: eager (float32 on cpu; eager and compiled float32 images differ")
