"""The real DIALS imports nbsim's one-frame NXmx and miniCBF files as the simulation was (issue 34): a
one-image sweep with its oscillation and exposure, the sensor's thickness (none: a zero-thickness sensor
that dxtbx accepts), the saturation as the trusted range's top, and the flux where dxtbx reads one (the
miniCBF's `Flux`; dxtbx's NXmx reader reads no flux, so the NXmx's `total_flux` is read back with the nxmx
package). Skipped where DIALS is not installed (Debian: `apt-get install dials`)."""

from __future__ import annotations

import json
import shutil
import subprocess

import h5py
import pytest

from nbsim.cli import main

nxmx = pytest.importorskip("nxmx")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("dials.import") is None,
                                 reason="DIALS is not installed (dials.import not on PATH; Debian: apt-get install "
                                        "dials)")]

FRAME = ["-cell", "40", "50", "60", "90", "90", "90", "-default_F", "100", "-N", "5", "-detpixels", "64",
         "-pixel", "0.172", "-distance", "100", "-lambda", "1", "-compile", "off", "-seed", "3", "-phi", "12",
         "-osc", "0.25", "-exposure", "1.5", "-flux", "1e12", "-nopgm", "-saturation", "1048575",
         "-floatfile", "float.bin", "-intfile", "int.img", "-noisefile", "noise.img"]


def _run(commands: list[list[str]], folder) -> list[str]:
    """Run DIALS commands side by side (each is mostly start-up); their outputs, each having succeeded."""
    running = [subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for command in commands]
    outputs = [process.communicate(timeout=300)[0] for process in running]
    for command, process, output in zip(commands, running, outputs, strict=True):
        assert process.returncode == 0, f"{' '.join(command)} failed:\n{output[-3000:]}"
    return outputs


def test_dials_imports_one_frame_nxmx_and_cbf_as_a_sweep_with_and_without_a_sensor(tmp_path, monkeypatch):
    """NXmx and miniCBF, without a sensor and with 320 um of silicon, each imported alone (dials.import would
    give files whose detectors differ only in thickness one detector model)."""
    monkeypatch.chdir(tmp_path)
    thickness_mm = {}
    for name, sensor in (("bare", []), ("thick", ["-detector_thick", "320"])):
        assert main([*FRAME, *sensor, "-nxmxfile", f"{name}.nxs", "-cbffile", f"{name}_00001.cbf"]) == 0
        thickness_mm |= {f"{name}.nxs": 0.320 if sensor else 1e-6, f"{name}_00001.cbf": 0.320 if sensor else 0.0}
    _run([["dials.import", image, f"output.experiments={image}.expt", f"output.log={image}.log"]
          for image in thickness_mm], tmp_path)
    shown, = _run([["dials.show", *(f"{image}.expt" for image in thickness_mm)]], tmp_path)
    assert shown.count("oscillation:   {12,0.25}") == shown.count("exposure time: 1.5") == 4, shown
    for image, expected_mm in thickness_mm.items():
        experiments = json.loads((tmp_path / f"{image}.expt").read_text())
        assert [imageset["__id__"] for imageset in experiments["imageset"]] == ["ImageSequence"], image
        scan, = experiments["scan"]
        assert scan["image_range"] == [1, 1] and scan["oscillation"] == pytest.approx([12.0, 0.25]), image
        assert scan["exposure_time"] == pytest.approx([1.5]), image
        panel, = experiments["detector"][0]["panels"]
        assert panel["trusted_range"][1] == 1048575, image
        assert panel["thickness"] == pytest.approx(expected_mm, rel=1e-9, abs=1e-12), image
        if image.endswith(".cbf"):
            assert experiments["beam"][0]["flux"] == pytest.approx(1e12), image
        else:
            with h5py.File(tmp_path / image) as handle:
                beam = nxmx.NXmx(handle).entries[0].instruments[0].beams[0]
                assert beam.total_flux.to("Hz").magnitude == pytest.approx(1e12), image
