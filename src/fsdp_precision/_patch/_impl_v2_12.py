"""Per-parameter dtypes inside one FSDP2 unit: the implementation for torch 2.12.

The 2.13 implementation (``_impl_v2_13``), with the one replaced function whose upstream contract
differs in 2.12: ``foreach_reduce`` returns six values there; 2.13 added ``post_reduce_stream``
as the third. Everything else the 2.13 implementation replaces (``_init_param_group``,
``FSDPParamGroup._init_mp_dtypes``, ``_get_param_all_gather_inputs``) has the same source on 2.12
and 2.13 (see the hash tables), and the functions it relies on changed only in ways it does not
depend on (see ``v2_12.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from . import _impl_v2_13 as _v13

# One registry with the 2.13 implementation: its functions look their originals up there.
_replaced = _v13._replaced


def drop_post_reduce_stream(result: tuple[Any, ...]) -> tuple[Any, ...]:
    """2.13's seven-value ``foreach_reduce`` result -> the six values 2.11 and 2.12 return.

    2.13 inserted ``post_reduce_stream`` as the third value; nothing else moved.
    """
    return result[:2] + result[3:]


@torch.no_grad()
def foreach_reduce(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    reduce_scatter_group: dist.ProcessGroup,
    reduce_scatter_stream: torch.Stream,
    reduce_scatter_comm: Any,
    orig_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    device: torch.device,
    gradient_divide_factor: float | None,
    all_reduce_group: dist.ProcessGroup | None,
    all_reduce_stream: torch.Stream,
    all_reduce_grads: bool,
    partial_reduce_output: torch.Tensor | None,
    all_reduce_hook: Callable[[torch.Tensor], None] | None,
    force_sum_reduction_for_comms: bool = False,
) -> tuple[Any, ...]:
    """Upstream ``foreach_reduce`` for uniform units; one reduce-scatter for mixed ones.

    Differences from the 2.13 replacement, marked: [2.12] the six-value result. Kept from 2.13
    on purpose: CPU-offloaded gradients of parameters with post-accumulate-grad hooks are copied
    blocking (2.13's fix; 2.12 copies them non-blocking into pinned memory, which such a hook
    may read too early). It only applies to pinned, CUDA-offloaded mixed units.
    """
    args = (
        fsdp_params,
        unsharded_grads,
        reduce_scatter_group,
        reduce_scatter_stream,
        reduce_scatter_comm,
        orig_dtype,
        reduce_dtype,
        device,
        gradient_divide_factor,
        all_reduce_group,
        all_reduce_stream,
        all_reduce_grads,
        partial_reduce_output,
        all_reduce_hook,
        force_sum_reduction_for_comms,
    )
    if _v13.is_uniform(fsdp_params, unsharded_grads, orig_dtype):
        return _replaced.original(_group, "foreach_reduce")(*args)  # type: ignore[no-any-return]
    return drop_post_reduce_stream(_v13._foreach_reduce_mixed(*args))  # [2.12]


def _replacements() -> list[tuple[Any, str, Any]]:
    return [
        (_fs, "_init_param_group", _v13._init_param_group),
        (_group.FSDPParamGroup, "_init_mp_dtypes", _v13._init_mp_dtypes),
        (_coll, "_get_param_all_gather_inputs", _v13._get_param_all_gather_inputs),
        (_group, "foreach_reduce", foreach_reduce),
    ]


def install() -> None:
    """Swap the four functions in; idempotent."""
    _replaced.install(_replacements())


def uninstall() -> None:
    """Restore the original functions; idempotent."""
    _replaced.uninstall()


def is_installed() -> bool:
    """Whether ``install`` has run and ``uninstall`` has not."""
    return _replaced.is_installed(_replacements())
