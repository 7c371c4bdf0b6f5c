"""Structure factors from MTZ, sf-mmCIF and atomic models (-hkl, -column, -model, -p1_out): the files are
built here with gemmi, in space groups other than P1, and must give the image their P1 text table gives."""

from __future__ import annotations

from pathlib import Path

import gemmi
import numpy as np
import pytest
import torch

from benchmarks.model_workloads import write_model
from nbsim import config_from_args, simulate
from nbsim.cli import main
from nbsim.errors import NbsimError
from nbsim.io.structure_files import read_reflection_file
from nbsim.resolve import resolve

CELL = (40.0, 40.0, 60.0, 90.0, 90.0, 90.0)
SPACE_GROUP = "P 43 21 2"
IMAGE = "-lambda 1 -distance 40 -detpixels 64 -N 5 -misset 10 20 30 -compile off".split()
CELL_ARGS = ["-cell", *(f"{v:g}" for v in CELL)]


def _unique_reflections(d_min_A: float = 2.5) -> np.ndarray:
    return np.asarray(gemmi.make_miller_array(gemmi.UnitCell(*CELL), gemmi.SpaceGroup(SPACE_GROUP), d_min_A))


def _mtz(path: Path, columns: dict[str, tuple[str, np.ndarray]], miller: np.ndarray) -> str:
    """An MTZ in SPACE_GROUP with the given (type, values) columns."""
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(SPACE_GROUP)
    mtz.set_cell_for_all(gemmi.UnitCell(*CELL))
    mtz.add_dataset("crystal")
    for label, (kind, _) in columns.items():
        mtz.add_column(label, kind)
    mtz.set_data(np.column_stack([miller, *(values for _, values in columns.values())]).astype(np.float32))
    mtz.write_to_file(str(path))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The same amplitudes as an MTZ (F, SIGF), an sf-mmCIF and a P1 text table over the full sphere."""
    folder = tmp_path_factory.mktemp("structure_files")
    miller = _unique_reflections()
    # one decimal: what the mmCIF keeps of an MTZ value
    amplitudes = np.round(np.random.default_rng(7).uniform(10, 1000, len(miller)), 1).astype(np.float32)
    mtz_path = _mtz(folder / "f.mtz", {"FP": ("F", amplitudes), "SIGFP": ("Q", amplitudes / 10)}, miller)
    mtz = gemmi.read_mtz_file(mtz_path)
    (folder / "f.cif").write_text(gemmi.MtzToCif().write_cif_to_string(mtz))
    mtz.expand_to_p1()
    hemisphere = np.column_stack([mtz.make_miller_array(), mtz.column_with_label("FP").array])
    friedel = np.column_stack([-hemisphere[:, :3], hemisphere[:, 3]])
    table = np.unique(np.concatenate([hemisphere, friedel]), axis=0)
    (folder / "p1.hkl").write_text("".join(f"{h:.0f} {k:.0f} {l:.0f} {f:.9g}\n" for h, k, l, f in table))
    return {"mtz": mtz_path, "mmcif": str(folder / "f.cif"), "text": str(folder / "p1.hkl"), "folder": str(folder)}


def _image(argv: list[str]) -> np.ndarray:
    return simulate(config_from_args(argv), dtype=torch.float64, compile="off").numpy()


def test_mtz_mmcif_and_p1_table_give_the_same_image(files):
    reference = _image(["-hkl", files["text"], *CELL_ARGS, *IMAGE])
    assert reference.max() > 0
    for kind in ("mtz", "mmcif"):
        image = _image(["-hkl", files[kind], *CELL_ARGS, *IMAGE])
        assert np.corrcoef(image.ravel(), reference.ravel())[0, 1] >= 0.99999, kind
        np.testing.assert_allclose(image, reference, rtol=1e-6)


def test_p1_table_covers_the_sphere_without_absences(files):
    table = read_reflection_file(files["mtz"]).reflections
    text = np.loadtxt(files["text"])
    assert len(table) == len(text)
    np.testing.assert_allclose(table, text[np.lexsort(text[:, 2::-1].T)], rtol=1e-6)
    absent = gemmi.SpaceGroup(SPACE_GROUP).operations().systematic_absences(table[:, :3].astype(np.int32))
    assert not absent.any() and not ((table[:, 0] == 0) & (table[:, 1] == 0) & (table[:, 2] % 4 != 0)).any()


def test_cell_and_column_come_from_the_file(files, capsys):
    config = config_from_args(["-hkl", files["mtz"], *IMAGE])
    assert config.crystal.cell_A_deg == pytest.approx(CELL)
    assert config.structure.column is None
    floatfile = Path(files["folder"]) / "img.bin"
    assert main(["-hkl", files["mtz"], *IMAGE, "-detpixels", "8", "-floatfile", str(floatfile), "-nopgm",
                 "-nonoise", "-intfile", str(Path(files["folder"]) / "img.img")]) == 0
    assert f"structure factors from {files['mtz']} column FP (amplitudes)" in capsys.readouterr().out


def test_cell_differing_from_the_file_and_default_F_warn(files):
    quiet = resolve(config_from_args(["-hkl", files["mtz"], *CELL_ARGS, *IMAGE]))
    assert quiet.warnings == []
    other_cell = ["-cell", "40", "40", "61", "90", "90", "90", "-default_F", "5"]
    warnings = resolve(config_from_args(["-hkl", files["mtz"], *other_cell, *IMAGE])).warnings
    assert any("differs from the cell of" in w for w in warnings)
    assert sum("-default_F 5" in w for w in warnings) == 1


def test_intensity_column_becomes_amplitudes(tmp_path):
    miller = _unique_reflections(5.0)
    intensities = np.linspace(-4.0, 400.0, len(miller))
    path = _mtz(tmp_path / "i.mtz", {"IMEAN": ("J", intensities), "SIGIMEAN": ("Q", np.ones(len(miller)))}, miller)
    table = read_reflection_file(path)
    assert table.from_intensities and "IMEAN" in table.source
    by_index = {tuple(row[:3].astype(int)): row[3] for row in table.reflections}
    for hkl, intensity in zip(miller, intensities, strict=True):
        assert by_index[tuple(hkl)] == pytest.approx(np.sqrt(max(intensity, 0.0)), rel=1e-6)
    warnings = resolve(config_from_args(["-hkl", path, *IMAGE])).warnings
    assert sum("intensities, used as amplitudes" in w for w in warnings) == 1


def test_anomalous_pair_halves_go_to_their_side(tmp_path):
    miller = _unique_reflections(5.0)
    plus, minus = np.full(len(miller), 100.0), np.full(len(miller), 50.0)
    path = _mtz(tmp_path / "anom.mtz", {"F(+)": ("G", plus), "SIGF(+)": ("L", plus / 10), "F(-)": ("G", minus),
                                        "SIGF(-)": ("L", minus / 10)}, miller)
    table = read_reflection_file(path, "F(-)")
    assert table.source.startswith("column F(+)/F(-)")
    by_index = {tuple(row[:3].astype(int)): row[3] for row in table.reflections}
    ops = gemmi.SpaceGroup(SPACE_GROUP).operations()
    for hkl in miller[:50]:
        if ops.is_reflection_centric(hkl.tolist()):
            continue
        for op in ops.sym_ops:
            mate = tuple(op.apply_to_hkl(hkl.tolist()))
            assert by_index[mate] == 100.0 and by_index[tuple(-np.array(mate))] == 50.0


@pytest.mark.parametrize("problem", ["unknown column", "no usable column", "corrupt MTZ", "corrupt mmCIF",
                                     "mmCIF without space group", "column of a text table"])
def test_bad_structure_files_are_one_line_errors(files, tmp_path, capsys, problem):
    miller = _unique_reflections(5.0)
    cases = {
        "unknown column": (["-hkl", files["mtz"], "-column", "FOO"], "no column FOO (columns: H, K, L, FP, SIGFP)"),
        "no usable column": (["-hkl", _mtz(tmp_path / "s.mtz", {"SIGFP": ("Q", np.ones(len(miller)))}, miller)],
                             "no amplitude or intensity column"),
        "corrupt MTZ": (["-hkl", str(_write(tmp_path / "bad.mtz", b"MTZ " + b"\0" * 64))], "bad.mtz: not a readable"),
        "corrupt mmCIF": (["-hkl", str(_write(tmp_path / "bad.cif", b"data_x\nloop_\n_refln.index_h\n"
                                              b"_refln.index_k\n_refln.F_meas_au\n1 2\n"))], "bad.cif: not a readable"),
        "mmCIF without space group": (["-hkl", str(_write(tmp_path / "p.cif", b"data_x\nloop_\n_refln.index_h\n"
                                                          b"_refln.index_k\n_refln.index_l\n_refln.F_meas_au\n"
                                                          b"1 2 3 4\n")), *CELL_ARGS], "p.cif: no space group"),
        "column of a text table": (["-hkl", files["text"], "-column", "FP"], "a text table has no columns"),
    }
    argv, message = cases[problem]
    floatfile = tmp_path / "out.bin"
    assert main([*argv, *IMAGE, "-floatfile", str(floatfile)]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not floatfile.exists()


def _write(path: Path, payload: bytes) -> Path:
    path.write_bytes(payload)
    return path


def _model(path: Path, atoms: int = 36) -> str:
    """A few dozen atoms of mixed elements, B factors and occupancies in P 1 21 1, written as PDB."""
    write_model(path, atoms, cell_A_deg=(30.0, 35.0, 40.0, 90.0, 105.0, 90.0), space_group="P 1 21 1", seed=3)
    return str(path)


def test_model_structure_factors_match_direct_summation(tmp_path):
    path = _model(tmp_path / "m.pdb")
    config = config_from_args(["-model", path, *IMAGE])
    assert config.crystal.cell_A_deg == pytest.approx((30.0, 35.0, 40.0, 90.0, 105.0, 90.0))
    setup = resolve(config)
    assert "structure factors" not in " ".join(setup.warnings)
    table = setup.p1_table.reflections
    structure = gemmi.read_structure(path)
    calculator = gemmi.StructureFactorCalculatorX(structure.cell)
    expected = np.array([abs(calculator.calculate_sf_from_model(structure[0], [int(i) for i in row[:3]]))
                         for row in table])
    assert np.max(np.abs(table[:, 3] - expected) / expected) <= 1e-4
    # every node a pixel of this detector can look up is in the table
    hkl = (setup.cells_A[0] @ _corner_scattering_vectors(setup).T).T
    assert (np.abs(hkl.numpy()).max(axis=0) + 2 <= np.abs(table[:, :3]).max(axis=0)).all()
    assert _image(["-model", path, *IMAGE]).max() > 0


def _corner_scattering_vectors(setup) -> torch.Tensor:
    g = setup.geometry
    extent_f, extent_s = g.pixels_f * g.pixel_size_m, g.pixels_s * g.pixel_size_m
    corners = torch.stack([g.pix0_m + f * g.fdet + s * g.sdet for f in (0, extent_f) for s in (0, extent_s)])
    directions = corners / torch.linalg.vector_norm(corners, dim=1, keepdim=True)
    return (directions - setup.sources.incident[0]) / setup.sources.wavelength_A[0]


@pytest.mark.parametrize("problem", ["no atoms", "no cell"])
def test_bad_models_are_one_line_errors(tmp_path, capsys, problem):
    if problem == "no atoms":
        (tmp_path / "m.pdb").write_text("CRYST1   30.000   35.000   40.000  90.00 105.00  90.00 P 1 21 1\nEND\n")
        message = "the model has no atoms"
    else:
        text = Path(_model(tmp_path / "full.pdb")).read_text()
        (tmp_path / "m.pdb").write_text("".join(line + "\n" for line in text.splitlines()
                                                if not line.startswith("CRYST1")))
        message = "the model has no unit cell"
    assert main(["-model", str(tmp_path / "m.pdb"), *IMAGE, "-floatfile", str(tmp_path / "o.bin")]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "o.bin").exists()


def test_library_sweep_and_p1_out(files, tmp_path, capsys):
    """config_from_args takes -column, p1_reflections gives the table, -p1_out writes it as text that
    renders the same image, and a sweep's -hkl and -model values are read before any job."""
    from nbsim import p1_reflections
    from nbsim.nanobragg.rules import RULES
    from nbsim.sweep.validate import validate_config

    from .test_sweep import SCHEMA, config_with

    for flag in ("-column", "-model", "-p1_out"):
        assert not any(predicate(flag) for predicate, *_ in RULES), f"a nanoBragg rule captures {flag}"
    argv = ["-hkl", files["mtz"], "-column", "FP", *IMAGE]
    assert config_from_args(argv).structure.column == "FP"
    table = p1_reflections(config_from_args(argv))
    np.testing.assert_array_equal(table, read_reflection_file(files["mtz"]).reflections)
    written = tmp_path / "p1.hkl"
    assert main([*argv, "-detpixels", "8", "-p1_out", str(written), "-floatfile", str(tmp_path / "a.bin"),
                 "-nopgm", "-nonoise", "-intfile", str(tmp_path / "a.img")]) == 0
    assert "P1 table used" in capsys.readouterr().out
    np.testing.assert_array_equal(np.loadtxt(written), table)
    np.testing.assert_array_equal(_image(["-hkl", str(written), *CELL_ARGS, *IMAGE]), _image(argv))

    _model(tmp_path / "good.pdb")
    (tmp_path / "empty.pdb").write_text("CRYST1   30.000   35.000   40.000  90.00 105.00  90.00 P 1 21 1\nEND\n")
    (tmp_path / "bad.mtz").write_bytes(b"MTZ " + b"\0" * 64)
    Path(tmp_path / "f.mtz").write_bytes(Path(files["mtz"]).read_bytes())
    seed = "-default_F 0 -lambda 1 -distance 40 -N 5"
    config = config_with({"-model": ["good.pdb", "empty.pdb"]})
    config["scenarios"]["seed"]["args"] = seed
    with pytest.raises(NbsimError, match=r"value 'empty.pdb' .*the model has no atoms"):
        validate_config(config, SCHEMA, tmp_path)
    config = config_with({"-hkl": ["f.mtz", "bad.mtz"]})
    config["scenarios"]["seed"]["args"] = seed
    with pytest.raises(NbsimError, match=r"value 'bad.mtz' .*bad.mtz: not a readable MTZ"):
        validate_config(config, SCHEMA, tmp_path)
    config = config_with({"-hkl": ["f.mtz"]})
    config["scenarios"]["seed"]["args"] = seed
    config["reference"] = {"c_binary": "/bin/true"}
    with pytest.raises(NbsimError, match=r"nanoBragg reads only h k l F text tables"):
        validate_config(config, SCHEMA, tmp_path)


def test_table_provenance_traces_the_file_by_its_content(tmp_path):
    """The ground truth the image headers and the sweep's records keep: the file, its column, its SHA-256."""
    import hashlib

    from nbsim.io.structure_files import table_provenance

    table = tmp_path / "p1.hkl"
    table.write_text("0 0 1 10\n1 0 0 20\n")
    config = config_from_args(["-hkl", str(table), *IMAGE])
    assert table_provenance(config.structure) == {"file": str(table), "column": "",
                                                  "sha256": hashlib.sha256(table.read_bytes()).hexdigest()}
    assert table_provenance(config_from_args(["-default_F", "10", *IMAGE]).structure) is None


def test_a_model_given_as_reflections_says_to_use_model(tmp_path, capsys):
    path = _model(tmp_path / "m.pdb")
    assert main(["-hkl", path, *IMAGE, "-floatfile", str(tmp_path / "f.bin")]) == 2
    assert "an atomic model, not reflections: give it as -model" in capsys.readouterr().err
    assert not (tmp_path / "f.bin").exists()


def test_reflections_without_a_cell_name_the_file(tmp_path, capsys):
    """Without -cell and -mat the cell must come from the file: one without one is named, exit 2."""
    path = tmp_path / "nocell.cif"
    path.write_text("data_x\n_symmetry.space_group_name_H-M 'P 1'\nloop_\n_refln.index_h\n_refln.index_k\n"
                    "_refln.index_l\n_refln.F_meas_au\n1 0 0 10\n0 1 0 20\n")
    assert main(["-hkl", str(path), *IMAGE, "-floatfile", str(tmp_path / "f.bin")]) == 2
    assert f"{path}: the file gives no unit cell: give -cell or -mat" in capsys.readouterr().err
    assert not (tmp_path / "f.bin").exists()


def test_parsed_files_parse_once_keep_the_newest_and_keep_no_failure():
    from nbsim.io.structure_files import ParsedFiles

    parsed: list[str] = []
    files = ParsedFiles(capacity=2)

    def parse(name: str):
        return lambda: parsed.append(name) or name.upper()

    assert [files.get(k, parse(k)) for k in ("a", "a", "b", "c", "b")] == ["A", "A", "B", "C", "B"]
    assert parsed == ["a", "b", "c"] and len(files) == 2
    assert files.get("a", parse("a")) == "A" and parsed[-1] == "a"  # the oldest, "a", had been dropped

    def fail():
        raise ValueError("unreadable")

    with pytest.raises(ValueError):
        files.get("d", fail)
    assert files.get("d", parse("d")) == "D"
    files.clear()
    assert len(files) == 0
