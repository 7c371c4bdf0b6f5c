"""The merge's workers: processes that each hold some shots and add their sums with `torch.distributed`'s
all-reduce (gloo on the CPU, NCCL on CUDA). Started here (`launch(..., workers=N)`: N local processes by
torch.multiprocessing) or by a launcher that sets torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; under srun, SLURM_PROCID and SLURM_NTASKS stand for the first two)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import NbsimError, signal_name


def launched_world() -> tuple[int, int] | None:
    """(rank, size) a launcher set in the environment (torchrun's or SLURM's), None when it set none."""
    for rank_name, size_name in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if size_name in os.environ and rank_name in os.environ:
            try:
                rank, size = int(os.environ[rank_name]), int(os.environ[size_name])
            except ValueError:
                raise NbsimError(f"{rank_name} and {size_name} must be whole numbers") from None
            return (rank, size) if size > 1 else None
    return None


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the number of workers (0 and 1 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def backend_of(device: str) -> str:
    """The all-reduce engine for a device: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.startswith("cuda") else "gloo"


def worker_device(device: str) -> str:
    """The device this worker computes on: its own GPU (LOCAL_RANK, else its rank modulo the GPUs) for cuda."""
    if not device.startswith("cuda") or ":" in device or not (dist.is_available() and dist.is_initialized()):
        return device
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def all_sum(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """The element-wise sum of `tensor` over the workers (itself alone outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    moved = tensor.detach().to(device if backend_of(device) == "nccl" else "cpu").clone()
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    return moved.to(tensor.device)


def gather(value: Any) -> list[Any]:
    """Every worker's `value`, in rank order (a one-item list outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _spawned(rank: int, target: Callable[..., None], args: tuple, size: int, port: int, backend: str) -> None:
    """A spawned worker: joins the group through the launching process's store on `port`, runs `target`; an
    error leaves as one line for the parent."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank,
                            world_size=size)
    try:
        target(*args)
    except Exception as error:  # noqa: BLE001 - the parent reports the worker's error as one line
        raise RuntimeError(f"worker {rank}: {(str(error).strip().splitlines() or [type(error).__name__])[0]}") \
            from None
    finally:
        dist.destroy_process_group()


def launch(target: Callable[..., None], args: tuple, workers: int, device: str) -> None:
    """Run `target(*args)` in every worker: in this process when a launcher made it one of several (the
    environment names its rank), in `workers` spawned local processes when more than one, else here alone.
    A worker's error or death ends every worker and comes back as one NbsimError."""
    backend = backend_of(device)
    launched = launched_world()
    if launched is not None:
        rank, size = launched
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise NbsimError(f"{size} workers were launched but {name} is not set (torchrun sets it; "
                                 "under srun the batch script must: docs/merging.md)")
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(size))
        dist.init_process_group(backend, rank=rank, world_size=size)
        try:
            target(*args)
        finally:
            dist.destroy_process_group()
        return
    if workers < 1:
        raise NbsimError(f"--workers must be at least 1 (got {workers})")
    if workers == 1:
        target(*args)
        return
    import torch.multiprocessing as mp

    # torch logs a line as it ends the other workers after one failed; the failure is reported here, in one line
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # The workers meet at a store this process holds, on a port the system picks as the store binds it: a free
    # port looked up here and bound by worker 0 once started (seconds later) could be taken meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.start_processes(_spawned, args=(target, args, workers, store.port, backend), nprocs=workers,
                                 join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as error:
        died = _died_without_an_error(context)
        if died is not None:
            raise NbsimError(_death(*died)) from None
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        message = lines[-1].split(": ", 1)[-1] if lines else "failed"
        raise NbsimError(message) from None
    except mp.ProcessExitedException as error:
        raise NbsimError(_death(error.error_index, error.exit_code)) from None


def _died_without_an_error(context: torch.multiprocessing.ProcessContext) -> tuple[int, int] | None:
    """(index, exit status) of a worker that ended without an error of its own (os._exit, the out-of-memory
    killer), not counting those the launcher ended (SIGTERM) once one failed. A worker's death breaks its
    peers' all-reduce, and their errors (a connection reset) are its consequence: torch reports the first
    failure it sees, which on a loaded machine is a peer's error when the launcher wakes after it (measured:
    the peer's error 0.5-1 s after the death)."""
    for index, process in enumerate(context.processes):
        if process.exitcode not in (0, -signal.SIGTERM) and not os.path.exists(context.error_files[index]):
            return index, process.exitcode
    return None


def _death(index: int, exit_status: int) -> str:
    """The one line for a worker that died: its exit code, or the signal that killed it."""
    how = f"exit code {exit_status}" if exit_status >= 0 else signal_name(-exit_status)
    return f"worker {index} died ({how}); no output was written"
