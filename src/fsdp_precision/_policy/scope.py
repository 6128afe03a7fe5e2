"""A model-scoped policy: one policy object for every ``fully_shard`` call on one model.

accelerate, the HF Trainer, TRL and transformers' native FSDP2 wrap the decoder layers, the
embedding, a grouped ``[norm, lm_head]`` call and the root, and hand the same
``MixedPrecisionPolicy`` to every call. A per-call ``param_dtype_map`` cannot serve them: its keys
are relative to each call. A model-scoped policy holds exact root-relative entries (built by
``fsdp_precision.model_policy``), and each call resolves only the parameters it manages, by
*slot*: the module object that registers the parameter and its attribute name. Slots survive
what frameworks do before wrapping (``model.to("meta")`` / ``to_empty`` replace parameter objects,
not modules), a grouped call never broadcasts an entry to a sibling, and an entry outside a call
is no error there. Once the root is wrapped, an entry that no call resolved is an error naming it.
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._policy.armed import unpickled
from fsdp_precision._policy.casts import ModuleCast
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy

__all__ = ["ModelScope", "ModelScopedPolicy", "Slot", "resolve_by_slot"]

Slot = tuple[int, str]  # (id of the registering module, attribute name)


@dataclass(eq=False)
class ModelScope:
    """The compiled entries of one model, and which of them calls have resolved so far.

    Compared and hashed by identity (a policy built once is one policy).

    Attributes:
        root: ``id`` of the model the entries were compiled on.
        model: The model's class name (for messages).
        entries: ``slot -> (root-relative FQN, dtype)``, one slot per registration (aliases).
        modules: Every module of the model when the policy was built, held weakly (a module
            created later is never mistaken for one of them, even at a reused address).
        resolved: Root-relative FQNs a completed ``fully_shard`` call has resolved.
        casts: ``id(module) -> (root-relative FQN, cast)`` of every module whose boundary the
            calls cast (the first call that includes the module installs the hooks). (Default:
            none)
        reasons: Root-relative FQN -> why it is kept (the rule or declaration that claimed it,
            as ``PrecisionPlan.explain()`` names it), for the records exports write. (Default:
            none)
    """

    root: int
    model: str
    entries: Mapping[Slot, tuple[str, torch.dtype]]
    modules: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    resolved: set[str] = field(default_factory=set)
    casts: Mapping[int, tuple[str, ModuleCast]] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)

    @property
    def fqns(self) -> set[str]:
        """Every entry's root-relative FQN (one per parameter)."""
        return {fqn for fqn, _ in self.entries.values()}

    def casts_under(self, modules: Sequence[nn.Module]) -> tuple[tuple[nn.Module, ModuleCast], ...]:
        """The modules under one call's ``modules`` with a boundary cast, each with its cast."""
        found: dict[int, tuple[nn.Module, ModuleCast]] = {}
        for member in modules:
            for sub in member.modules():
                entry = self.casts.get(id(sub))
                if entry is not None and sub in self.modules:
                    found.setdefault(id(sub), (sub, entry[1]))
        return tuple(found.values())


@dataclass(frozen=True)
class ModelScopedPolicy(ParamDtypeMixedPrecisionPolicy):
    """A :class:`ParamDtypeMixedPrecisionPolicy` valid for every ``fully_shard`` call on one
    model or its submodules; built by :func:`model_policy`.

    ``param_dtype_map`` shows the entries root-relative (for reading); each call resolves them by
    slot (``scope``), not by key.

    Frameworks keep the policy in what they serialise (the HF Trainer ``torch.save``s its
    arguments into every checkpoint, ``training_args.bin``; Lightning pickles hyperparameters):
    pickled, it is written as the plain :class:`ParamDtypeMixedPrecisionPolicy` it reads as
    (dtypes, root-relative map, boundary casts), a record of the run that needs no model to load
    (loading it installs the patch, or warns where the torch cannot take it).
    The live object stays in force: a copy (``copy.copy``/``copy.deepcopy``, which frameworks
    make of their arguments) is the policy itself, whose scope tracks what every call resolved.
    """

    scope: ModelScope | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        record = {
            f.name: getattr(self, f.name)
            for f in fields(ParamDtypeMixedPrecisionPolicy)
            if f.name != "param_dtype_override_fn"  # a 2.15 callable; this policy sets none
        }
        record["param_dtype_map"] = dict(self.param_dtype_map or {})
        record["module_casts"] = dict(self.module_casts or {})
        record["uncast_inputs"] = tuple(sorted(self.uncast_inputs))  # plain containers only
        return (_plain_policy, (record,))

    def __copy__(self) -> ModelScopedPolicy:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelScopedPolicy:
        return self


def _plain_policy(record: dict[str, Any]) -> ParamDtypeMixedPrecisionPolicy:
    """What a pickled :class:`ModelScopedPolicy` loads as (module-level: pickle finds it)."""
    policy = unpickled(ParamDtypeMixedPrecisionPolicy, record)
    assert isinstance(policy, ParamDtypeMixedPrecisionPolicy)
    return policy


def resolve_by_slot(
    modules: Sequence[nn.Module], params: Sequence[nn.Parameter], scope: ModelScope
) -> tuple[dict[int, torch.dtype], dict[Slot, torch.dtype], dict[int, list[str]], set[str]]:
    """``(by_param, by_slot, local fqns, resolved root FQNs)`` of one call's managed parameters.

    Raises :class:`ParamDtypeMapError` when the call's modules are not the policy's model's,
    when a managed parameter is registered only by modules created after the policy (it has no
    entry), and when the call includes the root and an entry is resolved neither by it nor by an
    earlier call.
    """
    managed = {id(p) for p in params}
    by_param: dict[int, torch.dtype] = {}
    by_slot: dict[Slot, torch.dtype] = {}
    fqns: dict[int, list[str]] = {}
    resolved: set[str] = set()
    registered: list[tuple[int, str, int]] = []  # (id(module), attribute, id(parameter))
    seen_by_scope: set[int] = set()  # managed parameters a known module registers
    newcomers: dict[int, tuple[nn.Module, str]] = {}  # parameter -> (new module, local fqn)
    root: nn.Module | None = None
    knows_any = False
    for module in modules:
        for prefix, sub in module.named_modules(remove_duplicate=False):
            known = sub in scope.modules
            knows_any |= known
            if known and id(sub) == scope.root:
                root = sub
            for name, param in sub._parameters.items():
                if param is None or id(param) not in managed:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                fqns.setdefault(id(param), []).append(fqn)
                registered.append((id(sub), name, id(param)))
                if not known:
                    newcomers.setdefault(id(param), (sub, fqn))
                    continue
                seen_by_scope.add(id(param))
                entry = scope.entries.get((id(sub), name))
                if entry is not None:
                    by_param[id(param)] = entry[1]
                    resolved.add(entry[0])
    if not knows_any:
        raise ParamDtypeMapError(
            f"this model_policy was built for a {scope.model}, and fully_shard got a "
            f"{type(modules[0]).__name__} that is not one of its modules: build the policy with "
            "model_policy(model, rules) on the model you wrap"
        )
    # Wrappers that register no parameter of their own (activation checkpointing, torch.compile,
    # PEFT's PeftModel) are fine; a parameter only modules the policy never saw register would
    # silently take param_dtype (PEFT's fp32 adapters in bf16).
    unknown = [v for pid, v in newcomers.items() if pid not in seen_by_scope]
    if unknown:
        shown = ", ".join(f"{fqn!r} ({type(sub).__name__})" for sub, fqn in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ParamDtypeMapError(
            f"fully_shard manages parameters of modules created after this model_policy was "
            f"built for {scope.model}: {shown}{more}; the policy has no entry for them, so they "
            "would silently take param_dtype. Build the policy with model_policy(model, rules) "
            "after every module replacement (PEFT's get_peft_model, quantization, float8 "
            "conversion), on the model you wrap"
        )
    # Every registration of a mapped parameter (aliases too): FSDP records one of them.
    for sub_id, name, pid in registered:
        if pid in by_param:
            by_slot[(sub_id, name)] = by_param[pid]
    if root is not None:
        _check_all_resolved(scope, resolved, root, managed)
    return by_param, by_slot, fqns, resolved


def _check_all_resolved(
    scope: ModelScope, resolved: set[str], root: nn.Module, managed: set[int]
) -> None:
    missing = sorted(scope.fqns - scope.resolved - resolved)
    if not missing:
        return
    params = dict(root.named_parameters(remove_duplicate=False))
    reasons = []
    for fqn in missing[:4]:
        param = params.get(fqn)
        if param is None:
            close = difflib.get_close_matches(fqn, list(params), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            reasons.append(f"{fqn!r}: not a parameter of this model{hint}")
        elif id(param) in managed:
            reasons.append(f"{fqn!r}: its module was replaced after model_policy was built")
        elif isinstance(param, DTensor):
            reasons.append(f"{fqn!r}: wrapped by a fully_shard call with another mp_policy")
        else:
            reasons.append(f"{fqn!r}: in ignored_params (never sharded)")
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    raise ParamDtypeMapError(
        f"model_policy entries of {scope.model} were resolved by no fully_shard call by the time "
        f"the root was wrapped: {'; '.join(reasons)}{more}. Pass the model_policy to every "
        "fully_shard call on the model, keep kept parameters out of ignored_params, and build "
        "the policy on the model you wrap"
    )
