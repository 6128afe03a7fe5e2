"""``foreach_reduce``: one reduce-scatter per mapped unit, whatever its gradient dtypes.

Uniform units (same gradient dtype, one storage dtype) take torch's original. A mixed unit
mirrors upstream ``foreach_reduce`` (2.13/2.14) step for step; the differences are marked
[mixed]: parameters are ordered so that each (storage dtype, gradient dtype) class is one run;
each run is copied into its columns of the send buffer by one ``chunk_cat`` (casting to the
reduce dtype as it copies); one reduce-scatter; one cast per storage dtype on the way out, each
sharded gradient landing in its parameter's storage dtype.

Release traits: ``foreach_reduce_results`` (six values before 2.13, which added
``post_reduce_stream``) and ``compiled_autograd_branches`` (2.11 skips post-accumulate-grad
hooks under compiled autograd). Kept from 2.13 on every release: CPU-offloaded gradients of
parameters with post-accumulate-grad hooks are copied blocking (2.11 and 2.12 copy them
non-blocking into pinned memory, which such a hook may read too early); it only applies to
pinned, CUDA-offloaded mixed units.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    _get_dim0_padded_size,
    _to_dtype_if_needed,
)
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor import DTensor

from fsdp_precision._base.dist import local_tensor
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._patch import registry
from fsdp_precision._patch.tags import in_mapped_call, in_mapped_unit

__all__ = ["foreach_reduce", "foreach_reduce_without_empty", "is_uniform"]


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
    if is_uniform(fsdp_params, unsharded_grads, orig_dtype):
        return registry.original(_group, "foreach_reduce")(  # type: ignore[no-any-return]
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
    reduce_dtype = _checked_reduce_dtype(fsdp_params, unsharded_grads, reduce_dtype)
    fsdp_params, grads = _in_runs(fsdp_params, unsharded_grads)
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
    _copy_in(grads, columns, reduce_scatter_input.view(world_size, -1), world_size)  # [mixed]
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
                return _results(
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
        _cast_out(fsdp_params, columns, reduce_output, post_reduce_stream)  # [mixed]
        post_reduce_event = post_reduce_stream.record_event()
    return _results(
        reduce_scatter_input,
        reduce_scatter_event,
        post_reduce_stream,
        post_reduce_event,
        all_reduce_input,
        all_reduce_event,
        None,
    )


@torch.no_grad()
def foreach_reduce_without_empty(
    fsdp_params: list[FSDPParam], unsharded_grads: list[torch.Tensor], *args: Any, **kwargs: Any
) -> tuple[Any, ...]:
    """torch's own ``foreach_reduce`` (2.15, ``mixed_dtype_reduce``), without the 0-size
    gradients of a mapped call, which its copy-in refuses ("_chunk_cat expects non-empty
    tensor"): they hold no columns of the reduce-scatter, and each gets its empty sharded gradient
    (and its post-accumulate-grad hooks) here. Any other unit goes to torch unchanged."""
    original = registry.original(_group, "foreach_reduce")
    empty = [i for i, g in enumerate(unsharded_grads) if not g.numel()]
    if not empty or len(empty) == len(unsharded_grads) or not in_mapped_call(fsdp_params[0]):
        return original(fsdp_params, unsharded_grads, *args, **kwargs)  # type: ignore[no-any-return]
    dropped = [fsdp_params[i] for i in empty]
    kept = [i for i in range(len(fsdp_params)) if i not in set(empty)]
    grads = [unsharded_grads[i] for i in kept]
    unsharded_grads.clear()  # the caller's list owns the gradients: freed as torch frees them
    results = original([fsdp_params[i] for i in kept], grads, *args, **kwargs)
    stream = _get_device_handle(dropped[0].device.type).current_stream()
    for fsdp_param in dropped:
        dtype = getattr(fsdp_param, "sharded_grad_dtype", None) or fsdp_param.orig_dtype
        local = local_tensor(fsdp_param.sharded_param)
        _assign_sharded_grad(fsdp_param, local.new_empty(local.shape, dtype=dtype), stream, True)
    return results  # type: ignore[no-any-return]


def is_uniform(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    orig_dtype: torch.dtype | None,
) -> bool:
    """Whether upstream ``foreach_reduce`` can take this unit's gradients as they are.

    Any unit, mapped or not, whose gradients arrive in several dtypes is not: upstream asserts
    there (pytorch #196996: with ``reduce_dtype`` set and accumulation without sync, a parameter
    first reached on the window's last microbatch brings a fresh gradient in its compute dtype
    beside the others' accumulated ones in the reduce dtype); contract point 3 reduces them all
    in the unit's reduce dtype, as for a mapped unit."""
    if len({g.dtype for g in unsharded_grads}) > 1:
        return False
    mapped = in_mapped_unit(fsdp_params[0])
    return not mapped or all(p.orig_dtype == orig_dtype for p in fsdp_params)


def _results(*values: Any) -> tuple[Any, ...]:
    """Upstream's seven result values (2.13 on), or the six of releases before 2.13, which
    lack ``post_reduce_stream`` (the third); nothing else moved."""
    if registry.traits().foreach_reduce_results == 6:
        return values[:2] + values[3:]
    return values


def _checked_reduce_dtype(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    reduce_dtype: torch.dtype | None,
) -> torch.dtype:
    """[mixed] Gradients in several dtypes need the explicit reduce dtype of contract point 5 (a
    parameter unfrozen after fully_shard can get here without one); uniform gradients over mixed
    storage take upstream's rule."""
    grad_dtypes = {g.dtype for g in unsharded_grads}
    if len(grad_dtypes) > 1 and (
        reduce_dtype is None or fsdp_params[0].mp_policy.reduce_dtype is None
    ):
        seen = sorted(dtype_name(d) for d in grad_dtypes)
        raise ParamDtypeMapError(
            f"an FSDP unit produced gradients in several dtypes {seen} but has no reduce_dtype; "
            "set reduce_dtype explicitly (usually torch.float32)"
        )
    return reduce_dtype or unsharded_grads[0].dtype


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


def _in_runs(
    fsdp_params: list[FSDPParam], unsharded_grads: list[torch.Tensor]
) -> tuple[list[FSDPParam], list[torch.Tensor]]:
    """[mixed] Order parameters so that each (storage dtype, gradient dtype) class is one run:
    the copy-in then takes one chunk_cat per run and the copy-out one cast per storage dtype."""
    orig_rank = _rank_by_first_seen([p.orig_dtype for p in fsdp_params])
    grad_rank = _rank_by_first_seen([g.dtype for g in unsharded_grads])
    order = sorted(
        range(len(fsdp_params)),
        key=lambda i: (orig_rank[fsdp_params[i].orig_dtype], grad_rank[unsharded_grads[i].dtype]),
    )
    return [fsdp_params[i] for i in order], [unsharded_grads[i] for i in order]


def _copy_in(
    grads: list[torch.Tensor], columns: list[int], rows: torch.Tensor, world_size: int
) -> None:
    """[mixed] One chunk_cat per gradient-dtype run, into that run's columns of the
    ``(world_size, numel / world_size)`` send buffer; each casts to its dtype as it copies.

    chunk_cat writes a dense ``out`` only: CUDA's fused kernel takes a contiguous output, and
    a run's columns of the buffer are not contiguous once there are two rows (world size 2 or
    more), where it falls back to padding and concatenating every gradient. A run that is not
    the whole row is therefore written to a dense buffer of its own, then copied into its
    columns (one strided copy)."""
    column = 0
    for start, stop in _runs([g.dtype for g in grads]):
        width = sum(columns[start:stop])
        # A 0-size gradient has no columns; chunk_cat refuses empty tensors, so it is left out.
        run = [g for g in grads[start:stop] if g.numel()]
        if run and width == rows.size(1):
            torch.ops.fsdp.chunk_cat(run, dim=0, num_chunks=world_size, out=rows)
        elif run:
            dense = rows.new_empty((rows.size(0), width))
            torch.ops.fsdp.chunk_cat(run, dim=0, num_chunks=world_size, out=dense)
            rows[:, column : column + width].copy_(dense)
        column += width


def _cast_out(
    fsdp_params: list[FSDPParam],
    columns: list[int],
    reduce_output: torch.Tensor,
    post_reduce_stream: torch.Stream,
) -> None:
    """[mixed] Cast out per storage-dtype run instead of once to the unit's orig_dtype."""
    run_grad_hooks = not registry.compiled_autograd_enabled()  # 2.11 skips them under it
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
            _assign_sharded_grad(fsdp_param, new_sharded_grad, post_reduce_stream, run_grad_hooks)
            base += width
        flat_offset += run_numel


def _assign_sharded_grad(
    fsdp_param: FSDPParam,
    new_sharded_grad: torch.Tensor,
    post_reduce_stream: torch.Stream,
    run_grad_hooks: bool,
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
