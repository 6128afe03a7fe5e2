"""0-dim parameters: replicated on every rank, their gradients averaged as DDP would.

torch's ``fully_shard`` shards along dim 0 and refuses scalar parameters (CLIP's and SigLIP's
``logit_scale``, ``logit_bias``). A plan keeps them out of every unit (``ignored_params``): each
rank holds the whole value, computes with it in its storage dtype, and after backward its
gradient is all-reduced and divided by the number of data-parallel ranks, in a
post-accumulate-grad hook. One all-reduce per scalar per backward; on gradient accumulation
without sync every micro-batch reduces (all-reduce is linear, so the sum is the same).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["average_gradients", "replicated_params"]


def replicated_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(first FQN, parameter)`` of every 0-dim parameter of ``model``."""
    return [(name, p) for name, p in model.named_parameters() if p.dim() == 0]


def average_gradients(params: Iterable[nn.Parameter], mesh: Any = None) -> int:
    """Average each trainable parameter's gradient over ``mesh`` (every dimension; default: the
    whole default process group) after it is accumulated. Returns the hooks registered."""
    groups = [None] if mesh is None else [mesh.get_group(i) for i in range(mesh.ndim)]
    ranks = 1
    for group in groups:
        ranks *= dist.get_world_size(group)

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        for group in groups:
            dist.all_reduce(grad, group=group)
        grad.div_(ranks)

    count = 0
    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
            count += 1
    return count
