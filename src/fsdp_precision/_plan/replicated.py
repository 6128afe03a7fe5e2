"""0-dim parameters: replicated on every rank, their gradients averaged as DDP would.

torch's ``fully_shard`` shards along dim 0 and refuses scalar parameters (CLIP's and SigLIP's
``logit_scale``, ``logit_bias``). A plan keeps them out of every unit (``ignored_params``): each
rank holds the whole value, computes with it in its storage dtype, and their gradients are
all-reduced and divided by the number of data-parallel ranks.

FSDP never moves ignored parameters, so :func:`average_gradients` puts them on the mesh's device
itself (a model built on the CPU and sharded onto GPUs would otherwise all-reduce CPU tensors on
an NCCL group). Their reduction is one flat all-reduce per dtype and mesh dimension, queued at
the end of each backward in which any of them accumulated a gradient (as FSDP queues its own
final callback), never one synchronous all-reduce per scalar inside backward. On gradient
accumulation without sync every microbatch reduces (all-reduce is linear: the sum is the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._base.devices import mesh_device, rank_device

__all__ = ["average_gradients", "replicated_params"]


def replicated_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(first FQN, parameter)`` of every 0-dim parameter of ``model``."""
    return [(name, p) for name, p in model.named_parameters() if p.dim() == 0]


class _Averager:
    """Averages the gradients of a set of replicated parameters once per backward."""

    def __init__(self, params: Sequence[nn.Parameter], groups: Sequence[Any]) -> None:
        self.params = params
        self.groups = groups
        self.ranks = 1
        for group in groups:
            self.ranks *= dist.get_world_size(group)
        self.queued = False

    def accumulated(self, _: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        self.queued = False
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.params:
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            flat = torch.stack(grads)  # 0-dim each: one dense vector
            for group in self.groups:
                dist.all_reduce(flat, group=group)
            flat.div_(self.ranks)
            for grad, averaged in zip(grads, flat.unbind(), strict=True):
                grad.copy_(averaged)


def average_gradients(params: Iterable[nn.Parameter], mesh: Any = None) -> int:
    """Move each parameter to ``mesh``'s device (default: this rank's, from the default process
    group) and average the gradients of the trainable ones over ``mesh`` (every dimension;
    default: the whole default process group) after each backward. Returns how many are
    averaged."""
    device = rank_device() if mesh is None else mesh_device(mesh)
    params = list(params)
    with torch.no_grad():
        for param in params:
            if param.device != device:
                param.data = param.data.to(device)
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0
    groups = [None] if mesh is None else [mesh.get_group(i) for i in range(mesh.ndim)]
    averager = _Averager(trainable, groups)
    for param in trainable:
        param.register_post_accumulate_grad_hook(averager.accumulated)  # type: ignore[no-untyped-call]
    return len(trainable)
