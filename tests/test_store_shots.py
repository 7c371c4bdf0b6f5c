"""A dataset store's shots (`images.zarr#POINT`) as `nbsim fit` and `nbsim merge` inputs (issue 38): checked before
any work (the store is a store, the shot is in it and rendered; one line otherwise), then fitted and merged."""

from __future__ import annotations

import json

import gemmi
import numpy as np
import pytest
import torch

import nbsim
from nbsim.cli import main
from nbsim.errors import InputFileError
from nbsim.io.observed import read_observed, require_observed
from nbsim.io.structure_files import expand_to_p1_sphere, write_hkl
from nbsim.sweep.store import BatchStore

CELL = (20.0, 24.0, 28.0, 90.0, 90.0, 90.0)
FLAGS = ("-cell 20 24 28 90 90 90 -N 10 -lambda 1 -distance 14 -detpixels 64 -pixel 0.1 -fluence 1e27 "
         "-oversample 1 -nointerpolate").split()
POINTS = ("n64-d0000", "n64-d0001", "n64-d0002")
ADC = 40.0


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A batch store of three 64² points (Poisson counts over an ADC offset of 40), the last not done, and
    each shot's misset; a flat starting |F| of P 2₁2₁2₁ as P1 text."""
    folder = tmp_path_factory.mktemp("store")
    group = gemmi.SpaceGroup("P 21 21 21")
    miller = np.asarray(gemmi.make_miller_array(gemmi.UnitCell(*CELL), group, 1.5, 0, True), np.int64)
    write_hkl(folder / "start.hkl", expand_to_p1_sphere(miller, np.full(len(miller), 100.0), None, group))
    rng = np.random.default_rng(3)
    path = folder / "images.zarr"
    batch = BatchStore(path, "digest", list(POINTS), (64, 64), {"image": np.float32, "detector_image": np.uint16}, {})
    missets = {}
    for index, name in enumerate(POINTS[:2]):
        misset = rng.uniform(-180, 180, 3).round(3).tolist()
        config = nbsim.config_from_args([*FLAGS, "-default_F", "100", "-misset", *map(str, misset)])
        with torch.no_grad():
            photons = nbsim.simulate(config).double().numpy()
        counts = (rng.poisson(photons) + ADC).clip(0, 65535).astype(np.uint16)
        batch.write(index, {"image": photons.astype(np.float32), "detector_image": counts},
                    {"name": name, "status": "ok", "size": 64, "images": ["detector_image", "image"],
                     "config": {"response": {"adc_offset_adu": ADC, "gain_adu_per_photon": 1.0}}})
        missets[f"{path}#{name}"] = misset
    batch.finish({})
    return {"folder": folder, "path": path, "missets": missets}


def test_a_stores_shots_pass_the_check_and_read_as_their_counts(store):
    path = store["path"]
    require_observed([f"{path}#{POINTS[0]}", f"{path}#{POINTS[1]}", f"{path}#1"])
    first, by_index = read_observed(f"{path}#{POINTS[1]}"), read_observed(f"{path}#1")
    assert first.adc_offset_adu == ADC and first.counts.shape == (64, 64) and first.counts.sum() > 0
    np.testing.assert_array_equal(first.counts, by_index.counts)


@pytest.mark.parametrize(("shot", "message"), [
    ("{path}#n64-d0009", "no point n64-d0009 in this store"),
    ("{path}#7", "no point 7 in this store"),
    ("{path}#n64-d0002", "point n64-d0002 is not done (no image yet)"),
    ("{path}", "a sweep store holds many images: name one as STORE#POINT"),
    ("{folder}#n64-d0000", "is a folder but not a zarr store of a sweep"),
    ("{folder}/absent.zarr#n64-d0000", "absent.zarr: no such file"),
])
def test_a_shot_that_is_not_there_is_one_line(store, shot, message):
    spec = shot.format(path=store["path"], folder=store["folder"])
    with pytest.raises(InputFileError) as raised:
        require_observed([f"{store['path']}#{POINTS[0]}", spec])
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_nbsim_fit_fits_a_stores_shot(store, tmp_path):
    """The first shot's scale, from its true model at the flags' fluence: about 1 (Poisson counts)."""
    shot, misset = next(iter(store["missets"].items()))
    truth = [*FLAGS, "-default_F", "100", "-misset", *map(str, misset)]
    status = main(["fit", shot, "--refine", "scale", "--search-deg", "0", "--shoebox", "5", "--spots", "40", "--quiet",
                   "--json", str(tmp_path / "fit.json"), "--", *truth])
    assert status == 0
    fitted = json.loads((tmp_path / "fit.json").read_text())["shots"][0]
    assert fitted["image"] == shot and fitted["scale"] == pytest.approx(1.0, abs=0.05)


def test_nbsim_merge_merges_a_stores_shots(store, tmp_path):
    starts = tmp_path / "starts.json"
    starts.write_text(json.dumps({"images": {shot: {"misset": misset} for shot, misset in store["missets"].items()}}))
    status = main(["merge", *store["missets"], "--starts", str(starts), "--hkl", str(store["folder"] / "start.hkl"),
                   "--space_group", "P212121", "--refine", "scale", "--cycles", "1", "--shoebox", "5", "--spots", "40",
                   "--quiet", "--mtz", str(tmp_path / "out.mtz"), "--json", str(tmp_path / "out.json"), "--", *FLAGS])
    assert status == 0
    assert [shot["image"] for shot in json.loads((tmp_path / "out.json").read_text())["shots"]] == \
        list(store["missets"])
    assert gemmi.read_mtz_file(str(tmp_path / "out.mtz")).spacegroup.hm == "P 21 21 21"


def test_nbsim_merge_of_a_shot_the_store_lacks_is_one_line_and_writes_nothing(store, tmp_path, capsys):
    shots = [*store["missets"], f"{store['path']}#n64-d0009"]
    status = main(["merge", *shots, "--hkl", str(store["folder"] / "start.hkl"), "--space_group", "P212121",
                   "--mtz", str(tmp_path / "out.mtz"), "--", *FLAGS])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1 and "no point n64-d0009 in this store" in error[0]
    assert list(tmp_path.iterdir()) == []
