"""Bad input: a one-line error naming the problem, exit status 2, no traceback, no output files."""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from nbsim.cli import main

GOOD = ("-default_F 100 -cell 100 100 100 90 90 90 -lambda 6.2 -N 2 -distance 100 -detpixels 8 -compile off").split()
SMALL_HKL = "0 0 0 10\n1 0 0 20\n0 1 0 30\n"
REST = GOOD[:2] + GOOD[9:]
"""GOOD without its -cell."""


def _write(folder: Path, name: str, text: str | bytes) -> str:
    path = folder / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def _smv(folder: Path, name: str, width: int, height: int) -> str:
    header = f"{{\nHEADER_BYTES=512;\nDIM=2;\nBYTE_ORDER=little_endian;\nTYPE=unsigned_short;\nSIZE1={width};\n" \
             f"SIZE2={height};\nPIXEL_SIZE=0.1;\n}}\f"
    payload = header.encode().ljust(512, b" ") + struct.pack(f"<{width * height}H", *([1] * (width * height)))
    return _write(folder, name, payload)


def _pdb(cell_length: str, x: str) -> str:
    """A one-atom PDB model: a cubic cell of `cell_length` Å, its atom at (x, 2, 3) (PDB's fixed columns)."""
    return (f"CRYST1{cell_length:>9}{cell_length:>9}{cell_length:>9}  90.00  90.00  90.00 P 1\n"
            f"ATOM      1  CA  ALA A   1    {x:>8}   2.000   3.000  1.00 20.00           C\nEND\n")


def _cases(folder: Path) -> dict[str, tuple[list[str], str]]:
    """name → (arguments, text the message must contain)."""
    def hkl(name: str, text: str) -> str:
        return _write(folder, f"{name}.hkl", text)

    without_lambda = [a for a in GOOD if a not in ("-lambda", "6.2")]
    cases = {
        "unknown flag": (GOOD + ["-bogus"], "unknown option '-bogus'"),
        "misspelt flag": (GOOD + ["-lamda", "1"], "unknown option '-lamda' (did you mean -lambda?); see nbsim -h"),
        "stray value": (GOOD + ["42"], "unknown option '42'"),
        "missing value": (GOOD + ["-distance"], "-distance needs 1 value"),
        "non-numeric value": (GOOD + ["-distance", "far"], "-distance expects a number"),
        "non-integer count": (GOOD + ["-detpixels", "10.5"], "-detpixels expects an integer"),
        "zero pixels": (GOOD + ["-detpixels", "0"], "-detpixels must be positive"),
        "negative pixel size": (GOOD + ["-pixel", "-0.1"], "-pixel must be positive"),
        "zero wavelength": (GOOD + ["-lambda", "0"], "-lambda must be positive"),
        "negative wavelength": (without_lambda + ["-lambda", "-1"], "-lambda must be positive"),
        "two wavelengths": (GOOD + ["-energy", "12000"], "conflicting options -energy and -lambda"),
        "zero energy": (without_lambda + ["-energy", "0"], "-energy must be positive"),
        "negative mosaic": (GOOD + ["-mosaic", "-1"], "-mosaic must not be negative"),
        "conflicting interpolation": (GOOD + ["-interpolate", "-nointerpolate"], "conflicting options"),
        "conflicting shapes": (GOOD + ["-round_xtal", "-gauss_xtal"], "conflicting options"),
        "no pgm with a pgm scale": (GOOD + ["-nopgm", "-pgmscale", "2"], "conflicting options -nopgm and -pgmscale"),
        "bad dtype": (GOOD + ["-dtype", "float16"], "-dtype expects one of float32, float64"),
        "bad pivot": (GOOD + ["-pivot", "sideways"], "-pivot expects one of beam, sample"),
        "divergence cut leaves no source": (GOOD + "-hdivrange 0.5 -hdivstep 0.5 -vdivrange 0.5 -vdivstep 0.5".split(),
                                            "keeps none of the 1x1 divergence points"),
        "curved detector along the beam": (GOOD + "-fdet_vector 0 0 1 -sdet_vector 1 0 0 -odet_vector 0 1 0 "
                                           "-curved_det -oversample_omega".split(), "non-finite pixel values"),
        "misset with two angles": (GOOD + ["-misset", "10", "20"], "-misset needs 3 value"),
        "cell not numeric": (["-cell", "big"] + GOOD[3:], "-cell needs 6 numbers"),
        "cell with three numbers": (["-cell", "100", "100", "100"] + REST, "-cell needs 6 numbers (a b c alpha "
                                                                              "beta gamma), got 3"),
        "cell with five numbers": (["-cell", "100", "100", "100", "90", "90"] + REST, "got 5"),
        "cell that cannot close": (["-cell", "100", "100", "100", "10", "10", "170"] + REST,
                                   "cell 100 100 100 10 10 170: these angles cannot close a cell"),
        "cell angles above 360 in sum": (["-cell", "100", "100", "100", "150", "120", "100"] + REST,
                                       "cannot close a cell"),
        "flat cell": (["-cell", "100", "100", "100", "120", "120", "120"] + REST,
                      "these angles close a flat cell of zero volume"),
        "cell angle of 180": (["-cell", "100", "100", "100", "90", "180", "90"] + REST, "below 180 degrees"),
        "zero cell length": (["-cell", "0", "100", "100", "90", "90", "90"] + REST, "length a must be positive"),
        "no crystal": (GOOD[:2] + GOOD[9:], "no crystal"),
        "no structure factors": (GOOD[2:], "no structure factors"),
        "roi outside detector": (GOOD + ["-roi", "50", "60", "50", "60"], "region of interest"),
        "missing hkl file": (GOOD + ["-hkl", str(folder / "absent.hkl")], "absent.hkl: no such file"),
        "hkl with three columns": (GOOD + ["-hkl", hkl("three", SMALL_HKL + "1 1 1\n")],
                                   "three.hkl:4: expected 4 numbers"),
        "hkl non-integer index": (GOOD + ["-hkl", hkl("fraction", SMALL_HKL + "1.5 0 0 3\n")],
                                  "fraction.hkl:4: Miller indices"),
        "hkl non-numeric F": (GOOD + ["-hkl", hkl("text", "1 2 3 abc\n")], "text.hkl:1: 'abc' is not a number"),
        "hkl empty": (GOOD + ["-hkl", hkl("empty", "\n\n")], "no reflections"),
        "hkl truncated": (GOOD + ["-hkl", hkl("truncated", SMALL_HKL + "2 0")], "truncated.hkl:4: expected 4 numbers"),
        "hkl table too large": (GOOD + ["-hkl", hkl("vast", "-1000 -1000 -1000 1\n1000 1000 1000 2\n")],
                                "at most 2147483647 are supported"),
        "missing matrix": (GOOD + ["-mat", str(folder / "absent.mat")], "absent.mat: no such file"),
        "matrix too short": (GOOD + ["-mat", _write(folder, "short.mat", "1 0 0\n0 1 0\n")], "needs 9 numbers"),
        "matrix not numeric": (GOOD + ["-mat", _write(folder, "text.mat", "a b c\n0 1 0\n0 0 1\n")],
                               "text.mat:1: 'a' is not a number"),
        "singular matrix": (GOOD + ["-mat", _write(folder, "zero.mat", "0 0 0\n0 0 0\n0 0 0\n")], "singular"),
        "missing source file": (GOOD + ["-sourcefile", str(folder / "absent.txt")], "absent.txt: no such file"),
        "source file not numeric": (GOOD + ["-sourcefile", _write(folder, "src.txt", "-10 0 0 1 1e-10\nsun\n")],
                                    "src.txt:2: 'sun' is not a number"),
        "source file too many columns": (GOOD + ["-sourcefile", _write(folder, "six.txt", "1 2 3 4 5 6\n")],
                                         "six.txt:1: expected 1 to 5 numbers"),
        "mask of the wrong size": (GOOD + ["-mask", _smv(folder, "mask.img", 4, 4), "-detpixels", "8"],
                                   "mask is 4x4 pixels but the detector is 8x8"),
        "mask of no pixels": (GOOD + ["-mask", _smv(folder, "none.img", 0, 0)],
                              "none.img: SMV header has no valid SIZE1/SIZE2 (SIZE1=0, SIZE2=0; each at least 1)"),
        "image header of no width": (GOOD + ["-img", _smv(folder, "narrow.img", 0, 8)], "(SIZE1=0, SIZE2=8;"),
        "mask not SMV": (GOOD + ["-mask", _write(folder, "mask.txt", "hello")], "not an SMV"),
        "spectrum weights too small to normalise": (
            GOOD + ["-spectrumfile", _write(folder, "faint.txt", "6.2 1e-320\n")],
            "the spectrum: weights sum to 9.99989e-321, beyond what their normalisation holds"),
        "two outputs in one file": (GOOD + ["-floatfile", "same.img", "-intfile", "./same.img"],
                                    "-floatfile and -intfile both write ./same.img: give each output a file of "
                                    "its own"),
        "output folder missing": (GOOD + ["-floatfile", str(folder / "nowhere" / "f.bin")], "does not exist"),
        "amorphous curve file missing": (GOOD + ["-stol", str(folder / "absent.stol")],
                                         "absent.stol: cannot be read (No such file or directory); nanoBragg stops"),
        "amorphous curve file blank": (GOOD + ["-Q", _write(folder, "blank.stol", "\n \t\n")], "blank.stol: no data"),
        "model atom at a NaN position": (GOOD + ["-model", _write(folder, "nan.pdb", _pdb("100.000", "     nan"))],
                                         "nan.pdb: atom CA of residue ALA 1: coordinates, occupancy and B factor "
                                         "must be finite numbers"),
        "model mmCIF without a data block": (GOOD + ["-model", _write(folder, "blank.cif", "# no data\n")],
                                             "blank.cif: not a readable model (no data block)"),
        "model cell of zero lengths": (GOOD + ["-model", _write(folder, "flat.pdb", _pdb("  0.000", "   1.000"))],
                                       "flat.pdb: the model's cell 0 0 0 90 90 90: the lengths must be positive"),
        "water beyond any number": (GOOD + ["-water", "1e300"], "-water 1e+300 um gives a water background beyond"),
        "flux on a vanishing beam": (GOOD + ["-flux", "1", "-beamsize", "1e-300"], "gives a fluence beyond any number"),
        "detector beyond any memory": (GOOD + ["-nonoise", "-detpixels", "10000000"],
                                       "out of memory (an array of 400000000000000 bytes): render fewer pixels"),
        "structure factors beyond float range": (GOOD + ["-hkl", hkl("vast_F", "0 0 0 1e40\n")],
                                                 "non-finite pixel values (beyond float range, or a geometry"),
        "structure factor cache nanoBragg would read": (
            GOOD + ["-dump", _write(folder, "F.dump", b"0 0 0 0 0 0\n\f")],
            "without -hkl nanoBragg reads its structure factors from this cache"),
    }
    if Path("/proc/self").is_dir():  # Linux: a folder that takes no new files, though it passes the writable check
        cases["output folder that takes no files"] = (GOOD + ["-floatfile", "/proc/nbsim.bin"],
                                                      "cannot write /proc/nbsim.bin: No such file or directory")
    if not torch.cuda.is_available():
        cases["cuda without a GPU"] = (GOOD + ["-device", "cuda"], "CUDA is not available")
    return cases


CASE_NAMES = sorted(_cases(Path(tempfile.mkdtemp(prefix="nbsim-case-names-"))).keys())


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_gives_one_line_error(name, tmp_path, capsys, monkeypatch):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    arguments, expected = _cases(inputs)[name]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    status = main(arguments)
    captured = capsys.readouterr()
    assert status == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("nbsim: error: ")
    assert expected in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert list(work.iterdir()) == [], "no output may be written when the input is bad"


def test_catalogue_is_large_enough():
    assert len(CASE_NAMES) >= 25


FAST_ANSWERS = {
    "help": (["-h"], 0, "usage: nbsim"),
    "unknown flag": (GOOD + ["-bogus"], 2, "unknown option '-bogus'"),
    "non-physical value": (GOOD + ["-lambda", "0"], 2, "-lambda must be positive"),
    "missing file": (GOOD + ["-hkl", "absent.hkl"], 2, "absent.hkl: no such file"),
    "impossible cell": (["-cell", "100", "100", "100", "120", "120", "120"] + REST, 2, "zero volume"),
    "miniCBF of a tilted detector": (GOOD + ["-twotheta", "10", "-cbffile", "x.cbf"], 2,
                                     "-cbffile: a miniCBF can only describe a detector square to the beam"),
}


@pytest.mark.parametrize("name", sorted(FAST_ANSWERS))
def test_arguments_alone_are_answered_without_torch(name, tmp_path):
    """Help and every error the arguments decide come before PyTorch is imported (a new process
    answers in a fraction of a second; benchmarks/run.py `cli_errors` times it)."""
    arguments, status, text = FAST_ANSWERS[name]
    script = ("import sys\nfrom nbsim.cli import main\nstatus = main(sys.argv[1:])\n"
              "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\nsys.exit(status)\n")
    result = subprocess.run([sys.executable, "-c", script, *arguments], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == status
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "NO-TORCH", result.stderr
    assert text in (result.stdout if status == 0 else lines[0])
    assert status == 0 or len(lines) == 2
    assert list(tmp_path.iterdir()) == []


def _run_cli(*arguments: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbsim.cli", *arguments], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_installed_command_reports_one_line(tmp_path):
    result = _run_cli(*GOOD, "-bogus", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["nbsim: error: unknown option '-bogus'; see nbsim -h"]
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback(tmp_path):
    result = _run_cli(*GOOD, "-hkl", "absent.hkl", cwd=tmp_path, env={"NBSIM_DEBUG": "1"})
    assert result.returncode == 2
    assert "Traceback" in result.stderr


def test_good_input_writes_every_default_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(GOOD + ["-seed", "5"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["floatimage.bin", "image.pgm", "intimage.img",
                                                           "noiseimage.img"]
    out = capsys.readouterr().out
    assert "max_I =" in out and "intfile_scale = " in out  # printed before the -intfile, as nanoBragg does


def test_a_printout_pixel_off_the_detector_is_refused_before_the_render(tmp_path, monkeypatch, capsys):
    """Refused as soon as the set-up knows the pixel counts: no set-up summary, no render, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert main(GOOD + ["-printout_pixel", "3", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "nbsim: error: -printout_pixel 3 8 is outside the 8x8 detector\n"
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_a_printout_pixel_that_nanobragg_skips_gets_a_warning_and_no_trace(tmp_path, monkeypatch, capsys):
    """nanoBragg renders and traces no pixel outside -roi or zero in -mask, so it prints no trace for one
    (fuzzed: 6 of 400 traces, all with a -mask); a rendered pixel is traced."""
    from nbsim.io.images import write_smv

    monkeypatch.chdir(tmp_path)
    mask = np.ones((8, 8), np.uint16)
    mask[2, 1] = 0
    write_smv(tmp_path / "mask.img", mask, [("PIXEL_SIZE", "0.1")])
    for extra, warning in ((["-roi", "0", "3", "0", "3", "-printout_pixel", "4", "2"], "outside the -roi"),
                           (["-mask", "mask.img", "-printout_pixel", "1", "2"], "masked"),
                           (["-mask", "mask.img", "-printout_pixel", "2", "1"], None)):
        assert main(GOOD + ["-nonoise", *extra]) == 0
        out = capsys.readouterr().out
        assert ("hkl= " in out) == (warning is None)
        if warning:
            assert f"WARNING: -printout_pixel {extra[-2]} {extra[-1]} is {warning}: not rendered, no trace" in out


def test_a_structure_factor_cache_nanobragg_would_read_unasked_is_warned_about(tmp_path, monkeypatch, capsys):
    """nanoBragg without -hkl reads ./Fdump.bin, written by an earlier run with -hkl, where it exists;
    nbsim reads no cache, says so, and renders; with -hkl the cache is neither read nor mentioned."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Fdump.bin").write_bytes(b"0 0 0 0 0 0\n\f")
    hkl = _write(tmp_path, "small.hkl", SMALL_HKL)
    for extra, warned in (([], True), (["-hkl", hkl], False)):
        assert main(GOOD + ["-nonoise", "-nopgm", "-floatfile", "f.bin", "-intfile", "i.img", *extra]) == 0
        assert ("WARNING: Fdump.bin is here: without -hkl nanoBragg would read" in capsys.readouterr().out) == warned


def test_output_cut_short_ends_quietly():
    """A reader that goes away (`nbsim -h | head -1`) ends the command without an error message."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    completed = subprocess.run([sys.executable, "-m", "nbsim.cli", "-h"], stdout=write_end, stderr=subprocess.PIPE,
                               text=True, timeout=60)
    os.close(write_end)
    assert completed.returncode == 141
    assert completed.stderr == ""


def test_help_gives_every_flag_a_line_with_its_meaning(capsys):
    """`nbsim -h` prints each accepted flag (FLAGS and the variable-arity ones) once, on a line of its group
    that says what it sets; every flag with values names its default; the usage names every subcommand."""
    from nbsim.cli import main
    from nbsim.nanobragg.flags import _VARIABLE, FLAGS, GROUPS, TABLE

    assert main(["-h"]) == 0
    text = capsys.readouterr().out
    flag_lines = [line for line in text.splitlines() if line.startswith("  -")]
    printed = [name for line in flag_lines for name in itertools.takewhile(lambda t: t.startswith("-"), line.split())]
    assert sorted(printed) == sorted([*FLAGS, *_VARIABLE])
    for flag in TABLE:
        assert flag.group in GROUPS and flag.text.strip(), flag.names
        assert flag.default or not flag.kinds, f"{flag.names[0]} takes a value but names no default"
    assert [g for g in GROUPS if f"\n{g}:\n" in text] == list(GROUPS)
    usage = text.split("\n\n")[0]
    for command in ("show", "kernels", "bench", "worker", "export"):
        assert f"nbsim {command} " in usage


def test_subcommand_options_say_what_they_do_and_their_defaults():
    """`nbsim fit -h`, `nbsim merge -h` and `nbsim bench -h` explain every option, and name each default that
    is not empty (a user reads the defaults there, not in the code)."""
    from nbsim.cli import bench, fit, merge

    for parser in (fit.argument_parser(), merge.argument_parser(), bench._parser()):
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{parser.prog} {action.option_strings[0]} has no help"
            if action.default not in (None, False, [], {}):
                assert "default" in action.help, f"{parser.prog} {action.option_strings[0]} names no default"


def test_parser_state_is_typed_and_refuses_unknown_variables():
    """nanoBragg's variables after parsing are CState's fields: a rule naming a misspelt variable fails when
    it is made, and nothing can add one to a state."""
    from nbsim.nanobragg.rules import CState, _set, run_nanobragg_rules

    state = run_nanobragg_rules("-Xclose 12 -distance 120".split())
    assert isinstance(state, CState) and state.distance_mm == 120.0 and state.Xclose == 12.0
    assert state.pivot == "beam"  # -distance, the later flag, sets the beam pivot as in the C
    with pytest.raises(AttributeError):
        state.distanse_mm = 1.0
    with pytest.raises(AttributeError, match="distanse_mm"):
        _set("distanse_mm")


@pytest.mark.parametrize("command", [["fit", "shot.img", "--refine", "orientation"], ["bench", "--repeats", "1"],
                                     ["kernels", "build", "--dtype", "float32"]])
def test_model_flags_without_dashes_name_the_fix(command, tmp_path, capsys, monkeypatch):
    """A command that takes nanoBragg flags after `--`, given them without it: argparse's 'unrecognized
    arguments' names the fix, in one line, exit status 2; an unknown option of its own is not told to move."""
    monkeypatch.chdir(tmp_path)
    prog = " ".join(command[:2] if command[0] == "kernels" else command[:1])
    assert main([*command, *GOOD]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"nbsim: error: {command[0]}: unrecognized arguments: -default_F")
    assert line.endswith(f"; nanoBragg flags go after --: nbsim {prog} [options] -- -default_F ...")
    assert main([*command, "--bogus"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("unrecognized arguments: --bogus")
    assert list(tmp_path.iterdir()) == []


def test_a_command_without_model_flags_is_not_told_to_move_them(tmp_path, capsys):
    """`nbsim export` takes no nanoBragg flags: an unknown one is only unknown."""
    assert main(["export", str(tmp_path / "sweep.zarr"), "-N", "3"]) == 2
    assert capsys.readouterr().err.strip() == "nbsim: error: export: unrecognized arguments: -N 3; see nbsim export -h"


@pytest.mark.parametrize("extra", ["-MW 30", "-molecular_weight 30", "-molecules 5", "-density 1.2",
                                   "-sample_density 1.2", "-coherent", "-progress", "-noprogress"])
def test_flags_nanobragg_ignores_are_accepted_and_change_nothing(extra):
    """Flags nanoBragg reads and then overwrites or never uses (its -molec substring sets a molecular weight
    that the cell counts replace) are accepted, as the C accepts them, and leave the configuration as it was."""
    from nbsim import config_from_args

    assert config_from_args([*GOOD, *extra.split()]) == config_from_args(GOOD)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (a device that refuses every write)")
def test_an_output_that_cannot_be_written_takes_the_run_s_other_outputs_with_it(tmp_path, capsys, monkeypatch):
    """The noise image goes to a full device after the float, SMV and PGM files are written: the run ends in one
    line with status 2 and leaves none of them (each would be whole, but the set would read as a finished run);
    a file already there that the run did not reach stays."""
    monkeypatch.chdir(tmp_path)
    Path("kept.hkl").write_text("untouched\n")
    Path("in.hkl").write_text(SMALL_HKL)
    argv = [*GOOD, "-hkl", "in.hkl", "-floatfile", "float.bin", "-intfile", "int.img", "-pgmfile", "image.pgm",
            "-p1_out", "kept.hkl", "-seed", "3", "-noisefile", "/dev/full"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("nbsim: error: cannot write /dev/full") and error.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.hkl", "kept.hkl"]
    assert Path("kept.hkl").read_text() == "untouched\n"
