"""Typed results across ranks: every rank contributes one record, every rank gets them all.

Results cross ranks as records (frozen dataclasses, or any picklable value), never as flat
lists of floats with a stride. Public through :mod:`fsdp_precision.testing`.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch.distributed as dist

__all__ = ["gather_across_ranks"]

T = TypeVar("T")


def gather_across_ranks(record: T, *, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's ``record``, in rank order, on every rank of ``group``.

    ``record`` is any picklable value; a frozen dataclass keeps it typed. Without an initialized
    process group (or in a group of one) this is ``[record]``. Every rank of the group must
    call it (it is a collective: ``torch.distributed.all_gather_object``). Works on gloo and on
    NCCL; NCCL sends the pickled bytes through the current CUDA device, so each rank must have
    called ``torch.cuda.set_device(local_rank)`` first (else ranks collide on device 0).

    >>> worst = max(gather_across_ranks(local_diff))  # doctest: +SKIP
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [record]
    out: list[T | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, record, group=group)
    return cast(list[T], out)
