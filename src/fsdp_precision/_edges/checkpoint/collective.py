"""What every rank must agree on: rank and world, rank 0's value, the first rank's error."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_precision._base.devices import rank_device

__all__ = [
    "CheckpointException",
    "barrier",
    "describe",
    "distributed",
    "from_rank0",
    "raise_collectively",
    "rank_world",
    "single_process",
]

T = TypeVar("T")


def distributed() -> bool:
    """Whether a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size (``(0, 1)`` without a process group)."""
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """A barrier on the default group (nothing without one)."""
    if distributed():
        dist.barrier()


def from_rank0(value: T) -> T:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    if not distributed():
        return value
    box: list[T] = [value]
    rank_device()  # NCCL sends objects through the current device: this rank's (LOCAL_RANK)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_collectively(error: BaseException | None) -> None:
    """Raise the lowest rank's error on every rank, so no rank enters a collective alone.

    The rank that made the error raises its own object (its ``__cause__`` intact); the others
    raise the copy they received.
    """
    if not distributed():
        if error is not None:
            raise error
        return
    gathered: list[BaseException | None] = [None] * dist.get_world_size()
    rank_device()  # NCCL sends objects through the current device: this rank's (LOCAL_RANK)
    dist.all_gather_object(gathered, error)
    for rank, item in enumerate(gathered):
        if item is not None:
            raise error if rank == dist.get_rank() and error is not None else item


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" warning where one process is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def describe(err: BaseException) -> str:
    """One line for ``err``; for DCP's :class:`CheckpointException`, the lowest failing rank's
    error (its ``str`` holds every rank's traceback)."""
    if isinstance(err, CheckpointException) and err.failures:
        rank = min(err.failures)
        return f"rank {rank}: {err.failures[rank][0]!r}"
    return repr(err)
