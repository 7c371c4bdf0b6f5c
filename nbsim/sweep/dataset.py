"""Reading a collated sweep (a dataset) for training: `open_dataset` (xarray, lazy) and `SweepImages`, a
minimal PyTorch `Dataset` over its draws.

    import nbsim.sweep
    ds = nbsim.sweep.open_dataset("results/dataset/shots/sweep.zarr")  # labels are coordinates on `draw`
    images = nbsim.sweep.SweepImages("results/dataset/shots/sweep.zarr", labels=("A_00", "A_01", "wavelength_A"))
    image, target = images[0]        # (slow, fast) float32 tensor, (len(labels),) float64 tensor
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import NbsimError
from .store import read_store


def open_dataset(path: str | Path):
    """A collated `sweep.zarr` as a lazy xarray Dataset: `image_n<size>` (and, with a detector stage, its
    detector images) over the sweep's axes, labels as coordinates along `draw`; `.sel`/`.isel` of one
    point reads one chunk."""
    if not (Path(path) / "zarr.json").is_file():
        raise NbsimError(f"{path} is not a collated sweep store (sweep.zarr)")
    return read_store(Path(path))


class SweepImages(torch.utils.data.Dataset):
    """The images of one detector size along `draw`, each with the chosen labels, read one chunk at a time
    (so a DataLoader's workers share nothing but the path)."""

    def __init__(self, path: str | Path, labels: Sequence[str] = (), image: str = "image", size: int | None = None,
                 selection: Mapping[str, Any] | None = None):
        """`image`: the image kind (`image`, the noise-free photons); `size`: the detector size (the only one
        by default); `selection`: `.sel` values of the other axes (dtype, device, ...), each of which must
        then hold one value."""
        dataset = open_dataset(path)
        names = sorted(name for name in dataset.data_vars if name.startswith(f"{image}_n"))
        if size is not None:
            names = [f"{image}_n{size}"] if f"{image}_n{size}" in dataset else []
        if len(names) != 1:
            raise NbsimError(f"{path}: choose one of the image arrays {names or 'none'} (size=...)")
        array = dataset[names[0]].sel(selection or {})
        extra = [d for d in array.dims[:-2] if d != "draw" and array.sizes[d] != 1]
        if "draw" not in array.dims or extra:
            raise NbsimError(f"{path}: the images vary along {extra or ['no draw']}; select one value of each "
                             "(selection=...)")
        self.images = array.squeeze([d for d in array.dims[:-2] if d != "draw"]).transpose("draw", ...)
        missing = [name for name in labels if name not in dataset.coords]
        if missing:
            raise NbsimError(f"{path}: no label {missing[0]}; the labels are "
                             f"{', '.join(sorted(c for c in dataset.coords if c not in dataset.dims))}")
        self.labels = torch.stack([torch.as_tensor(dataset[name].values, dtype=torch.float64) for name in labels],
                                  dim=1) if labels else torch.zeros((self.images.sizes["draw"], 0), dtype=torch.float64)

    def __len__(self) -> int:
        return self.images.sizes["draw"]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.images[index].values), self.labels[index]
