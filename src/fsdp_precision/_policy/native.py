"""torch 2.15's native per-parameter override: what it can express, and the translation.

torch 2.15 added ``MixedPrecisionPolicy.param_dtype_override_fn``: FSDP calls it once per managed
parameter (in ``FSDPParamGroup.__init__``, through ``MixedPrecisionPolicy._resolve_for_param``)
and accepts only ``None``, ``param_dtype`` or the parameter's own dtype. Its all-gather and
reduce-scatter already handle the resulting mix (parameters kept in their storage dtype skip the
cast; gradients of several dtypes are reduced together and cast back per dtype), so for such maps
nothing of FSDP's precision machinery is touched. The construction wrap (``_construct``) resolves
the exact-FQN map (the same checks and messages as on the other releases), asks :func:`refusal`
whether torch can express it, and hands torch :func:`native_policy` if so; otherwise the patched
machinery takes the unit (``patches_precision``). The override
function receives a parameter, not its name, which is why the construction site is wrapped.

Pure public torch: nothing here imports FSDP2 internals.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._base.dtypes import dtype_repr
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.resolve import ResolvedMap

__all__ = ["ParamDtypeOverride", "native_policy", "refusal"]


class ParamDtypeOverride:
    """The ``param_dtype_override_fn`` torch 2.15 calls: ``id(parameter) -> mapped dtype``.

    Built per ``fully_shard`` call from the resolved exact-FQN map; unmapped parameters get
    ``None`` (torch then uses ``param_dtype``).
    """

    __slots__ = ("by_param",)

    def __init__(self, by_param: dict[int, torch.dtype]) -> None:
        self.by_param = by_param

    def __call__(self, param: nn.Parameter) -> torch.dtype | None:
        return self.by_param.get(id(param))


def refusal(
    params: list[nn.Parameter], resolved: ResolvedMap, policy: ParamDtypeMixedPrecisionPolicy
) -> str | None:
    """Why torch's native override cannot express this map, or None when it can. The text is a
    ``ParamDtypeMapError`` message (the entries and the ways out) for a release without
    ``patches_precision``; on the supported releases the patched machinery takes such maps."""
    release = torch.__version__
    bad = [
        (resolved.fqns[pid][0], dtype, param.dtype)
        for param in params
        if (pid := id(param)) in resolved.by_param
        and (dtype := resolved.by_param[pid]) not in (policy.param_dtype, param.dtype)
    ]
    if bad:
        entries = ", ".join(f"{fqn!r}: {dtype_repr(d)}" for fqn, d, _ in bad)
        stored = ", ".join(f"{fqn!r} is stored in {dtype_repr(s)}" for fqn, _, s in bad)
        return (
            f"param_dtype_map entries {{{entries}}} cannot be expressed on torch {release}: "
            "its native MixedPrecisionPolicy.param_dtype_override_fn allows only param_dtype "
            f"({dtype_repr(policy.param_dtype)}) or the parameter's storage dtype ({stored}). "
            "Store those parameters in the mapped dtype, give them their own fully_shard unit "
            "with that param_dtype, or use torch 2.11-2.14, where fsdp_precision patches FSDP2 "
            "for any mappable dtype"
        )
    storage: dict[torch.dtype, str] = {}
    for param in params:
        if param.requires_grad and param.dtype.is_floating_point:
            storage.setdefault(param.dtype, resolved.fqns[id(param)][0])
    if len(storage) > 1:
        examples = ", ".join(f"{fqn!r} is stored in {dtype_repr(d)}" for d, fqn in storage.items())
        return (
            f"trainable parameters of one fully_shard unit have mixed storage dtypes ({examples}); "
            f"torch {release} requires one storage dtype per unit (FSDP expects uniform original "
            "parameter dtype). Store the unit in one dtype and map the exceptions, freeze the "
            "differently stored parameters, give them their own fully_shard unit, or use torch "
            "2.11-2.14, where fsdp_precision supports mixed storage in one unit"
        )
    return None


def native_policy(policy: ParamDtypeMixedPrecisionPolicy, resolved: ResolvedMap) -> Any:
    """A plain ``MixedPrecisionPolicy`` equal to ``policy`` with the map as the override fn."""
    return MixedPrecisionPolicy(  # type: ignore[call-arg]  # the 2.15 field
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
        param_dtype_override_fn=ParamDtypeOverride(dict(resolved.by_param)),
    )
