"""The compute device and dtype named on a command line, checked against this machine."""

from __future__ import annotations

import torch

from .errors import NbsimError

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_device(name: str) -> torch.device:
    """A torch device, or a one-line error when the requested accelerator is not there."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NbsimError(f"device '{name}' requested but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise NbsimError(f"device '{name}' requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return concrete_device(device)


def concrete_device(device: torch.device | str) -> torch.device:
    """`device` with its index made explicit ("cuda" is the current CUDA device, "cuda:0" say), so that it
    equals the device of the tensors made on it (a tensor made on "cuda" reports "cuda:0")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype named `float32` or `float64`."""
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name resolve_dtype takes: "float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")
