"""Which device a rank computes and communicates on, read from its process group.

One rule, in one place, for every tensor the library creates and every collective it calls:

- **The backend is read from the group, per device type**, never compared with one string.
  ``dist.get_backend()`` answers ``"undefined"`` after a plain ``init_process_group()`` and the
  whole ``"cpu:gloo,cuda:nccl"`` after a mixed one; ``dist.get_backend_config(group)`` names the
  backend of each device type (``"cpu:gloo,cuda:nccl"``; ``"gloo"`` reads ``"cpu:gloo,cuda:gloo"``).
- **A rank computes on CUDA** where its group reaches CUDA through a backend other than gloo
  (NCCL, or another accelerator backend) and this process sees a GPU; else on the CPU. A group
  created with gloo on a GPU machine stays on the CPU, as before.
- **The LOCAL_RANK rule**: under a launcher, rank ``LOCAL_RANK`` of a node uses
  ``cuda:LOCAL_RANK``. Where the caller has not chosen a device (the current one is still
  ``cuda:0``) and ``LOCAL_RANK`` names a visible device, it is made current before the first
  collective, so that ``torchrun --nproc_per_node 8`` does not put every rank on ``cuda:0``
  ("Duplicate GPU detected"). A device the caller set (``torch.cuda.set_device``, or the group's
  ``bound_device_id`` from ``init_process_group(device_id=...)``) is kept.

The ranks of a group decide alike wherever their processes see the same hardware; a rank that
sees no GPU beside ranks that do is a cluster fault the first collective reports.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "backends_by_device",
    "group_device",
    "local_cuda_index",
    "mesh_device",
    "parse_backend_config",
    "rank_device",
]


def backends_by_device(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """``{device type: backend name}`` of ``group`` (default: the world), e.g. ``{"cpu":
    "gloo", "cuda": "nccl"}``; empty without a process group."""
    if not dist.is_initialized():
        return {}
    return parse_backend_config(str(dist.get_backend_config(group)))


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a bare backend name
    (``"nccl"``, ``"gloo"``) stands for the device type it serves."""
    found: dict[str, str] = {}
    for part in config.split(","):
        device, sep, backend = part.strip().partition(":")
        if sep:
            found[device] = backend.lower()
        elif device:  # one backend for every device type it serves
            found.setdefault("cuda" if device.lower() == "nccl" else "cpu", device.lower())
    return found


def rank_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device this rank computes on and the library's tensors for ``group`` live on:
    ``cuda:<index>`` (see :func:`local_cuda_index`) where ``group`` reaches CUDA through a
    backend other than gloo and CUDA is available, else the CPU."""
    cuda = backends_by_device(group).get("cuda")
    if cuda is None or cuda == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_cuda_index(group))


def local_cuda_index(group: dist.ProcessGroup | None = None) -> int:
    """The CUDA device of this rank, made current: the group's bound device where it has one,
    else the current device where the caller set one (not 0), else ``LOCAL_RANK`` where it
    names a visible device, else the current device."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    bound = getattr(group, "bound_device_id", None)
    current = torch.cuda.current_device()
    index = current
    if bound is not None and bound.type == "cuda" and bound.index is not None:
        index = bound.index
    elif current == 0:
        local = os.environ.get("LOCAL_RANK", "")
        if local.isdigit() and int(local) < torch.cuda.device_count():
            index = int(local)
    if index != current:
        torch.cuda.set_device(index)
    return index


def group_device(group: object) -> torch.device:
    """Where tensors for ``group``'s collectives live: a ``torch.distributed`` process group by
    :func:`rank_device`; a bare c10d backend (``ProcessGroupNCCL``, ``ProcessGroupGloo``, as
    a standalone weight group is) by its kind: NCCL's on this rank's CUDA device, the rest on
    the CPU."""
    if isinstance(group, dist.ProcessGroup):
        return rank_device(group)
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds
    if nccl is not None and isinstance(group, nccl):
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


def mesh_device(mesh: Any) -> torch.device:
    """This rank's device of a ``DeviceMesh`` (the device FSDP puts the parameters it manages
    on): ``cuda:<index>`` for a CUDA mesh, else the mesh's device type."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", local_cuda_index(mesh.get_group(0)))
    return torch.device(mesh.device_type)
