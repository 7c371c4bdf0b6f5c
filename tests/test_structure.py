"""`structure_of(config)` against the structure of the resolved setup: the kernel options and step counts a
render really builds (its tensors' sizes), for every golden case and for configurations covering each rule
that decides a count or an option; and it reads no file and builds nothing image-sized."""

from __future__ import annotations

import builtins
import io
import pathlib
import time

import numpy as np
import pytest
import torch

import nbsim
from nbsim.io.images import write_smv
from nbsim.kernel.inputs import kernel_inputs
from nbsim.kernel.stages import Structure
from nbsim.kernel.structure import structure_of
from nbsim.resolve import Setup, resolve

from .conftest import case_params, load_case

BASE = "-default_F 100 -cell 70 80 90 75 85 95 -lambda 1.5 -distance 200 -pixel 0.1 -detpixels 16"
ONE_STEP = BASE + " -N 2 -oversample 1"


def built_structure(setup: Setup) -> Structure:
    """The structure as a render sees it: options and step counts from the kernel's input tensors, checked
    against the resolved setup's own counts."""
    inputs = kernel_inputs(setup, "cpu", torch.float64)
    tensors = inputs.tensors
    steps = tensors.origins.shape[0] * tensors.inv_wavelength.shape[0] * tensors.beam_terms.shape[2]
    setup_steps = (setup.sources.count * setup.mosaic.count * setup.phi.steps * setup.oversample ** 2
                   * setup.sensor.layers)
    assert steps == setup_steps
    assert inputs.options.lookup == setup.lookup
    assert inputs.options.use_sensor == (setup.sensor.thickness_m > 0)
    return Structure(inputs.options, single_step=steps == 1)


@pytest.mark.parametrize("name", case_params())
def test_structure_of_every_golden_case(name, in_golden_dir):
    config = nbsim.config_from_args(load_case(name).args)
    assert structure_of(config) == built_structure(resolve(config))


def _hkl(folder: pathlib.Path) -> str:
    path = folder / "P1.hkl"
    path.write_text("".join(f"{h} {k} {l} {10 + h + k + l}\n" for h in range(-3, 4) for k in range(-3, 4)
                            for l in range(-3, 4)))
    return str(path)


def _matrix(folder: pathlib.Path) -> str:
    """A 50 Å cubic cell at λ 1 Å (a*, b*, c* times λ as columns)."""
    path = folder / "cubic.mat"
    path.write_text("0.02 0 0\n0 0.02 0\n0 0 0.02\n")
    return str(path)


def _sources(folder: pathlib.Path, rows: int) -> str:
    path = folder / f"sources{rows}.txt"
    path.write_text("".join(f"-10 {0.01 * row} 0 1.0 1.0e-10\n" for row in range(rows)))
    return str(path)


# (extra arguments after BASE or ONE_STEP, with {hkl}, {mat}, {src1}, {src3} for files; the lookup and
# whether a pixel has one step, as worked out by hand).
CASES = {
    "single step": (ONE_STEP, "", "default", True),
    "auto oversample": (BASE, "-N 20", "default", False),
    "auto oversample of one": (BASE, "-N 2", "default", True),
    "oversample 2": (BASE, "-N 2 -oversample 2", "default", False),
    "hkl nearest": (ONE_STEP, "-hkl {hkl} -N 5", "nearest", True),
    "hkl N<=2 interpolates": (ONE_STEP, "-hkl {hkl}", "interpolate", True),
    "hkl one axis N<=2": (ONE_STEP, "-hkl {hkl} -N 5 -Nb 2", "interpolate", True),
    "hkl -interpolate": (ONE_STEP, "-hkl {hkl} -N 5 -interpolate", "interpolate", True),
    "hkl -nointerpolate N<=2": (ONE_STEP, "-hkl {hkl} -nointerpolate", "nearest", True),
    "hkl -N 9, xtalsize N<=2": (ONE_STEP, "-hkl {hkl} -N 9 -xtalsize 0.00001", "nearest", True),
    "hkl xtalsize, no -N": (BASE, "-hkl {hkl} -xtalsize 0.001 -oversample 1", "interpolate", True),
    "corrected: the size's counts decide": (BASE, "-hkl {hkl} -xtalsize 0.001 -oversample 1 -physics corrected",
                                            "nearest", True),
    "corrected: the size's N<=2 decides": (ONE_STEP, "-hkl {hkl} -N 9 -xtalsize 0.00001 -physics corrected",
                                           "interpolate", True),
    "mat xtalsize auto oversample": (BASE, "-mat {mat} -lambda 1 -distance 100 -xtalsize 0.0001", "default",
                                     False),
    "mat xtalsize auto oversample of one": (BASE, "-mat {mat} -lambda 1 -distance 1000 -xtalsize 0.0001",
                                            "default", True),
    "mat hkl xtalsize, -N 2": (ONE_STEP, "-mat {mat} -lambda 1 -hkl {hkl} -xtalsize 0.0001", "interpolate", True),
    "sourcefile one row": (ONE_STEP, "-sourcefile {src1}", "default", True),
    "sourcefile three rows": (ONE_STEP, "-sourcefile {src3}", "default", False),
    "divergence grid": (ONE_STEP, "-hdivrange 1 -vdivrange 1 -divsteps 3", "default", False),
    "divergence round cut to one": (ONE_STEP, "-hdivrange 1 -hdivstep 2", "default", True),
    "divergence square cut to one": (ONE_STEP, "-hdivrange 0.5 -hdivstep 0.5 -vdivrange 0.5 -vdivstep 0.5 "
                                                "-square_div", "default", True),
    "dispersion": (ONE_STEP, "-dispersion 1 -dispsteps 3", "default", False),
    "mosaic spread": (ONE_STEP, "-mosaic 0.5", "default", False),
    "mosaic spread and domains": (ONE_STEP, "-mosaic 0.5 -mosaic_dom 3", "default", False),
    "mosaic spread one domain": (ONE_STEP, "-mosaic 0.5 -mosaic_dom 1", "default", True),
    "mosaic domains without spread": (ONE_STEP, "-mosaic_dom 5", "default", True),
    "mosaic domains zero spread": (ONE_STEP, "-mosaic 0 -mosaic_dom 5", "default", True),
    "phi steps": (ONE_STEP, "-osc 1 -phisteps 3", "default", False),
    "one phi step": (ONE_STEP, "-osc 1 -phisteps 1", "default", True),
    "phi start": (ONE_STEP, "-phi 30", "default", True),
    "sensor layers": (ONE_STEP, "-detector_thick 100 -thicksteps 3", "default", False),
    "sensor one layer asked": (ONE_STEP, "-detector_thick 100 -thicksteps 1", "default", False),
    "dmin": (ONE_STEP, "-dmin 2", "default", True),
    "nopolar": (ONE_STEP, "-nopolar", "default", True),
    "kahn polar": (ONE_STEP, "-polar 0.5", "default", True),
    "point pixel": (ONE_STEP, "-point_pixel", "default", True),
    "curved detector": (ONE_STEP, "-curved_det", "default", True),
    "round crystal": (ONE_STEP, "-round_xtal", "default", True),
    "gauss crystal": (ONE_STEP, "-gauss_xtal", "default", True),
    "tophat spots": (ONE_STEP, "-tophat_spots", "default", True),
    "misset random": (BASE, "-N 2 -misset random -misset_seed 7", "default", True),
    "sample pivot two-theta": (BASE, "-N 2 -xds -twotheta 20", "default", True),
}


@pytest.mark.parametrize("name", CASES)
def test_structure_of_matches_the_resolved_setup(name, tmp_path):
    base, extra, lookup, single_step = CASES[name]
    extra = extra.format(hkl=_hkl(tmp_path), mat=_matrix(tmp_path), src1=_sources(tmp_path, 1),
                         src3=_sources(tmp_path, 3))
    args = base.split() + extra.split()
    if "-mat" in args:
        cell = args.index("-cell")
        del args[cell:cell + 7]
    config = nbsim.config_from_args(args)
    structure = structure_of(config)
    assert structure == built_structure(resolve(config))
    assert (structure.options.lookup, structure.single_step) == (lookup, single_step)


def test_options_follow_their_flags():
    options = structure_of(nbsim.config_from_args((ONE_STEP + " -gauss_xtal -point_pixel -curved_det -polar 0.5 "
                                                              "-dmin 2 -detector_thick 100").split())).options
    assert (options.shape, options.point_pixel, options.curved, options.polarization, options.use_dmin,
            options.use_sensor) == ("gauss", True, True, "kahn", True, True)
    assert structure_of(nbsim.config_from_args((ONE_STEP + " -nopolar").split())).options.polarization == "none"


def test_structure_of_reads_no_file(tmp_path, monkeypatch):
    """The -hkl table and the -mask are gone by the time the structure is asked for, and every way of opening
    a file fails: the structure still comes (from the -mat and -sourcefile contents the config holds)."""
    hkl, mask = _hkl(tmp_path), tmp_path / "mask.img"
    write_smv(mask, np.ones((16, 16)), [])
    args = (BASE.split()[:2] + ["-mat", _matrix(tmp_path), "-lambda", "1", "-hkl", hkl, "-sourcefile",
                                _sources(tmp_path, 1), "-mask", str(mask), "-detpixels", "16", "-xtalsize", "0.0001"])
    config = nbsim.config_from_args(args)
    pathlib.Path(hkl).unlink()
    mask.unlink()

    def refuse(*_args, **_kwargs):
        raise AssertionError("structure_of opened a file")

    for target, name in ((builtins, "open"), (io, "open"), (pathlib.Path, "open"), (pathlib.Path, "read_text"),
                         (pathlib.Path, "read_bytes")):
        monkeypatch.setattr(target, name, refuse)
    structure = structure_of(config)
    assert (structure.options.lookup, structure.single_step) == ("interpolate", False)


def test_structure_of_builds_nothing_image_sized():
    """A 100000² detector (10¹⁰ pixels, 40 GB as one float32 image) costs no more than a small one."""
    config = nbsim.config_from_args((BASE + " -N 2 -detpixels 100000").split())
    started = time.perf_counter()
    structure = structure_of(config)
    assert time.perf_counter() - started < 1.0
    assert structure.single_step
