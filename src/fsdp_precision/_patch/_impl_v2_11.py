"""Per-parameter dtypes inside one FSDP2 unit: the implementation for torch 2.11.

The 2.12 implementation (``_impl_v2_12``, itself the 2.13 one with 2.12's six-value
``foreach_reduce`` result), with the four differences of 2.11, each marked [2.11] below:

* ``_init_param_group`` builds one ``FSDPParamGroup`` into ``state._fsdp_param_group``
  (2.12 introduced per-parameter meshes: a list, ``state._fsdp_param_groups``).
* ``FSDPParam.init_dtype_attrs`` does not clamp ``param_dtype`` for non-floating parameters
  (2.12 added that clamp); mapped units apply it, so a frozen integer parameter is gathered in
  its own dtype as on 2.12+. Unmapped units keep 2.11's behaviour exactly.
* ``_get_param_all_gather_inputs`` takes every parameter's own ``all_gather_inputs`` under
  compiled autograd (2.12 removed that branch); the replacement keeps it.
* ``foreach_reduce`` skips post-accumulate-grad hooks under compiled autograd (2.12 removed that
  guard); the mixed path keeps it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs
from torch.distributed.fsdp._fully_shard._fsdp_common import (  # type: ignore[attr-defined]  # 2.11 only
    compiled_autograd_enabled,
)
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from fsdp_precision._dtypes import dtype_name
from fsdp_precision._errors import ParamDtypeMapError
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._resolve import resolve_param_dtype_map

from . import _impl_v2_12 as _v12
from . import _impl_v2_13 as _v13
from ._common import bind_mp_policy, has_map, undo_state_init

logger = logging.getLogger(__name__)

# One registry with the 2.13 implementation: its functions look their originals up there.
_replaced = _v13._replaced


def _init_param_group(
    state: Any,
    params: list[nn.Parameter],
    modules: tuple[nn.Module, ...],
    *args: Any,
    **kwargs: Any,
) -> None:
    """Resolve the map before ``FSDPParamGroup`` shards anything, then tag each ``FSDPParam``."""
    original = _replaced.original(_fs, "_init_param_group")
    mp_policy = bind_mp_policy(args, kwargs)
    if not has_map(mp_policy):
        return original(state, params, modules, *args, **kwargs)  # type: ignore[no-any-return]
    try:
        assert isinstance(mp_policy, ParamDtypeMixedPrecisionPolicy)  # has_map
        resolved = resolve_param_dtype_map(modules, params, mp_policy)
        _check_manageable(params, resolved.fqns)
    except ParamDtypeMapError:
        undo_state_init(state, modules)
        raise
    original(state, params, modules, *args, **kwargs)
    param_group = state._fsdp_param_group  # [2.11] one group, not a list
    for fsdp_param in param_group.fsdp_params if param_group is not None else ():
        info = fsdp_param._module_info
        dtype = resolved.by_slot.get((id(info.module), info.param_name))
        setattr(fsdp_param, _v13.MAPPED_DTYPE_ATTR, dtype)
    if logger.isEnabledFor(logging.DEBUG):
        mapped = {
            fqns[0]: dtype_name(resolved.by_param[pid])
            for pid, fqns in resolved.fqns.items()
            if pid in resolved.by_param
        }
        logger.debug("fully_shard(%s): mapped %s", type(modules[0]).__name__, mapped)


def _check_manageable(params: list[nn.Parameter], fqns: dict[int, tuple[str, ...]]) -> None:
    """[2.11] FSDP2 makes every sharded parameter trainable (fixed in 2.12: it keeps
    ``requires_grad``), which fails for integral and boolean parameters: say so up front."""
    bad = [p for p in params if not (p.dtype.is_floating_point or p.dtype.is_complex)]
    if bad:
        names = ", ".join(f"{fqns[id(p)][0]!r} ({dtype_name(p.dtype)})" for p in bad[:4])
        raise ParamDtypeMapError(
            f"FSDP2 in torch {torch.__version__} cannot manage non-floating parameters ({names}): "
            "it creates every sharded parameter with requires_grad=True. Pass them in "
            "ignored_params, or use torch 2.12 or later, which keeps them frozen"
        )


def _init_mp_dtypes(self: Any) -> None:
    """The 2.13 replacement, plus 2.12's non-floating clamp for mapped units."""
    _v13._init_mp_dtypes(self)
    if not any(getattr(p, _v13.MAPPED_UNIT_ATTR, False) for p in self.fsdp_params):
        return
    for fsdp_param in self.fsdp_params:
        if not fsdp_param.orig_dtype.is_floating_point:  # [2.11] clamp added upstream in 2.12
            fsdp_param.param_dtype = None


@torch.no_grad()
def _get_param_all_gather_inputs(fsdp_params: list[FSDPParam]) -> list[list[torch.Tensor]]:
    """The 2.13 replacement, behind 2.11's compiled-autograd branch."""
    if compiled_autograd_enabled():  # [2.11] upstream's per-parameter path, dtypes included
        return _replaced.original(_coll, "_get_param_all_gather_inputs")(fsdp_params)  # type: ignore[no-any-return]
    return _v13._get_param_all_gather_inputs(fsdp_params)


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
    """The 2.12 replacement (six values), skipping grad hooks under compiled autograd."""
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
    result = _v13._foreach_reduce_mixed(
        *args,
        run_grad_hooks=not compiled_autograd_enabled(),  # [2.11]
    )
    return _v12.drop_post_reduce_stream(result)


def _replacements() -> list[tuple[Any, str, Any]]:
    return [
        (_fs, "_init_param_group", _init_param_group),
        (_group.FSDPParamGroup, "_init_mp_dtypes", _init_mp_dtypes),
        (_coll, "_get_param_all_gather_inputs", _get_param_all_gather_inputs),
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
