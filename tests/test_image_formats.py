"""Images for processing software: -cbffile (miniCBF, read back with fabio) and -nxmxfile (NXmx, read back with
the nxmx reader DIALS uses); counts equal to the SMV images and headers that give back the simulated geometry."""

from __future__ import annotations

import re

import fabio
import h5py
import numpy as np
import pytest
import torch

import nbsim.detector.response as detector_response
from nbsim.cli import main
from nbsim.io.images import read_smv
from nbsim.model.geometry import build_geometry
from nbsim.nanobragg.arguments import parse

nxmx = pytest.importorskip("nxmx")

SMALL = ["-cell", "70", "80", "90", "90", "90", "90", "-default_F", "100", "-N", "4", "-detpixels", "40",
         "-pixel", "0.2", "-distance", "90", "-lambda", "1.2", "-compile", "off", "-seed", "7", "-nopgm",
         "-floatfile", "float.bin", "-intfile", "int.img", "-phi", "10", "-osc", "0.5", "-exposure", "2"]


def _render(tmp_path, monkeypatch, *extra: str) -> list[str]:
    monkeypatch.chdir(tmp_path)
    argv = [*SMALL, *extra]
    assert main(argv) == 0
    return argv


def _header(path) -> dict[str, str]:
    contents = fabio.open(str(path)).header["_array_data.header_contents"]
    return {match[1]: match[2].strip() for match in re.finditer(r"# (Silicon sensor, thickness|\S+) (.*)", contents)}


def test_cbf_counts_and_header_match_the_simulation(tmp_path, monkeypatch, capsys):
    argv = _render(tmp_path, monkeypatch, "-nonoise", "-detector_thick", "320", "-cbffile", "image.cbf")
    cbf = fabio.open(str(tmp_path / "image.cbf"))
    smv = fabio.open(str(tmp_path / "int.img"))
    assert cbf.data.dtype == np.int32
    np.testing.assert_array_equal(cbf.data + 40, smv.data)  # the SMV's -adc pedestal (40), not the miniCBF's
    assert cbf.header["_array_data.header_convention"] == "GENERIC_MINI"
    header = _header(tmp_path / "image.cbf")
    geometry = build_geometry(parse(argv)[0].detector)
    assert header["Pixel_size"] == "2.000000e-04 m x 2.000000e-04 m"
    assert header["Silicon sensor, thickness"] == "0.000320 m"
    assert header["Wavelength"] == "1.200000 A"
    assert float(header["Detector_distance"].split()[0]) == pytest.approx(0.090, abs=1e-6)
    fast, slow = (float(v) for v in re.findall(r"[-\d.]+", header["Beam_xy"]))
    assert (fast, slow) == pytest.approx((geometry.fbeam_m / 2e-4, geometry.sbeam_m / 2e-4), abs=0.005)
    assert header["Start_angle"] == "10.0000 deg."
    assert header["Angle_increment"] == "0.5000 deg."
    assert header["Exposure_time"] == header["Exposure_period"] == "2.0000000 s"
    assert header["Count_cutoff"] == "2147483647 counts"
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}$", fabio.open(str(tmp_path / "image.cbf"))
                    .header["_array_data.header_contents"].splitlines()[0][2:])
    assert "image.cbf" in capsys.readouterr().out


def test_cbf_holds_the_noise_image_when_there_is_one(tmp_path, monkeypatch):
    """The miniCBF's counts are the -noisefile's less its pedestal: one draw of the noise read out for both (as
    nanoBragg draws its noise once a run), not a second draw from the same seed."""
    draws = []
    poisson = detector_response._poisson
    monkeypatch.setattr(detector_response, "_poisson", lambda *args: draws.append(args) or poisson(*args))
    _render(tmp_path, monkeypatch, "-noisefile", "noise.img", "-cbffile", "image.cbf")
    assert len(draws) == 1
    np.testing.assert_array_equal(fabio.open(str(tmp_path / "image.cbf")).data + 40,
                                  fabio.open(str(tmp_path / "noise.img")).data)
    assert "Silicon sensor, thickness" not in _header(tmp_path / "image.cbf")


@pytest.mark.parametrize("flag", ["-cbffile", "-nxmxfile"])
def test_bad_output_path_is_a_one_line_error_before_rendering(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*SMALL, flag, "missing/out"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "missing" in captured.err
    assert "max_I" not in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == []


GEOMETRIES = {
    "mosflm": [],
    "twotheta": ["-twotheta", "20"],
    "rotations": ["-detector_rotx", "5", "-detector_roty", "-7", "-detector_rotz", "11", "-Xbeam", "3.3"],
    "xds": ["-xds", "-ORGX", "12.5", "-ORGY", "30"],
}


@pytest.mark.parametrize("case", GEOMETRIES)
def test_nxmx_reader_gives_back_the_simulated_geometry(case, tmp_path, monkeypatch):
    argv = _render(tmp_path, monkeypatch, "-nonoise", "-detector_thick", "100", *GEOMETRIES[case],
                   "-nxmxfile", "image.nxs")
    geometry = build_geometry(parse(argv)[0].detector)
    with h5py.File(tmp_path / "image.nxs") as handle:
        entry = nxmx.NXmx(handle).entries[0]
        assert entry.definition == "NXmx"
        assert entry.start_time <= entry.end_time
        detector = entry.instruments[0].detectors[0]
        module = detector.modules[0]
        np.testing.assert_array_equal(module.data_origin, [0, 0])
        np.testing.assert_array_equal(module.data_size, [40, 40])
        chain = nxmx.get_dependency_chain(module.fast_pixel_direction)
        assert [axis.path.split("/")[-1] for axis in chain] == ["fast_pixel_direction", "module_offset", "two_theta"]
        placement = nxmx.get_cumulative_transformation(chain[1:])[0]
        origin_mm = placement[:3, 3]
        fast = placement[:3, :3] @ module.fast_pixel_direction.vector
        slow = placement[:3, :3] @ module.slow_pixel_direction.vector
        assert module.fast_pixel_direction[()].to("mm").magnitude == pytest.approx([0.2])
        assert module.slow_pixel_direction[()].to("mm").magnitude == pytest.approx([0.2])
        reported_distance_mm = detector.distance.to("mm").magnitude
        reported_beam_fast_px = detector.beam_center_x.magnitude
        reported_beam_slow_px = detector.beam_center_y.magnitude
        assert detector.sensor_material == "Si"
        assert detector.sensor_thickness.to("mm").magnitude == pytest.approx(0.1)
        beam = entry.instruments[0].beams[0]
        assert beam.incident_wavelength.to("angstrom").magnitude == pytest.approx(1.2)
        assert beam.total_flux.magnitude > 0
        omega = nxmx.get_dependency_chain(entry.samples[0].depends_on)
        assert omega[0][()].to("deg").magnitude == pytest.approx([10.0])
        np.testing.assert_array_equal(entry.data[0][entry.data[0].signal][0] + 40,
                                      fabio.open(str(tmp_path / "int.img")).data)
        assert detector.saturation_value == 2**31 - 1
        assert detector.frame_time.to("s").magnitude == detector.count_time.to("s").magnitude == 2.0
        assert omega[0].end[()].to("deg").magnitude == pytest.approx([10.5])
    # The beam travels along +z in NeXus: where it meets the module, in pixels, and how far, must be nbsim's.
    normal = np.cross(fast, slow)
    distance_mm = origin_mm @ normal / normal[2]
    hit = np.array([0.0, 0.0, distance_mm]) - origin_mm
    along_beam_m = float(geometry.pix0_m @ geometry.odet / (geometry.beam @ geometry.odet))
    assert distance_mm == pytest.approx(along_beam_m * 1000.0, abs=1e-9)
    assert reported_distance_mm == pytest.approx(along_beam_m * 1000.0, abs=1e-9)
    nbsim_hit_m = (along_beam_m * geometry.beam - geometry.pix0_m).numpy()
    nbsim_beam_px = (nbsim_hit_m @ geometry.fdet.numpy() / 2e-4, nbsim_hit_m @ geometry.sdet.numpy() / 2e-4)
    assert (hit @ fast / 0.2, hit @ slow / 0.2) == pytest.approx(nbsim_beam_px, abs=1e-9)
    assert (reported_beam_fast_px, reported_beam_slow_px) == pytest.approx(nbsim_beam_px, abs=1e-9)
    # And every pixel sits at nbsim's angle from the beam and distance from the sample (a frame-free check).
    nbsim_beam = geometry.beam.numpy()
    for fast_px, slow_px in ((0.5, 0.5), (39.5, 3.5), (7.5, 38.5)):
        ours = (geometry.pix0_m.numpy() + (fast_px * geometry.fdet.numpy() + slow_px * geometry.sdet.numpy())
                * 2e-4) * 1000.0
        theirs = origin_mm + (fast_px * fast + slow_px * slow) * 0.2
        assert np.linalg.norm(theirs) == pytest.approx(np.linalg.norm(ours), abs=1e-9)
        assert theirs[2] / np.linalg.norm(theirs) == pytest.approx(ours @ nbsim_beam / np.linalg.norm(ours), abs=1e-12)


def _rotation_sweep(folder, phis_deg: list[float], osc_deg: str = "0.5", dtypes: list[str] | None = None):
    """A collated sweep.zarr of one batch whose points are a -phi series (images random, configs real); with
    `dtypes`, the points are along the dtype axis instead."""
    from nbsim.sweep.collate import point_rows, write_collated_store
    from nbsim.sweep.jobs import IMAGE_DIMENSIONS
    from nbsim.sweep.spec import dataclass_to_dict
    from nbsim.sweep.store import AtomicStore, write_json

    generator = np.random.default_rng(3)
    name = "n40-float32-cpu-compile_off-b0000"
    entries, images = [], generator.exponential(2.0, (len(phis_deg), 40, 40)).astype(np.float32)
    with AtomicStore(folder / name / "images.zarr", {}) as store:
        store.variable("image", IMAGE_DIMENSIONS, images.shape, np.float32, chunks=(1, 40, 40), data=images)
        store.commit()
    for index, phi in enumerate(phis_deg):
        argv = [*SMALL[:SMALL.index("-nopgm")], "-phi", str(phi), "-osc", osc_deg]
        axes = {"size": 40, "dtype": dtypes[index] if dtypes else "float32", "device": "cpu", "compile": "off",
                **({} if dtypes else {"phi": phi})}
        entries.append({"name": f"{name}-{index}", "reference": "", "size": 40, "index": index, "status": "ok",
                        "axes": axes,
                        "config": dataclass_to_dict(parse(argv)[0]), "argv": argv})
    write_json(folder / name / "records.json", {"scenario": "s", "batch": name, "points": entries})
    rows = point_rows([folder / name / "records.json"], [])
    write_collated_store(rows, {name: folder / name / "images.zarr"},
                         ["size", "dtype", "device", "compile", *([] if dtypes else ["phi"])], folder / "sweep.zarr")
    return images, parse(argv)[0]


def test_export_writes_a_rotation_series_as_nxmx_and_numbered_cbfs(tmp_path, capsys):
    from nbsim.cli.products import integer_image
    from nbsim.resolve import resolve

    phis = [10.0 + 0.5 * k for k in range(10)]
    images, config = _rotation_sweep(tmp_path, phis)
    assert main(["export", str(tmp_path / "sweep.zarr"), "--nxmx", str(tmp_path / "series.nxs"),
                 "--cbf", str(tmp_path / "frame")]) == 0
    out = capsys.readouterr().out
    assert "10 frames" in out and f"intfile_scale = {55000.0 / float(images.max()):g}" in out
    setup = resolve(config)
    expected = [integer_image(image, setup, 55000.0 / float(images.max()), 0.0, 2**31 - 1) for image in images]
    with h5py.File(tmp_path / "series.nxs") as handle:
        entry = nxmx.NXmx(handle).entries[0]
        omega = nxmx.get_dependency_chain(entry.samples[0].depends_on)[0]
        assert omega[()].to("deg").magnitude == pytest.approx(phis)
        frames = entry.data[0][entry.data[0].signal][()]
    assert frames.shape == (10, 40, 40)
    for k, phi in enumerate(phis):
        cbf = tmp_path / f"frame_{k + 1:05d}.cbf"
        np.testing.assert_array_equal(fabio.open(str(cbf)).data, expected[k])
        np.testing.assert_array_equal(frames[k], expected[k])
        assert float(_header(cbf)["Start_angle"].split()[0]) == pytest.approx(phi)
        assert _header(cbf)["Angle_increment"] == "0.5000 deg."


def test_export_refuses_what_is_not_one_series(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--nxmx", str(tmp_path / "x.nxs")]) == 2
    assert "not a sweep.zarr store" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "none.zarr"), "--nxmx", str(tmp_path / "x.nxs")]) == 2
    assert "none.zarr: no such file or folder" in capsys.readouterr().err
    _rotation_sweep(tmp_path, [0.0, 1.0])
    assert main(["export", str(tmp_path / "sweep.zarr")]) == 2
    assert "nothing to write" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "sweep.zarr"), "--cbf", str(tmp_path / "missing" / "f")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "sweep.zarr"), "--size", "many"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # Stills along another axis (the default sweep's dtypes) are no rotation series, though their -phi agree.
    _rotation_sweep(tmp_path / "stills", [0.0, 0.0], osc_deg="0", dtypes=["float32", "float64"])
    assert main(["export", str(tmp_path / "stills" / "sweep.zarr"), "--nxmx", str(tmp_path / "x.nxs")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "not one rotation series: 2 frames along dtype, none rotated (-osc 0)")
    assert not (tmp_path / "x.nxs").exists()


def test_cbf_header_reads_as_dxtbx_formatcbfmini_reads_it(tmp_path, monkeypatch):
    """dxtbx's FormatCBFMini._start and _detector (cctbx/dxtbx), replayed on the header's `#` records."""
    _render(tmp_path, monkeypatch, "-nonoise", "-detector_thick", "450", "-cbffile", "image.cbf")
    fields = {}
    for record in fabio.open(str(tmp_path / "image.cbf")).header["_array_data.header_contents"].splitlines():
        if len(record[1:].split()) <= 2 and record.count(":") == 2:
            fields["timestamp"] = record[1:].strip()
            continue
        tokens = record.replace("=", "").replace(":", "").split()
        fields[tokens[1]] = " ".join(tokens[2:])
    assert fields["timestamp"].startswith("20")
    assert [float(v) for v in fields["Pixel_size"].replace("m", "").replace("x", "").split()] == [2e-4, 2e-4]
    assert float(fields["Silicon"].split()[2]) * 1000.0 == pytest.approx(0.45)
    assert float(fields["Detector_distance"].split()[0]) == pytest.approx(0.09)
    assert [float(v) for v in fields["Beam_xy"].replace("(", "").replace(")", "").replace(",", "").split()[:2]] \
        == pytest.approx([21.0, 21.0])
    assert float(fields["Start_angle"].split()[0]) == 10.0 and float(fields["Angle_increment"].split()[0]) == 0.5
    assert int(fields["Count_cutoff"].split()[0]) == 2**31 - 1


@pytest.mark.parametrize("convention", ["-mosflm", "-denzo", "-adxv", "-xds", "-dials"])
def test_mcstas_frame_is_a_rotation_taking_the_beam_to_z(convention):
    from nbsim.cli.products import experiment_record
    from nbsim.io.detector_images import mcstas_rotation
    from nbsim.resolve import resolve

    record = experiment_record(resolve(parse([*SMALL, convention])[0]), noise_seed=None)
    rotation = mcstas_rotation(record)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(3), atol=1e-15)
    assert np.linalg.det(rotation) == pytest.approx(1.0)
    np.testing.assert_allclose(rotation @ np.array(record.beam_direction), [0, 0, 1], atol=1e-15)
    if convention == "-mosflm":
        np.testing.assert_allclose(rotation, [[0, 0, -1], [0, 1, 0], [1, 0, 0]], atol=1e-15)


def test_nxmx_sample_orientation_at_omega_is_the_rotated_a_matrix(tmp_path, monkeypatch):
    """The sample's ω rotation (right-handed about the spindle, by φ) applied to its UB gives nbsim's reciprocal
    vectors rotated by φ, in the McStas frame: the orientation nbsim rendered at its first φ step."""
    from nbsim.cli.products import experiment_record
    from nbsim.io.detector_images import mcstas_rotation
    from nbsim.resolve import resolve
    from nbsim.vectors import rotate_about_axis

    argv = _render(tmp_path, monkeypatch, "-nonoise", "-misset", "10", "20", "30", "-nxmxfile", "image.nxs")
    setup = resolve(parse(argv)[0])
    rotated = rotate_about_axis(setup.lattice.reciprocal_per_A, setup.geometry.spindle, torch.tensor(np.radians(10.0)))
    expected = mcstas_rotation(experiment_record(setup, None)) @ rotated.numpy().T
    with h5py.File(tmp_path / "image.nxs") as handle:
        sample = nxmx.NXmx(handle).entries[0].samples[0]
        omega = nxmx.get_cumulative_transformation(nxmx.get_dependency_chain(sample.depends_on))[0][:3, :3]
        ub = handle["/entry/sample/ub_matrix"][0]
    np.testing.assert_allclose(omega @ ub, expected, atol=1e-12)


def test_headers_name_the_structure_factor_table_and_its_content_hash(tmp_path, monkeypatch):
    """Ground truth beside the image: the -hkl file, and the SHA-256 of its content, in both headers."""
    import hashlib

    table = tmp_path / "p1.hkl"
    table.write_text("".join(f"{h} {k} {l} {10 + h + k + l}\n" for h in range(-3, 4) for k in range(-3, 4)
                             for l in range(-3, 4)))
    _render(tmp_path, monkeypatch, "-hkl", str(table), "-nonoise", "-cbffile", "image.cbf", "-nxmxfile", "image.nxs")
    line = f"structure factors: {table} (h k l F text table), sha256 {hashlib.sha256(table.read_bytes()).hexdigest()}"
    assert line in fabio.open(str(tmp_path / "image.cbf")).header["_array_data.header_contents"]
    with h5py.File(tmp_path / "image.nxs") as nexus:
        notes = nexus["entry"]["notes"][()]
    assert line in (notes.decode() if isinstance(notes, bytes) else notes)


@pytest.mark.parametrize("tilt", [["-twotheta", "20"], ["-detector_rotx", "5"]])
def test_a_tilted_detector_refuses_a_mini_cbf(tilt, tmp_path, monkeypatch, capsys):
    """A miniCBF cannot place a tilted detector: one line naming -nxmxfile, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert main([*SMALL, *tilt, "-nonoise", "-cbffile", "image.cbf"]) == 2
    assert "write -nxmxfile instead" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_int32_counts_clamp_at_saturation_and_add_a_pedestal_only_when_asked(tmp_path, monkeypatch, capsys):
    """The miniCBF and NXmx counts: round(value·scale) up to -saturation (no 65535), plus -adc only when given;
    the SMV image keeps nanoBragg's pedestal and 16-bit clamp."""
    _render(tmp_path, monkeypatch, "-nonoise", "-scale", "1e6", "-saturation", "100000", "-cbffile", "image.cbf",
            "-nxmxfile", "image.nxs")
    floats = np.fromfile(tmp_path / "float.bin", dtype=np.float32).reshape(40, 40).astype(np.float64)
    expected = np.minimum(np.floor(floats * 1e6 + 0.5), 100000)
    assert expected.max() == 100000 and (floats * 1e6 > 65535).sum() > 10
    cbf = fabio.open(str(tmp_path / "image.cbf"))
    np.testing.assert_array_equal(cbf.data, expected)
    assert _header(tmp_path / "image.cbf")["Count_cutoff"] == "100000 counts"
    with h5py.File(tmp_path / "image.nxs") as handle:
        np.testing.assert_array_equal(handle["entry/data/data"][0], expected)
        assert handle["entry/instrument/detector/saturation_value"][()] == 100000
    saturated = int((expected == 100000).sum())
    out = capsys.readouterr().out
    assert f"WARNING: {saturated} pixels at the saturation (100000 counts, -saturation) of the miniCBF and NXmx" in out
    assert "lower -scale" in out and "raise -saturation" in out  # -nonoise: the -intfile image's counts
    smv = fabio.open(str(tmp_path / "int.img")).data  # rounded in float32, as nanoBragg does: within 1
    assert np.abs(smv - np.minimum(np.floor(floats * 1e6 + 40 + 0.5), 65535)).max() <= 1 and smv.max() == 65535
    _render(tmp_path, monkeypatch, "-nonoise", "-scale", "1e6", "-adc", "10", "-cbffile", "pedestal.cbf")
    np.testing.assert_array_equal(fabio.open(str(tmp_path / "pedestal.cbf")).data, np.floor(floats * 1e6 + 10.5))
    assert "at the saturation" not in capsys.readouterr().out


def test_saturation_values_outside_int32_are_refused_and_a_useless_one_is_noted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for value in ("2147483648", "0", "-5", "1.5"):
        assert main([*SMALL, "-saturation", value, "-cbffile", "x.cbf"]) == 2
        assert capsys.readouterr().err.startswith("nbsim: error: -saturation")
    assert not (tmp_path / "x.cbf").exists()
    _render(tmp_path, monkeypatch, "-nonoise", "-saturation", "1000")
    assert "-saturation sets the counts of -cbffile and -nxmxfile, and neither is written" in capsys.readouterr().out


def test_export_writes_noise_frames_each_with_its_seed_in_its_header(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    import nbsim.detector
    from nbsim.detector import detector_image, layout_of
    from nbsim.resolve import resolve

    phis = [10.0, 10.5, 11.0]
    images, config = _rotation_sweep(tmp_path, phis)
    draws = []
    monkeypatch.setattr(nbsim.detector, "detector_image", lambda *a, **k: draws.append(1) or detector_image(*a, **k))
    assert main(["export", str(tmp_path / "sweep.zarr"), "--noise-cbf", str(tmp_path / "noisy"),
                 "--noise-nxmx", str(tmp_path / "noisy.nxs"), "--seed", "500", "--saturation", "12"]) == 0
    out = capsys.readouterr().out
    assert "seeds 500 .. 502" in out and "intfile_scale" not in out  # no frame of -intfile counts is written
    assert len(draws) == len(phis)  # each frame's noise drawn once for both files
    setup = resolve(config)
    with h5py.File(tmp_path / "noisy.nxs") as handle:
        frames = handle["entry/data/data"][()]
        assert "noise seed of frame k: 500 + k - 1" in handle["entry/notes"][()].decode()
    for k in range(len(phis)):
        response = replace(config.response, noise_seed=500 + k, adc_offset_adu=0.0)
        expected = detector_image(torch.from_numpy(images[k]), response, layout_of(setup), saturation_adu=12).adu
        cbf = tmp_path / f"noisy_{k + 1:05d}.cbf"
        np.testing.assert_array_equal(fabio.open(str(cbf)).data, expected.numpy())
        np.testing.assert_array_equal(frames[k], expected.numpy())
        assert f"seeds: mosaic {config.crystal.mosaic_seed} misset {config.crystal.misset_seed} noise {500 + k}" \
            in fabio.open(str(cbf)).header["_array_data.header_contents"]
    assert not np.array_equal(frames[0], frames[1])
    assert frames.max() == 12 and frames.min() == 0
    assert sorted(p.name for p in tmp_path.glob("noisy_*.cbf")) == [f"noisy_{k:05d}.cbf" for k in (1, 2, 3)]


def test_an_smv_header_longer_than_512_bytes_takes_the_next_multiple_of_512(tmp_path, monkeypatch):
    """A tilted, rotated detector's header text outgrows 512 bytes (nanoBragg then writes it unpadded under
    HEADER_BYTES=512, so readers take its last bytes as pixels): nbsim writes HEADER_BYTES=1024, and the files
    read back, by nbsim and by fabio, as the float image scaled (-intfile) and as its noise (-noisefile)."""
    _render(tmp_path, monkeypatch, "-twotheta", "-15.78", "-detector_rotx", "1.23", "-detector_roty", "-2.71",
            "-phi", "10.37", "-osc", "0.531", "-noisefile", "noise.img", "-scale", "10")
    image = np.fromfile(tmp_path / "float.bin", dtype=np.float32).reshape(40, 40)
    for name in ("int.img", "noise.img"):
        header, pixels = read_smv(tmp_path / name)
        assert header.size == 1024 and header.last_value("HEADER_BYTES") == 1024
        assert (tmp_path / name).stat().st_size == 1024 + 2 * image.size
        np.testing.assert_array_equal(fabio.open(str(tmp_path / name)).data, pixels)
    _, ints = read_smv(tmp_path / "int.img")
    np.testing.assert_array_equal(ints, np.floor(np.clip(image.astype(np.float64) * 10 + 40, 0, 65535) + 0.5))


def test_a_named_pgm_takes_the_given_scale(tmp_path, monkeypatch):
    """-pgmfile with -pgmscale (nanoBragg's usual pair): the PGM holds the float image times the scale, truncated
    and clipped at 255, and says the scale."""
    monkeypatch.chdir(tmp_path)
    assert main([a for a in SMALL if a != "-nopgm"] + ["-pgmfile", "image.pgm", "-pgmscale", "2.5"]) == 0
    image = np.fromfile(tmp_path / "float.bin", dtype=np.float32).reshape(40, 40)
    data = (tmp_path / "image.pgm").read_bytes()
    assert data.startswith(b"P5\n40 40\n# pixels scaled by 2.5\n255\n")
    np.testing.assert_array_equal(np.frombuffer(data[-image.size:], np.uint8).reshape(40, 40),
                                  np.minimum(image * np.float64(2.5), 255).astype(np.uint8))


@pytest.mark.parametrize("physics", ["nanobragg", "corrected"])
def test_a_negative_pixel_reads_in_the_pgm_as_nanobraggs_cast_makes_it(physics, tmp_path, monkeypatch):
    """A detector swung past 90° faces away from the sample: ω and the image are negative. nanoBragg casts
    value·scale to a byte through an int, so -152.4 reads 104 (the C binary's PGM of this command, byte for
    byte); -physics corrected clips at 0."""
    monkeypatch.chdir(tmp_path)
    argv = ("-default_F 100 -cell 100 100 100 90 90 90 -N 2 -detpixels 8 -adxv -twotheta 100 -pgmscale 2000 "
            f"-nonoise -compile off -floatfile float.bin -pgmfile image.pgm -physics {physics}").split()
    assert main(argv) == 0
    values = np.trunc(np.fromfile("float.bin", dtype=np.float32).astype(np.float64) * 2000)
    assert (values < 0).all()
    pgm = np.frombuffer((tmp_path / "image.pgm").read_bytes()[-64:], np.uint8)
    np.testing.assert_array_equal(pgm, values % 256 if physics == "nanobragg" else np.zeros(64))
