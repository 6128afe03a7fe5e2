"""What a release's ``fully_shard`` refuses for one call, checked before anything is sharded.

Pure public torch: nothing here imports FSDP2 internals, so a plan runs these checks for every
planned call before its first ``fully_shard`` (:func:`check_planned_call`), and the patch's
construction wrap runs the same ones inside each call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._policy import native
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
from fsdp_precision._policy.resolve import ResolvedMap, resolve_param_dtype_map
from fsdp_precision._releases import ReleaseTraits, release_traits

__all__ = [
    "check_call",
    "check_grad_dtype",
    "check_manageable",
    "check_planned_call",
    "needs_resolution",
    "uses_native",
]


def needs_resolution(policy: MixedPrecisionPolicy) -> bool:
    """Whether ``policy`` asks this library for anything: a ``ParamDtypeMixedPrecisionPolicy``
    with a non-empty map or boundary casts. Any other policy takes torch's exact path."""
    return isinstance(policy, ParamDtypeMixedPrecisionPolicy) and bool(
        policy.param_dtype_map or policy.module_casts
    )


def check_manageable(params: Sequence[nn.Parameter], fqns: dict[int, tuple[str, ...]]) -> None:
    """Before 2.12, FSDP2 makes every sharded parameter trainable (2.12 keeps
    ``requires_grad``), which fails for integral and boolean parameters: say so up front."""
    bad = [p for p in params if not (p.dtype.is_floating_point or p.dtype.is_complex)]
    if bad:
        names = ", ".join(f"{fqns[id(p)][0]!r} ({dtype_name(p.dtype)})" for p in bad[:4])
        raise ParamDtypeMapError(
            f"FSDP2 in torch {torch.__version__} cannot manage non-floating parameters ({names}): "
            "it creates every sharded parameter with requires_grad=True. Pass them in "
            "ignored_params, or use torch 2.12 or later, which keeps them frozen"
        )


def uses_native(
    release: ReleaseTraits,
    params: Sequence[nn.Parameter],
    resolved: ResolvedMap,
    policy: ParamDtypeMixedPrecisionPolicy,
) -> bool:
    """Whether the map goes through torch's native override (False: the patched machinery
    takes it); raises where neither can."""
    if not release.native_override:
        return False
    refusal = native.refusal(list(params), resolved, policy)
    if refusal is None:
        return True
    if not release.patches_precision:
        raise ParamDtypeMapError(refusal)
    return False


def check_grad_dtype(
    release: ReleaseTraits, modules: Sequence[nn.Module], params: Sequence[nn.Parameter]
) -> None:
    """Before 2.15, ``fully_shard`` replaces each parameter without its ``grad_dtype`` (pytorch
    #172074): one set wider than the storage dtype (fp32 gradients of a bf16 parameter) would
    be dropped silently, and the gradients come out in the storage dtype. Say so up front."""
    if release.keeps_grad_dtype:
        return
    asked = [(p, d) for p in params if (d := _explicit_grad_dtype(p)) is not None]
    if not asked:
        return
    names = {id(p): n for m in modules for n, p in m.named_parameters(remove_duplicate=False)}
    shown = ", ".join(
        f"{names.get(id(p), '?')!r} ({dtype_name(p.dtype)}, grad_dtype {dtype_name(d)})"
        for p, d in asked[:3]
    )
    raise ParamDtypeMapError(
        f"FSDP2 in torch {torch.__version__} drops Tensor.grad_dtype at fully_shard (pytorch "
        f"#172074), and these parameters set one: {shown}; their gradients would silently "
        "come out in the storage dtype. Set reduce_dtype=torch.float32 in the policy (gradients "
        "reduce in fp32) and store the parameters in the gradient dtype (a rule keeps them "
        "there), or use torch 2.15, which keeps grad_dtype; then clear grad_dtype "
        "(p.grad_dtype = None)"
    )


def _explicit_grad_dtype(param: torch.Tensor) -> torch.dtype | None:
    dtype = getattr(param, "grad_dtype", None)
    return dtype if dtype is not None and dtype != param.dtype else None


def check_call(
    release: ReleaseTraits,
    modules: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    policy: MixedPrecisionPolicy,
) -> None:
    """Every refusal ``fully_shard(modules, mp_policy=policy)`` would make on this release, for
    the ``params`` it would manage, as :class:`ParamDtypeMapError`; nothing is modified."""
    check_grad_dtype(release, modules, params)
    resolved: ResolvedMap | None = None
    if needs_resolution(policy):
        assert isinstance(policy, ParamDtypeMixedPrecisionPolicy)
        resolved = resolve_param_dtype_map(modules, params, policy)
        if resolved.by_param and uses_native(release, params, resolved, policy):
            return
    if not release.keeps_requires_grad:
        fqns: dict[int, tuple[str, ...]] = {}
        for module in modules:
            for name, param in module.named_parameters(remove_duplicate=False):
                fqns.setdefault(id(param), (name,))
        check_manageable(params, resolved.fqns if resolved else fqns)


def check_planned_call(
    modules: Sequence[nn.Module], params: Sequence[nn.Parameter], policy: MixedPrecisionPolicy
) -> None:
    """:func:`check_call` on the installed release: what ``fully_shard(modules,
    mp_policy=policy)`` would refuse for the ``params`` it would manage, touching nothing."""
    check_call(release_traits(), modules, params, policy)
