"""Per-parameter dtypes inside one FSDP2 unit: the implementation for torch 2.13 and 2.14.

``_impl_v2_12`` and ``_impl_v2_11`` reuse it, replacing only what those releases do differently.

Everything here touches FSDP2 internals. It is imported only by a release module after that
module verified the source hash of every upstream function below (replaced or relied on).

What changes, and only for units whose policy is a ``ParamDtypeMixedPrecisionPolicy`` with a
non-empty map (every other unit takes the original functions, bitwise):

* ``_init_param_group`` (wrapped): resolves the map to exact parameters before anything is
  sharded, then tags each ``FSDPParam`` with its mapped dtype.
* ``FSDPParamGroup._init_mp_dtypes``: per-parameter ``param_dtype``/``reduce_dtype`` through the
  upstream ``FSDPParam.init_dtype_attrs``; mixed storage dtypes allowed; one reduce dtype.
* ``_get_param_all_gather_inputs``: the foreach-copy fast path, one flat copy per target dtype
  (upstream casts every parameter to the first one's dtype). Mixed dtypes then travel as bytes
  through FSDP's own uint8 all-gather path: still one all-gather per unit.
* ``foreach_reduce``: one reduce-scatter in the unit's reduce dtype whatever the gradient dtypes,
  each sharded gradient cast back to its own parameter's storage dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    _get_dim0_padded_size,
    _to_dtype_if_needed,
)
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.distributed.tensor import DTensor

from fsdp_precision._dtypes import dtype_name
from fsdp_precision._errors import ParamDtypeMapError
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._resolve import resolve_param_dtype_map

from ._common import Replacements, bind_mp_policy, has_map, undo_state_init

logger = logging.getLogger(__name__)

#: FSDPParam attribute holding the mapped compute dtype (absent or None: unmapped).
MAPPED_DTYPE_ATTR = "_fsdp_precision_dtype"
#: FSDPParam attribute set on every parameter of a unit with mapped parameters, so that the hot
#: paths of other units cost one attribute lookup before delegating to torch.
MAPPED_UNIT_ATTR = "_fsdp_precision_unit"

# The originals of what ``install`` swapped in, restored by ``uninstall``.
_replaced = Replacements()
_original = _replaced.original


def _mapped_dtype(fsdp_param: FSDPParam) -> torch.dtype | None:
    return getattr(fsdp_param, MAPPED_DTYPE_ATTR, None)


# --------------------------------------------------------------------------- construction


def _init_param_group(
    state: Any,
    params: list[nn.Parameter],
    modules: tuple[nn.Module, ...],
    *args: Any,
    **kwargs: Any,
) -> None:
    """Resolve the map before ``FSDPParamGroup`` shards anything, then tag each ``FSDPParam``."""
    original = _original(_fs, "_init_param_group")
    mp_policy = bind_mp_policy(args, kwargs)
    if not has_map(mp_policy):
        return original(state, params, modules, *args, **kwargs)  # type: ignore[no-any-return]
    try:
        assert isinstance(mp_policy, ParamDtypeMixedPrecisionPolicy)  # has_map
        resolved = resolve_param_dtype_map(modules, params, mp_policy)
    except ParamDtypeMapError:
        undo_state_init(state, modules)
        raise
    num_groups = len(state._fsdp_param_groups)
    original(state, params, modules, *args, **kwargs)
    for param_group in state._fsdp_param_groups[num_groups:]:
        for fsdp_param in param_group.fsdp_params:
            info = fsdp_param._module_info
            dtype = resolved.by_slot.get((id(info.module), info.param_name))
            setattr(fsdp_param, MAPPED_DTYPE_ATTR, dtype)
    if logger.isEnabledFor(logging.DEBUG):
        mapped = {
            fqns[0]: dtype_name(resolved.by_param[pid])
            for pid, fqns in resolved.fqns.items()
            if pid in resolved.by_param
        }
        logger.debug("fully_shard(%s): mapped %s", type(modules[0]).__name__, mapped)


# --------------------------------------------------------------------------- dtypes


_per_param_policies: dict[tuple[Hashable, torch.dtype], MixedPrecisionPolicy] = {}


def _policy_for(policy: MixedPrecisionPolicy, dtype: torch.dtype) -> MixedPrecisionPolicy:
    key = (policy, dtype)
    cached = _per_param_policies.get(key)
    if cached is None:
        cached = MixedPrecisionPolicy(
            param_dtype=dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
        _per_param_policies[key] = cached
    return cached


def _init_mp_dtypes(self: Any) -> None:
    """Per-parameter dtypes; the unit keeps one reduce dtype and may mix storage dtypes."""
    if not any(_mapped_dtype(p) is not None for p in self.fsdp_params):
        return _original(_group.FSDPParamGroup, "_init_mp_dtypes")(self)  # type: ignore[no-any-return]
    for fsdp_param in self.fsdp_params:
        setattr(fsdp_param, MAPPED_UNIT_ATTR, True)
        mapped = _mapped_dtype(fsdp_param)
        policy = self.mp_policy if mapped is None else _policy_for(self.mp_policy, mapped)
        # Upstream clamps: param_dtype -> None when equal to storage or non-floating;
        # reduce_dtype -> None when equal to this parameter's compute dtype.
        fsdp_param.init_dtype_attrs(policy)
    trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
    # A unit frozen at its first forward may be unfrozen later: take its floating parameters
    # then, as torch 2.14 does (2.13 left the reduce dtype unset and reduced in bf16).
    trainable = trainable or [p for p in self.fsdp_params if p.orig_dtype.is_floating_point]
    orig_dtypes = {p.orig_dtype for p in trainable}
    # None marks mixed storage: foreach_reduce then casts each gradient to its own dtype.
    self._orig_dtype = next(iter(orig_dtypes)) if len(orig_dtypes) == 1 else None
    reduce_dtypes = {p.reduce_dtype or p.param_dtype or p.orig_dtype for p in trainable}
    if len(reduce_dtypes) > 1:
        # Checked at fully_shard time too; dtypes or requires_grad may have changed since.
        names = ", ".join(
            f"{p._module_info.param_name}: {dtype_name(p.param_dtype or p.orig_dtype)}"
            for p in trainable[:6]
        )
        raise ParamDtypeMapError(
            f"trainable parameters of FSDP unit {self._module_fqn or '<root>'} compute in "
            f"different dtypes ({names}, ...) but reduce_dtype is None; set reduce_dtype "
            "explicitly (usually torch.float32)"
        )
    self._reduce_dtype = next(iter(reduce_dtypes)) if trainable else None


# --------------------------------------------------------------------------- all-gather


def _use_foreach_copy(fsdp_param: FSDPParam) -> bool:
    # Same predicate as upstream's fast path.
    return (
        fsdp_param.param_dtype is not None
        and not fsdp_param.offload_to_cpu
        and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
    )


@torch.no_grad()
def _get_param_all_gather_inputs(fsdp_params: list[FSDPParam]) -> list[list[torch.Tensor]]:
    """Upstream's foreach-copy fast path, with one flat buffer and one copy per target dtype."""
    if not getattr(fsdp_params[0], MAPPED_UNIT_ATTR, False) or (
        len({p.param_dtype for p in fsdp_params if _use_foreach_copy(p)}) <= 1
    ):
        return _original(_coll, "_get_param_all_gather_inputs")(fsdp_params)  # type: ignore[no-any-return]
    inputs: list[list[torch.Tensor]] = [[] for _ in fsdp_params]
    by_dtype: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
    for i, fsdp_param in enumerate(fsdp_params):
        if not _use_foreach_copy(fsdp_param):
            inputs[i] = fsdp_param.all_gather_inputs
            continue
        source = (
            fsdp_param._sharded_param_data
            if fsdp_param.sharded_state == ShardedState.SHARDED
            else fsdp_param._sharded_post_forward_param_data
        )
        assert fsdp_param.param_dtype is not None and source is not None
        indices, sources = by_dtype.setdefault(fsdp_param.param_dtype, ([], []))
        indices.append(i)
        sources.append(source)
    for dtype, (indices, sources) in by_dtype.items():
        numels = [t.numel() for t in sources]
        flat = torch.empty((sum(numels),), device=fsdp_params[indices[0]].device, dtype=dtype)
        splits = torch.split(flat, numels)
        torch._foreach_copy_(splits, sources)
        for i, split in zip(indices, splits, strict=True):
            inputs[i] = [split]
    return inputs


# --------------------------------------------------------------------------- reduce-scatter


def _runs(keys: Sequence[Hashable]) -> list[tuple[int, int]]:
    """``[a, a, b, b, b]`` -> ``[(0, 2), (2, 5)]``."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return runs


def _rank_by_first_seen(values: Sequence[Hashable]) -> dict[Hashable, int]:
    ranks: dict[Hashable, int] = {}
    for value in values:
        ranks.setdefault(value, len(ranks))
    return ranks


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
    """Upstream ``foreach_reduce`` for uniform units; one reduce-scatter for mixed ones."""
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
    if is_uniform(fsdp_params, unsharded_grads, orig_dtype):
        return _original(_group, "foreach_reduce")(*args)  # type: ignore[no-any-return]
    return _foreach_reduce_mixed(*args)


def is_uniform(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    orig_dtype: torch.dtype | None,
) -> bool:
    """Whether upstream ``foreach_reduce`` can take this unit's gradients as they are."""
    return not getattr(fsdp_params[0], MAPPED_UNIT_ATTR, False) or (
        len({g.dtype for g in unsharded_grads}) == 1
        and all(p.orig_dtype == orig_dtype for p in fsdp_params)
    )


def _foreach_reduce_mixed(
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
    force_sum_reduction_for_comms: bool,
    *,
    run_grad_hooks: bool = True,
) -> tuple[Any, ...]:
    # Mirrors upstream foreach_reduce (2.13/2.14) step for step; the differences are marked
    # [mixed]. Everything not marked is upstream's logic. ``run_grad_hooks=False`` skips the
    # post-accumulate-grad hooks (torch 2.11 skips them under compiled autograd).
    # [mixed] Gradients in several dtypes need the explicit reduce dtype of contract point 5 (a
    # parameter unfrozen after fully_shard can get here without one); uniform gradients over
    # mixed storage take upstream's rule.
    grad_dtypes = {g.dtype for g in unsharded_grads}
    if len(grad_dtypes) > 1 and (
        reduce_dtype is None or fsdp_params[0].mp_policy.reduce_dtype is None
    ):
        seen = sorted(dtype_name(d) for d in grad_dtypes)
        raise ParamDtypeMapError(
            f"an FSDP unit produced gradients in several dtypes {seen} but has no reduce_dtype; "
            "set reduce_dtype explicitly (usually torch.float32)"
        )
    reduce_dtype = reduce_dtype or unsharded_grads[0].dtype
    # [mixed] Order parameters so that each (storage dtype, gradient dtype) class is one run:
    # the copy-in then takes one chunk_cat per run and the copy-out one cast per storage dtype.
    orig_rank = _rank_by_first_seen([p.orig_dtype for p in fsdp_params])
    grad_rank = _rank_by_first_seen([g.dtype for g in unsharded_grads])
    order = sorted(
        range(len(fsdp_params)),
        key=lambda i: (orig_rank[fsdp_params[i].orig_dtype], grad_rank[unsharded_grads[i].dtype]),
    )
    fsdp_params = [fsdp_params[i] for i in order]
    grads = [unsharded_grads[i] for i in order]
    unsharded_grads.clear()

    (predivide_factor, postdivide_factor, reduce_scatter_op, all_reduce_op) = (
        _coll._get_gradient_divide_factors(
            reduce_scatter_group,
            all_reduce_group,
            reduce_dtype,
            device.type,
            gradient_divide_factor,
            force_sum_reduction_for_comms,
        )
    )
    world_size = 1 if reduce_scatter_group is None else reduce_scatter_group.size()
    device_handle = _get_device_handle(device.type)
    current_stream = device_handle.current_stream()

    if world_size > 1:
        for i, (fsdp_param, grad) in enumerate(zip(fsdp_params, grads, strict=True)):
            if (shard_dim := fsdp_param.fsdp_placement.dim) == 0:
                continue
            if grad.size(shard_dim) % world_size != 0:
                raise AssertionError(
                    f"Shard({shard_dim}) requires even sharding: {grad.size()=} {world_size=}"
                )
            grads[i] = torch.cat(torch.chunk(grad, world_size, dim=shard_dim), dim=0)

    padded_unsharded_sizes = tuple(_get_dim0_padded_size(g.size(), world_size) for g in grads)
    columns = [s.numel() // world_size for s in padded_unsharded_sizes]
    reduce_scatter_input_numel = sum(s.numel() for s in padded_unsharded_sizes)
    reduce_scatter_output_numel = reduce_scatter_input_numel // world_size
    reduce_scatter_input = reduce_scatter_comm.allocate(
        (reduce_scatter_input_numel,), dtype=reduce_dtype, device=device
    )
    # [mixed] copy-in: one chunk_cat per gradient-dtype run, into that run's columns of the
    # (world_size, numel / world_size) send buffer; each casts to reduce_dtype as it copies.
    rows = reduce_scatter_input.view(world_size, -1)
    column = 0
    for start, stop in _runs([g.dtype for g in grads]):
        width = sum(columns[start:stop])
        out = rows if (start, stop) == (0, len(grads)) else rows[:, column : column + width]
        torch.ops.fsdp.chunk_cat(grads[start:stop], dim=0, num_chunks=world_size, out=out)
        column += width
    grads.clear()  # only after the copy-in can the gradients be freed
    reduce_scatter_stream.wait_stream(current_stream)
    all_reduce_input = None
    all_reduce_event = None

    with device_handle.stream(reduce_scatter_stream):
        reduce_output = reduce_scatter_comm.allocate(
            (reduce_scatter_output_numel,), dtype=reduce_dtype, device=device
        )
        _coll._div_if_needed(reduce_scatter_input, predivide_factor)
        if world_size > 1:
            reduce_scatter_comm(
                output_tensor=reduce_output,
                input_tensor=reduce_scatter_input,
                group=reduce_scatter_group,
                op=reduce_scatter_op,
            )
        elif gradient_divide_factor is not None:
            reduce_output.copy_(reduce_scatter_input / gradient_divide_factor)
        else:
            reduce_output.copy_(reduce_scatter_input)
        reduce_scatter_event = reduce_scatter_stream.record_event()
        post_reduce_stream = reduce_scatter_stream
        if all_reduce_group is not None:  # HSDP or DDP/replicate
            if not all_reduce_grads:
                if partial_reduce_output is not None:
                    partial_reduce_output += reduce_output
                else:
                    partial_reduce_output = reduce_output
                return (
                    reduce_scatter_input,
                    reduce_scatter_event,
                    post_reduce_stream,
                    post_reduce_stream.record_event(),
                    all_reduce_input,
                    all_reduce_event,
                    partial_reduce_output,
                )
            if partial_reduce_output is not None:
                reduce_output += partial_reduce_output
            post_reduce_stream = all_reduce_stream
            all_reduce_stream.wait_stream(reduce_scatter_stream)
            with device_handle.stream(all_reduce_stream):
                dist.all_reduce(reduce_output, group=all_reduce_group, op=all_reduce_op)
                # Held across layers by FSDPParamGroup._all_reduce_state (see upstream).
                all_reduce_input = reduce_output
                all_reduce_event = all_reduce_stream.record_event()

    if all_reduce_hook is not None:
        post_reduce_stream = all_reduce_stream
        all_reduce_stream.wait_stream(reduce_scatter_stream)
        with device_handle.stream(all_reduce_stream):
            all_reduce_hook(reduce_output)

    with device_handle.stream(post_reduce_stream):
        _coll._div_if_needed(reduce_output, postdivide_factor)
        # [mixed] cast out per storage-dtype run instead of once to the unit's orig_dtype
        flat_offset = 0
        for start, stop in _runs([p.orig_dtype for p in fsdp_params]):
            run_numel = sum(columns[start:stop])
            run_output = _to_dtype_if_needed(
                reduce_output.narrow(0, flat_offset, run_numel), fsdp_params[start].orig_dtype
            )
            base = run_output.storage_offset()
            for fsdp_param, width in zip(fsdp_params[start:stop], columns[start:stop], strict=True):
                new_sharded_grad = torch.as_strided(
                    run_output,
                    size=fsdp_param.sharded_size,
                    stride=fsdp_param.contiguous_sharded_stride,
                    storage_offset=base,
                )
                _assign_sharded_grad(
                    fsdp_param, new_sharded_grad, post_reduce_stream, run_grad_hooks
                )
                base += width
            flat_offset += run_numel
        post_reduce_event = post_reduce_stream.record_event()
    return (
        reduce_scatter_input,
        reduce_scatter_event,
        post_reduce_stream,
        post_reduce_event,
        all_reduce_input,
        all_reduce_event,
        None,
    )


def _assign_sharded_grad(
    fsdp_param: FSDPParam,
    new_sharded_grad: torch.Tensor,
    post_reduce_stream: torch.Stream,
    run_grad_hooks: bool = True,
) -> None:
    # Upstream's per-parameter view-out (CPU offload, accumulation, post-accumulate hooks).
    to_accumulate_grad = fsdp_param.sharded_param.grad is not None
    if fsdp_param.offload_to_cpu:
        has_post_acc_grad_hook = bool(
            getattr(fsdp_param.sharded_param, "_post_accumulate_grad_hooks", None)
        )
        non_blocking = (
            fsdp_param.pin_memory and not to_accumulate_grad and not has_post_acc_grad_hook
        )
        new_sharded_grad = new_sharded_grad.to(torch.device("cpu"), non_blocking=non_blocking)
        if non_blocking:
            fsdp_param.grad_offload_event = post_reduce_stream.record_event()
    if to_accumulate_grad:
        grad = fsdp_param.sharded_param.grad
        if not isinstance(grad, DTensor):
            raise AssertionError(f"Expected sharded grad to be a DTensor, got {type(grad)}")
        grad._local_tensor += new_sharded_grad
    else:
        fsdp_param.sharded_param.grad = fsdp_param.to_sharded_dtensor(new_sharded_grad)
    if not run_grad_hooks:
        return
    hooks = getattr(fsdp_param.sharded_param, "_post_accumulate_grad_hooks", {}) or {}
    for hook in hooks.values():
        hook(fsdp_param.sharded_param)


# --------------------------------------------------------------------------- install


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
