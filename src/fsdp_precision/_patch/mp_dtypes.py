"""``FSDPParamGroup._init_mp_dtypes``: per-parameter dtypes at a mapped unit's lazy init.

Each ``FSDPParam`` gets its own ``param_dtype``/``reduce_dtype`` through torch's own
``FSDPParam.init_dtype_attrs`` with a per-parameter policy (same clamping rules); the unit may mix
storage dtypes and keeps one reduce dtype. Units without mapped parameters take torch's original.
On 2.15 (``mixed_dtype_reduce``) this drops exactly its two asserts ("FSDP expects uniform
original parameter dtype", "... uniform reduce dtype") and sets the same group state.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._patch import registry
from fsdp_precision._patch.tags import MAPPED_UNIT_ATTR, mapped_dtype

__all__ = ["init_mp_dtypes"]

#: Plain per-parameter policies by unit policy and dtype; weak, so that a unit's policy dies with
#: it (``remove_param_dtype_map_patch`` refuses while a mapped policy is alive).
_per_param_policies: weakref.WeakKeyDictionary[Hashable, dict[torch.dtype, MixedPrecisionPolicy]]
_per_param_policies = weakref.WeakKeyDictionary()


def _policy_for(policy: MixedPrecisionPolicy, dtype: torch.dtype) -> MixedPrecisionPolicy:
    by_dtype = _per_param_policies.setdefault(policy, {})
    cached = by_dtype.get(dtype)
    if cached is None:
        cached = MixedPrecisionPolicy(
            param_dtype=dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
        by_dtype[dtype] = cached
    return cached


def init_mp_dtypes(self: Any) -> None:
    """Per-parameter dtypes; the unit keeps one reduce dtype and may mix storage dtypes."""
    if not any(mapped_dtype(p) is not None for p in self.fsdp_params):
        return registry.original(_group.FSDPParamGroup, "_init_mp_dtypes")(self)  # type: ignore[no-any-return]
    for fsdp_param in self.fsdp_params:
        setattr(fsdp_param, MAPPED_UNIT_ATTR, True)
        mapped = mapped_dtype(fsdp_param)
        base = fsdp_param.mp_policy  # the unit's policy, on every release
        policy = base if mapped is None else _policy_for(base, mapped)
        # Upstream clamps: param_dtype -> None when equal to storage or (2.12+) non-floating;
        # before 2.15, reduce_dtype -> None when equal to this parameter's compute dtype.
        fsdp_param.init_dtype_attrs(policy)
    trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
    # A unit frozen at its first forward may be unfrozen later: take its floating parameters
    # then, as torch 2.14 does (2.12 and 2.13 left the reduce dtype unset and reduced in bf16).
    trainable = trainable or [p for p in self.fsdp_params if p.orig_dtype.is_floating_point]
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
    release = registry.traits()
    if release.mixed_dtype_reduce:
        # 2.15 needs no _orig_dtype: its foreach_reduce casts each gradient run to its
        # parameter's sharded_grad_dtype, which init_dtype_attrs set per parameter above.
        _init_grad_dtype_state(self)
    else:
        orig_dtypes = {p.orig_dtype for p in trainable}
        # None marks mixed storage: foreach_reduce then casts each gradient to its own dtype.
        self._orig_dtype = next(iter(orig_dtypes)) if len(orig_dtypes) == 1 else None
        self._reduce_dtype = next(iter(reduce_dtypes)) if trainable else None
    if not release.clamps_non_floating:
        # Before 2.12 init_dtype_attrs does not clamp non-floating parameters: mapped units
        # apply 2.12's clamp, so a frozen integer parameter is gathered in its own dtype.
        for fsdp_param in self.fsdp_params:
            if not fsdp_param.orig_dtype.is_floating_point:
                fsdp_param.param_dtype = None
    return None


def _init_grad_dtype_state(self: Any) -> None:
    """2.15's group state after the per-parameter dtypes, as its ``_init_mp_dtypes`` sets it
    for uniform units: the policy's ``reduce_dtype`` (None: ``_get_reduce_dtype`` promotes over
    the gradient dtypes at each backward, 2.15's rule), and the parameters whose gradient dtype
    is wider than their compute dtype (their upcast is deferred to the reduce-scatter copy-in)."""
    self._reduce_dtype = self.fsdp_params[0].mp_policy.reduce_dtype
    self._fsdp_params_with_wider_grad_dtype = [
        p
        for p in self.fsdp_params
        if (grad_dtype := p.unsharded_grad_dtype) is not None
        and (compute_dtype := p.param_dtype or p.orig_dtype).is_floating_point
        and grad_dtype.is_floating_point
        and grad_dtype.itemsize > compute_dtype.itemsize
        and not p.may_reduce_grad_outside_dp
    ]
