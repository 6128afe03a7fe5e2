"""Ranks and sharded tensors: who this process is, typed results across ranks, local views.

Results cross ranks as records (frozen dataclasses, or any picklable value), never as flat
lists of floats with a stride. :func:`gather_across_ranks` is public through
:mod:`fsdp_precision.testing`.
"""

from __future__ import annotations

import os
import socket
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_precision._base.devices import rank_device

__all__ = [
    "free_port",
    "full_tensor",
    "gather_across_ranks",
    "is_rank0",
    "local_tensor",
    "under_torchrun",
]

T = TypeVar("T")


def gather_across_ranks(record: T, *, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's ``record``, in rank order, on every rank of ``group``.

    ``record`` is any picklable value; a frozen dataclass keeps it typed. Without an initialized
    process group (or in a group of one) this is ``[record]``. Every rank of the group must
    call it (it is a collective: ``torch.distributed.all_gather_object``). Works on gloo and on
    NCCL; NCCL sends the pickled bytes through the current CUDA device, which is made this
    rank's first where the caller has not chosen one (``LOCAL_RANK``, see
    :func:`~fsdp_precision._base.devices.rank_device`).

    >>> worst = max(gather_across_ranks(local_diff))  # doctest: +SKIP
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [record]
    out: list[T | None] = [None] * dist.get_world_size(group)
    rank_device(group)
    dist.all_gather_object(out, record, group=group)
    return cast(list[T], out)


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_rank0() -> bool:
    """True in a process that no launcher started, and on rank 0 under torchrun (``RANK``)."""
    return os.environ.get("RANK", "0") == "0"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a ``DTensor`` (a collective: every rank must call it); any other
    tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t
