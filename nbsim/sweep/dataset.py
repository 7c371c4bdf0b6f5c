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
    """A collated `sweep.zarr` as a lazy xarray Dataset: `image` (and, with a detector stage,
    `detector_image`) over the sweep's axes plus slow and fast, labels as coordinates along `draw`;
    `.sel`/`.isel` of one point reads one chunk."""
    if not (Path(path) / "zarr.json").is_file():
        raise NbsimError(f"{path} is not a collated sweep store (sweep.zarr)")
    return read_store(Path(path))


class SweepImages(torch.utils.data.Dataset):
    """The images of one detector size along `draw`, each with the chosen labels, read one chunk at a time
    (so a DataLoader's workers share nothing but the path)."""

    def __init__(self, path: str | Path, labels: Sequence[str] = (), image: str = "image", size: int | None = None,
                 selection: Mapping[str, Any] | None = None):
        """`image`: the image kind (`image`, the noise-free photons, or `detector_image`); `size`: the
        detector size (the only one by default); `selection`: `.sel` values of the other axes (dtype,
        device, ...), each of which must then hold one value."""
        dataset = open_dataset(path)
        if image not in dataset:
            kinds = [name for name in ("image", "detector_image") if name in dataset]
            raise NbsimError(f"{path}: no image kind {image}; this store holds {', '.join(kinds) or 'none'}")
        sizes = [int(value) for value in dataset["size"].values]
        if size is None and len(sizes) != 1:
            raise NbsimError(f"{path}: choose one of the detector sizes {sizes} (size=...)")
        chosen = sizes[0] if size is None else size
        if chosen not in sizes:
            raise NbsimError(f"{path}: no detector size {chosen}; the sizes are {sizes}")
        array = dataset[image].sel({**(selection or {}), "size": chosen}).isel(slow=slice(0, chosen),
                                                                             fast=slice(0, chosen))
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
