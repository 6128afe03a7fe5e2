"""torch 2.15: exact per-FQN maps through torch's native ``param_dtype_override_fn``.

torch 2.15 added ``MixedPrecisionPolicy.param_dtype_override_fn``: FSDP calls it once per managed
parameter (in ``FSDPParamGroup.__init__``, through ``MixedPrecisionPolicy._resolve_for_param``)
and accepts only ``None``, ``param_dtype`` or the parameter's own dtype. Its all-gather and
reduce-scatter already handle the resulting mix (parameters kept in their storage dtype skip the
cast; gradients of several dtypes are reduced together and cast back per dtype). So nothing of
FSDP's precision machinery is replaced here. The one wrapped function is the construction site,
``_init_param_group``, and only because the override function receives a parameter, not its name:

* it resolves the exact-FQN map against the parameters the call manages (the same checks and
  messages as on 2.13, did-you-mean included) before anything is sharded;
* it refuses, with :class:`ParamDtypeMapError`, maps that 2.15 cannot express natively (a mapped
  dtype that is neither ``param_dtype`` nor the parameter's storage dtype) and mixed storage
  dtypes among trainable parameters (2.15 still asserts a uniform original dtype);
* it hands torch a plain ``MixedPrecisionPolicy`` whose ``param_dtype_override_fn`` is the
  translated map (:class:`ParamDtypeOverride`), then lets torch do the rest.

A unit whose policy has no map takes torch's function directly, bitwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs

from fsdp_precision._dtypes import dtype_name
from fsdp_precision._errors import ParamDtypeMapError
from fsdp_precision._policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._resolve import ResolvedMap, resolve_param_dtype_map

from ._common import Replacements, bind_mp_policy, has_map, rebind_mp_policy, undo_state_init

logger = logging.getLogger(__name__)

_replaced = Replacements()


class ParamDtypeOverride:
    """The ``param_dtype_override_fn`` torch 2.15 calls: ``id(parameter) -> mapped dtype``.

    Built per ``fully_shard`` call from the resolved exact-FQN map; unmapped parameters get
    ``None`` (torch then uses ``param_dtype``).
    """

    __slots__ = ("by_param", "calls")

    def __init__(self, by_param: dict[int, torch.dtype]) -> None:
        self.by_param = by_param
        self.calls = 0  # how often torch asked (observed by the tests)

    def __call__(self, param: nn.Parameter) -> torch.dtype | None:
        self.calls += 1
        return self.by_param.get(id(param))


def _fmt(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else f"torch.{dtype_name(dtype)}"


def check_expressible(
    params: list[nn.Parameter], resolved: ResolvedMap, policy: ParamDtypeMixedPrecisionPolicy
) -> None:
    """Raise :class:`ParamDtypeMapError` for what torch 2.15's native override cannot express."""
    release = torch.__version__
    bad = [
        (resolved.fqns[pid][0], dtype, param.dtype)
        for param in params
        if (pid := id(param)) in resolved.by_param
        and (dtype := resolved.by_param[pid]) not in (policy.param_dtype, param.dtype)
    ]
    if bad:
        entries = ", ".join(f"{fqn!r}: {_fmt(d)}" for fqn, d, _ in bad)
        stored = ", ".join(f"{fqn!r} is stored in {_fmt(s)}" for fqn, _, s in bad)
        raise ParamDtypeMapError(
            f"param_dtype_map entries {{{entries}}} cannot be expressed on torch {release}: "
            "its native MixedPrecisionPolicy.param_dtype_override_fn allows only param_dtype "
            f"({_fmt(policy.param_dtype)}) or the parameter's storage dtype ({stored}). "
            "Store those parameters in the mapped dtype, give them their own fully_shard unit "
            "with that param_dtype, or use torch 2.11-2.14, where fsdp_precision patches FSDP2 "
            "for any mappable dtype"
        )
    storage: dict[torch.dtype, str] = {}
    for param in params:
        if param.requires_grad and param.dtype.is_floating_point:
            storage.setdefault(param.dtype, resolved.fqns[id(param)][0])
    if len(storage) > 1:
        examples = ", ".join(f"{fqn!r} is stored in {_fmt(d)}" for d, fqn in storage.items())
        raise ParamDtypeMapError(
            f"trainable parameters of one fully_shard unit have mixed storage dtypes ({examples}); "
            f"torch {release} requires one storage dtype per unit (FSDP expects uniform original "
            "parameter dtype). Store the unit in one dtype and map the exceptions, freeze the "
            "differently stored parameters, give them their own fully_shard unit, or use torch "
            "2.11-2.14, where fsdp_precision supports mixed storage in one unit"
        )


def native_policy(policy: ParamDtypeMixedPrecisionPolicy, resolved: ResolvedMap) -> Any:
    """A plain ``MixedPrecisionPolicy`` equal to ``policy`` with the map as the override fn."""
    return MixedPrecisionPolicy(  # type: ignore[call-arg]  # the 2.15 field
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
        param_dtype_override_fn=ParamDtypeOverride(dict(resolved.by_param)),
    )


def _init_param_group(
    state: Any,
    params: list[nn.Parameter],
    modules: tuple[nn.Module, ...],
    *args: Any,
    **kwargs: Any,
) -> None:
    """Validate and translate the map before ``FSDPParamGroup`` shards anything."""
    original = _replaced.original(_fs, "_init_param_group")
    mp_policy = bind_mp_policy(args, kwargs)
    if not has_map(mp_policy):
        return original(state, params, modules, *args, **kwargs)  # type: ignore[no-any-return]
    assert isinstance(mp_policy, ParamDtypeMixedPrecisionPolicy)  # has_map
    try:
        resolved = resolve_param_dtype_map(modules, params, mp_policy)
        check_expressible(params, resolved, mp_policy)
    except ParamDtypeMapError:
        undo_state_init(state, modules)
        raise
    args, kwargs = rebind_mp_policy(args, kwargs, native_policy(mp_policy, resolved))
    original(state, params, modules, *args, **kwargs)
    if logger.isEnabledFor(logging.DEBUG):
        mapped = {
            fqns[0]: dtype_name(resolved.by_param[pid])
            for pid, fqns in resolved.fqns.items()
            if pid in resolved.by_param
        }
        logger.debug("fully_shard(%s): native override %s", type(modules[0]).__name__, mapped)


def _replacements() -> list[tuple[Any, str, Any]]:
    return [(_fs, "_init_param_group", _init_param_group)]


def install() -> None:
    """Swap the construction wrapper in; idempotent."""
    _replaced.install(_replacements())


def uninstall() -> None:
    """Restore torch's function; idempotent."""
    _replaced.uninstall()


def is_installed() -> bool:
    """Whether ``install`` has run and ``uninstall`` has not."""
    return _replaced.is_installed(_replacements())
