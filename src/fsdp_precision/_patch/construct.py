"""The construction wrap: ``_init_param_group``, where a ``fully_shard`` call meets its map.

On every release the map is resolved against the parameters the call manages before
``FSDPParamGroup`` shards anything; an error undoes FSDP's state registration, so the call can be
retried. Then, depending on the installed release's traits:

* ``native_override`` (2.15) and the map is expressible: torch gets a plain
  ``MixedPrecisionPolicy`` whose ``param_dtype_override_fn`` is the translated map
  (:mod:`fsdp_precision._policy.native`);
* otherwise, ``patches_precision`` (2.11-2.15): each ``FSDPParam`` is tagged with its mapped
  dtype, which the replaced precision machinery (``mp_dtypes``, ``gather``, ``reduce``) reads;
* neither applies (a release with only ``native_override``; none today): ``ParamDtypeMapError``.

It relies on ``_init_param_group(state, params, modules, mesh_info, post_forward_mesh_info,
device, shard_placement_fn, mp_policy, offload_policy, ...)`` (the same leading parameters on
every supported release; 2.12 appended ``reshard_after_forward``) and on the composable-state
registration ``fully_shard`` does before it (``FSDPState.init``); both are hashed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import (
    ParamDtypeMapError,
    PolicyNotAppliedError,
    RankMismatchError,
)
from fsdp_precision._hf.recording import keep_output_recording
from fsdp_precision._patch import registry
from fsdp_precision._patch.tags import MAPPED_CALL_ATTR, MAPPED_DTYPE_ATTR, tag_call
from fsdp_precision._policy.agree import agree, call_record, checking
from fsdp_precision._policy.casts import install_cast
from fsdp_precision._policy.diagnose import class_name, install_diagnosis, kept_modules
from fsdp_precision._policy.inputs import install_input_cast
from fsdp_precision._policy.native import native_policy
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.refusals import (
    check_grad_dtype,
    check_manageable,
    needs_resolution,
    uses_native,
)
from fsdp_precision._policy.resolve import ResolvedMap, resolve_param_dtype_map
from fsdp_precision._releases.traits import ReleaseTraits

__all__ = ["bind_mp_policy", "init_param_group", "rebind_mp_policy", "undo_state_init"]

logger = logging.getLogger(__name__)

#: Index of ``mp_policy`` in ``_init_param_group``'s positional arguments after
#: ``(state, params, modules)``: (mesh_info, post_forward_mesh_info, device, shard_placement_fn,
#: mp_policy, offload_policy[, reshard_after_forward (2.12+)]).
_MP_POLICY_INDEX = 4


def init_param_group(
    state: Any,
    params: list[nn.Parameter],
    modules: tuple[nn.Module, ...],
    *args: Any,
    **kwargs: Any,
) -> None:
    """Resolve the map before ``FSDPParamGroup`` shards anything, then hand it to torch."""
    original = registry.original(_fs, "_init_param_group")
    mp_policy = bind_mp_policy(args, kwargs)
    try:
        check_grad_dtype(registry.traits(), modules, params)
        _check_input_cast(state, mp_policy)
    except ParamDtypeMapError as exc:
        _refuse(state, modules, params, args, mp_policy, exc)
        raise
    if not needs_resolution(mp_policy):
        _agree(state, modules, params, args, None, mp_policy)
        original(state, params, modules, *args, **kwargs)
        take_input_cast(state, modules, mp_policy)
        return None
    assert isinstance(mp_policy, ParamDtypeMixedPrecisionPolicy)  # needs_resolution
    release = registry.traits()
    try:
        resolved = resolve_param_dtype_map(modules, params, mp_policy)
        native = bool(resolved.by_param) and uses_native(release, params, resolved, mp_policy)
        if not native and not release.keeps_requires_grad:
            check_manageable(params, resolved.fqns)
    except ParamDtypeMapError as exc:
        _refuse(state, modules, params, args, mp_policy, exc)
        raise
    _agree(state, modules, params, args, resolved, mp_policy)
    if not resolved.by_param:  # nothing this call manages is mapped: torch's exact path
        original(state, params, modules, *args, **kwargs)
        _after_call(mp_policy, resolved, modules)
        take_input_cast(state, modules, mp_policy)
        return None
    before = len(state._fsdp_param_groups) if release.param_group_list else 0
    if native:
        args, kwargs = rebind_mp_policy(args, kwargs, native_policy(mp_policy, resolved))
    original(state, params, modules, *args, **kwargs)
    for param_group in _new_param_groups(state, before, release):
        for fsdp_param in param_group.fsdp_params:
            setattr(fsdp_param, MAPPED_CALL_ATTR, True)
            info = fsdp_param._module_info
            dtype = resolved.by_slot.get((id(info.module), info.param_name))
            tag_call(fsdp_param, mp_policy, dtype)  # for readers (export, hand-off)
            if not native:  # the patched machinery reads each parameter's mapped dtype
                setattr(fsdp_param, MAPPED_DTYPE_ATTR, dtype)
    _after_call(mp_policy, resolved, modules)
    take_input_cast(state, modules, mp_policy)
    if not native:  # the unit's gathers and reductions are the patch's from here on
        for module in modules:
            module.register_forward_pre_hook(_NeedsPatch(class_name(module), resolved))
    _log_mapped(modules, resolved, "native override" if native else "mapped")
    return None


class _NeedsPatch:
    """A forward pre-hook on a unit built under the patch with a map: after
    ``remove_param_dtype_map_patch`` its next forward stops by name instead of running torch's
    plain precision on a unit that maps parameters (appended after FSDP's pre-forward, as the
    diagnosis hooks are: torch 2.11's dynamo refuses a prepended hook in a compiled block; so
    the all-gather has run, alike on every rank, when it raises)."""

    def __init__(self, owner: str, resolved: ResolvedMap) -> None:
        self.owner = owner
        self.mapped = {
            fqns[0]: dtype_name(resolved.by_param[pid])
            for pid, fqns in list(resolved.fqns.items())
            if pid in resolved.by_param
        }

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or registry.is_applied():
            return
        shown = dict(list(self.mapped.items())[:3])
        raise PolicyNotAppliedError(
            f"this {self.owner} was wrapped by fully_shard with a param_dtype_map ({shown}"
            f"{', ...' if len(self.mapped) > 3 else ''}), and remove_param_dtype_map_patch() has "
            "since removed the patch its gathers and reductions need: it would compute its "
            "mapped parameters in another dtype. Call apply_param_dtype_map_patch() before "
            "running it, or wrap a fresh model"
        )


def _refuse(
    state: Any,
    modules: tuple[nn.Module, ...],
    params: list[nn.Parameter],
    args: Sequence[Any],
    policy: MixedPrecisionPolicy,
    exc: ParamDtypeMapError,
) -> None:
    """A refused call: the other ranks stop too, rather than wait for this one; FSDP's
    registration is undone, so the call can be retried."""
    try:
        _agree(state, modules, params, args, None, policy, refusal=str(exc))
    except RankMismatchError:
        pass
    undo_state_init(state, modules)


def _agree(
    state: Any,
    modules: tuple[nn.Module, ...],
    params: list[nn.Parameter],
    args: Sequence[Any],
    resolved: ResolvedMap | None,
    policy: MixedPrecisionPolicy,
    refusal: str = "",
) -> None:
    """Compare what this call resolved across its mesh's ranks (``checking()``); on a
    difference every rank raises the same ``RankMismatchError``, FSDP's registration undone."""
    if not checking():
        return
    mesh_info, device = args[0], args[2]
    groups = [
        getattr(mesh_info, "shard_process_group", None),
        getattr(mesh_info, "replicate_process_group", None),
    ]
    names = resolved.fqns if resolved is not None else _local_names(modules)
    compute = resolved.by_param if resolved is not None else {}
    record = call_record(
        modules, params, names, compute, (policy.param_dtype, policy.reduce_dtype), refusal
    )
    try:
        agree(record, groups, device)
    except RankMismatchError:
        if not refusal:  # a refusing rank undoes and raises its own error
            undo_state_init(state, modules)
        raise


def take_input_cast(state: Any, modules: Sequence[nn.Module], policy: MixedPrecisionPolicy) -> None:
    """A policy with ``uncast_inputs``: the unit's input cast moves from FSDP into a forward
    hook on each module that leaves the named arguments alone. FSDP casts through the policy
    its state holds (``FSDPState.init`` stores it as ``_mp_policy``, a hashed function on every
    release; 2.15 stores a copy); that copy stops casting, the hook casts the rest as FSDP
    would, after FSDP's prepended pre-forward hook, which leaves the uncast inputs' values
    alone."""
    if not _takes_input_cast(policy):
        return
    assert isinstance(policy, ParamDtypeMixedPrecisionPolicy) and policy.param_dtype is not None
    state._mp_policy = replace(state._mp_policy, cast_forward_inputs=False)
    for module in modules:
        install_input_cast(module, policy.param_dtype, policy.uncast_inputs)


def _takes_input_cast(policy: MixedPrecisionPolicy) -> bool:
    return (
        isinstance(policy, ParamDtypeMixedPrecisionPolicy)
        and bool(policy.uncast_inputs)
        and policy.cast_forward_inputs
        and policy.param_dtype is not None  # else FSDP casts no input: nothing to leave out
    )


def _check_input_cast(state: Any, policy: MixedPrecisionPolicy) -> None:
    """Refuse ``uncast_inputs`` before anything is sharded where FSDP's state does not hold its
    policy where :func:`take_input_cast` turns its cast off."""
    if _takes_input_cast(policy) and not isinstance(
        getattr(state, "_mp_policy", None), MixedPrecisionPolicy
    ):
        raise ParamDtypeMapError(
            f"uncast_inputs needs FSDP's state to hold its policy as _mp_policy, which torch "
            f"{torch.__version__} does not; drop uncast_inputs (the inputs are cast) or use a "
            "supported torch release"
        )


def _local_names(modules: Sequence[nn.Module]) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for module in modules:
        for fqn, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(fqn)
    return names


def _after_call(
    policy: ParamDtypeMixedPrecisionPolicy, resolved: ResolvedMap, modules: Sequence[nn.Module]
) -> None:
    """After a successful call: record the model-scoped policy's entries it resolved, install
    the boundary casts and the hooks that name a kept parameter in a dtype error, and keep
    transformers' output recording of its modules, whose class ``fully_shard`` swaps next (for
    frameworks that call ``fully_shard`` themselves; ``PrecisionPlan.apply`` does it only
    for its unmapped units)."""
    scope = getattr(policy, "scope", None)
    if scope is not None:
        scope.resolved.update(resolved.scope_entries)
    for module, cast in resolved.casts:
        install_cast(module, cast, policy.param_dtype)
    if resolved.by_slot or resolved.casts:
        install_diagnosis(modules, kept_modules(modules, resolved.by_slot, resolved.casts))
    keep_output_recording(modules)


def _new_param_groups(state: Any, before: int, release: ReleaseTraits) -> list[Any]:
    """The ``FSDPParamGroup``s the original ``_init_param_group`` call just built."""
    if release.param_group_list:  # 2.12: per-parameter meshes, a list of groups
        return list(state._fsdp_param_groups[before:])
    group = state._fsdp_param_group  # 2.11: one group per call
    return [] if group is None else [group]


def _log_mapped(modules: tuple[nn.Module, ...], resolved: ResolvedMap, how: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        mapped = {
            fqns[0]: dtype_name(resolved.by_param[pid])
            for pid, fqns in resolved.fqns.items()
            if pid in resolved.by_param
        }
        logger.debug("fully_shard(%s): %s %s", type(modules[0]).__name__, how, mapped)


def bind_mp_policy(args: Sequence[Any], kwargs: dict[str, Any]) -> MixedPrecisionPolicy:
    """``mp_policy`` from ``_init_param_group``'s arguments after ``(state, params, modules)``."""
    if "mp_policy" in kwargs:
        return kwargs["mp_policy"]  # type: ignore[no-any-return]
    return args[_MP_POLICY_INDEX]  # type: ignore[no-any-return]


def rebind_mp_policy(
    args: Sequence[Any], kwargs: dict[str, Any], policy: MixedPrecisionPolicy
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same arguments with ``mp_policy`` replaced."""
    if "mp_policy" in kwargs:
        return tuple(args), {**kwargs, "mp_policy": policy}
    new_args = list(args)
    new_args[_MP_POLICY_INDEX] = policy
    return tuple(new_args), kwargs


def undo_state_init(state: Any, modules: tuple[nn.Module, ...]) -> None:
    """Undo what ``fully_shard`` did before ``_init_param_group``, so the call can be retried.

    Parameters are untouched at this point; only the FSDP state, its registration and the forward
    hooks that ``FSDPState.init`` added are removed.
    """
    for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        handle = getattr(state, name, None)
        if handle is not None:
            handle.remove()
    for module in modules:
        _module_state_mapping.pop(module, None)
        all_state = module.__dict__.get(STATE_KEY)
        if isinstance(all_state, dict):
            for func in [f for f in all_state if getattr(f, "__name__", "") == "fully_shard"]:
                del all_state[func]
        registry = module.__dict__.get(REGISTRY_KEY)
        if isinstance(registry, dict):
            registry.pop("fully_shard", None)
