"""Resolve a ``param_dtype_map`` against the parameters one ``fully_shard`` call manages.

Pure public torch: runs before anything is sharded, so a rejected map leaves the model as it was.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._base.dtypes import dtype_name, dtype_repr
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._policy.casts import ModuleCast, resolve_casts
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.scope import resolve_by_slot

__all__ = ["ResolvedMap", "own_format_message", "resolve_param_dtype_map"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedMap:
    """The outcome of resolving a map for one ``fully_shard`` call.

    Attributes:
        by_param: ``id(parameter) -> mapped dtype`` for every mapped managed parameter.
        by_slot: ``(id(owning module), attribute name) -> mapped dtype`` for every place a mapped
            parameter is registered (aliases included); FSDP records one of them per parameter.
        fqns: ``id(parameter) -> local FQNs`` for every managed parameter, aliases included.
        scope_entries: Root-relative entries of a model-scoped policy this call resolves
            (recorded on the scope once the call succeeds). (Default: empty)
        casts: The modules whose boundary casts this call installs once it succeeds, each with
            its cast. (Default: ``()``)
    """

    by_param: dict[int, torch.dtype]
    by_slot: dict[tuple[int, str], torch.dtype]
    fqns: dict[int, tuple[str, ...]]
    scope_entries: frozenset[str] = frozenset()
    casts: tuple[tuple[nn.Module, ModuleCast], ...] = ()


def resolve_param_dtype_map(
    modules: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    policy: ParamDtypeMixedPrecisionPolicy,
) -> ResolvedMap:
    """Check every key of ``policy.param_dtype_map`` and return the per-parameter dtypes.

    ``modules`` are the modules passed to one ``fully_shard`` call (one, or several for a grouped
    call) and ``params`` the parameters that call manages. Raises :class:`ParamDtypeMapError`
    naming the key, the value and the fix for: keys matching no managed parameter (with a
    did-you-mean), keys naming parameters owned by an inner unit or ignored, aliases mapped to
    conflicting dtypes, mapped non-floating parameters, and mixed trainable compute dtypes
    without an explicit ``reduce_dtype``.
    """
    if getattr(policy, "scope", None) is not None:  # a model_policy: by slot, not by key
        return _resolve_scoped(modules, params, policy)
    if not params:  # Miles passes one policy to every call: nothing to map here
        _warn_unknown_keys(modules, policy)
        return ResolvedMap(by_param={}, by_slot={}, fqns={})
    managed = {id(p) for p in params}
    fqns: dict[int, list[str]] = {}
    unmanaged: dict[str, torch.Tensor] = {}
    by_name: dict[str, list[nn.Parameter]] = {}
    for module in modules:
        for fqn, param in module.named_parameters(remove_duplicate=False):
            if id(param) in managed:
                fqns.setdefault(id(param), []).append(fqn)
                by_name.setdefault(fqn, []).append(param)
            else:
                unmanaged.setdefault(fqn, param)

    dtype_map = policy.param_dtype_map or {}
    by_param: dict[int, torch.dtype] = {}
    first_key: dict[int, str] = {}
    for key, dtype in dtype_map.items():
        hits = by_name.get(key)
        if not hits:
            raise ParamDtypeMapError(_unknown_key_message(key, by_name, unmanaged))
        for param in hits:
            if not (param.dtype.is_floating_point):
                raise ParamDtypeMapError(
                    f"param_dtype_map key {key!r} names a {dtype_name(param.dtype)} parameter; "
                    "mixed precision applies to floating parameters only: remove the key "
                    "(FSDP keeps the parameter's dtype), or pass it in ignored_params"
                )
            if hasattr(param, "fsdp_pre_all_gather"):
                raise ParamDtypeMapError(own_format_message(key, param))
            previous = by_param.get(id(param))
            if previous is not None and previous != dtype:
                raise ParamDtypeMapError(
                    f"param_dtype_map maps one shared parameter to two dtypes: "
                    f"{first_key[id(param)]!r} -> {dtype_repr(previous)} and {key!r} -> "
                    f"{dtype_repr(dtype)}; "
                    "aliases of a tied parameter must name the same dtype"
                )
            by_param[id(param)] = dtype
            first_key.setdefault(id(param), key)

    _check_trainable(params, fqns)
    _check_reduce_dtype(params, by_param, fqns, policy)
    by_slot: dict[tuple[int, str], torch.dtype] = {}
    for module in modules:
        for submodule in module.modules():
            for name, slot in submodule._parameters.items():
                if slot is not None and id(slot) in by_param:
                    by_slot[(id(submodule), name)] = by_param[id(slot)]
    return ResolvedMap(
        by_param=by_param,
        by_slot=by_slot,
        fqns={k: tuple(v) for k, v in fqns.items()},
        casts=resolve_casts(modules, policy.module_casts or {}),
    )


def own_format_message(name: str, param: torch.Tensor) -> str:
    """Why a parameter that all-gathers in its own format cannot be mapped, and what to do."""
    return (
        f"parameter {name!r} is a {type(param).__name__}: it all-gathers in a format of its own "
        "(its class defines FSDP's fsdp_pre_all_gather, e.g. torchao's float8 weights), "
        "whatever dtype a map names, so it cannot be kept in another dtype. Leave it out of "
        "the map and the rules, or keep its module out of the conversion (torchao: "
        "convert_to_float8_training(..., module_filter_fn=...))"
    )


def _resolve_scoped(
    modules: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    policy: ParamDtypeMixedPrecisionPolicy,
) -> ResolvedMap:

    scope = policy.scope  # type: ignore[attr-defined]
    by_param, by_slot, local, entries = resolve_by_slot(modules, params, scope)
    _check_trainable(params, local)
    _check_reduce_dtype(params, by_param, local, policy)
    return ResolvedMap(
        by_param=by_param,
        by_slot=by_slot,
        fqns={k: tuple(v) for k, v in local.items()},
        scope_entries=frozenset(entries),
        casts=scope.casts_under(modules),
    )


def _check_trainable(params: Sequence[nn.Parameter], fqns: dict[int, list[str]]) -> None:
    for param in params:
        if param.requires_grad and param.is_complex():
            raise ParamDtypeMapError(
                f"trainable complex parameter {fqns[id(param)][0]!r} "
                f"({dtype_name(param.dtype)}) cannot share a unit's reduce-scatter with real "
                "gradients once the unit mixes dtypes; pass it in ignored_params (and reduce "
                "its gradient yourself), freeze it, or wrap it in its own fully_shard unit"
            )


def _warn_unknown_keys(
    modules: Sequence[nn.Module], policy: ParamDtypeMixedPrecisionPolicy
) -> None:
    """A call that manages no parameter maps nothing, and its keys are no error (Miles passes
    one policy to every call; inner units own what they name, relative to themselves). A key
    that names no parameter under the call, relative to any module, is a typo nothing would
    ever report: warned, with a did-you-mean."""
    names = {n for m in modules for n, _ in m.named_parameters(remove_duplicate=False)}
    unknown = [
        k
        for k in policy.param_dtype_map or {}
        if not any(n == k or n.endswith("." + k) for n in names)
    ]
    logger.debug(
        "fully_shard(%s) manages no parameter: its param_dtype_map (%d keys) maps nothing",
        type(modules[0]).__name__,
        len(policy.param_dtype_map or {}),
    )
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], sorted(names), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    warnings.warn(
        f"fully_shard({type(modules[0]).__name__}) manages no parameter, and param_dtype_map "
        f"keys {unknown[:4]} name no parameter under it{hint}: they map nothing in this call "
        "or any other. Keys are FQNs relative to the module passed to fully_shard; fix or "
        "remove them",
        UserWarning,
        stacklevel=2,
    )


def _unknown_key_message(
    key: str, by_name: dict[str, list[nn.Parameter]], unmanaged: dict[str, torch.Tensor]
) -> str:
    if key in unmanaged:
        owner = (
            "an inner fully_shard unit (it is already sharded): map it in that unit's policy"
            if isinstance(unmanaged[key], DTensor)
            else "ignored_params: remove it from ignored_params, or drop the key"
        )
        return (
            f"param_dtype_map key {key!r} names a parameter this fully_shard call does not "
            f"manage; it belongs to {owner}"
        )
    close = difflib.get_close_matches(key, list(by_name), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    some = ", ".join(repr(n) for n in list(by_name)[:5]) or "none"
    return (
        f"param_dtype_map key {key!r} matches no parameter managed by this fully_shard call"
        f"{hint}; keys are exact FQNs relative to the module passed to fully_shard "
        f"(managed names include {some})"
    )


def _check_reduce_dtype(
    params: Sequence[nn.Parameter],
    by_param: dict[int, torch.dtype],
    fqns: dict[int, list[str]],
    policy: ParamDtypeMixedPrecisionPolicy,
) -> None:
    """Contract point 5: trainable parameters computing in several dtypes need a reduce dtype."""
    if policy.reduce_dtype is not None:
        return
    compute: dict[torch.dtype, str] = {}
    for param in params:
        if not param.requires_grad:
            continue  # frozen parameters produce no gradient to reduce
        if not param.dtype.is_floating_point:
            continue
        dtype = by_param.get(id(param)) or policy.param_dtype or param.dtype
        compute.setdefault(dtype, fqns[id(param)][0])
    if len(compute) > 1:
        examples = ", ".join(f"{fqn!r} computes in {dtype_repr(d)}" for d, fqn in compute.items())
        raise ParamDtypeMapError(
            "trainable parameters of one fully_shard unit compute in different dtypes "
            f"({examples}) but reduce_dtype is None, so no single reduce-scatter dtype exists; "
            "set reduce_dtype explicitly (usually torch.float32)"
        )
