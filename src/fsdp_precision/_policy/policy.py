"""``ParamDtypeMixedPrecisionPolicy``: torch's ``MixedPrecisionPolicy`` plus per-FQN dtypes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._base.dtypes import check_mappable_dtype, dtype_repr
from fsdp_precision._policy.armed import arm, unpickled
from fsdp_precision._policy.casts import ModuleCast
from fsdp_precision._policy.inputs import check_uncast_inputs

__all__ = ["ParamDtypeMixedPrecisionPolicy"]

_WILDCARDS = frozenset("*?[]")


V = TypeVar("V")


class _FrozenMap(Mapping[str, V]):
    """An immutable, hashable ``{name: value}`` map (the policy is a frozen dataclass)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, V]) -> None:
        self._items: dict[str, V] = dict(items)

    def __getitem__(self, key: str) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        def show(v: object) -> str:
            return dtype_repr(v) if isinstance(v, torch.dtype) else repr(v)

        return "{" + ", ".join(f"{k!r}: {show(v)}" for k, v in self._items.items()) + "}"


@dataclass(frozen=True)
class ParamDtypeMixedPrecisionPolicy(MixedPrecisionPolicy):
    """FSDP2's ``MixedPrecisionPolicy`` with exact per-parameter compute dtypes.

    Pass it to ``fully_shard``. Parameters named in ``param_dtype_map`` are all-gathered and
    computed in their mapped dtype, inside the same FSDP unit as the rest: one all-gather and one
    reduce-scatter per unit, whatever the mix.

    A policy with a map, boundary casts or uncast inputs installs the patch when it is built (or
    unpickled), as :func:`apply_param_dtype_map_patch` does: torch would otherwise take it as a
    plain ``MixedPrecisionPolicy`` and apply none of them. On a torch the patch cannot run on,
    building one raises :class:`UnsupportedTorchError` or :class:`PatchIntegrityError`. A policy
    that asks for none of them installs nothing: it is torch's path.

    Attributes:
        param_dtype (Optional[torch.dtype]): Compute and all-gather dtype of every parameter the
            map does not name; ``None`` keeps each parameter's storage dtype. (Default: ``None``)
        reduce_dtype (Optional[torch.dtype]): Gradient reduce-scatter dtype of the unit. Required
            when trainable parameters of one unit compute in different dtypes. (Default: ``None``)
        output_dtype (Optional[torch.dtype]): Dtype floating forward outputs are cast to.
            (Default: ``None``)
        cast_forward_inputs (bool): Cast floating forward inputs to ``param_dtype``. A mapped
            parameter casts no activations unless ``module_casts`` says so: the activation
            boundary stays where FSDP puts it. (Default: ``True``)
        param_dtype_map (Mapping[str, torch.dtype]): Exact parameter FQNs, relative to the module
            (or to each module of a grouped call) passed to ``fully_shard``, as
            ``named_parameters(remove_duplicate=False)`` spells them, restricted to the parameters
            that call manages. Values are floating dtypes (float8 variants, float16, bfloat16,
            float32, float64). No wildcards: compile patterns with the rules layer. An empty map
            takes exactly the upstream path. On torch 2.15 a map that torch's native
            ``param_dtype_override_fn`` can express runs through it; the rest through the
            patch, as on 2.11-2.14 (docs/compatibility.md). ``None`` means ``{}``. Every entry
            is honoured as given, one naming the dtype its parameter computes in anyway
            included (it pins that dtype; compiled plans leave such entries out). A call that
            manages no parameter maps nothing, whatever its map. (Default: ``{}``)
        module_casts (Mapping[str, ModuleCast]): Boundary casts: exact module FQNs, relative to
            the module(s) passed to ``fully_shard`` like the map's keys (a grouped call reaches
            every member that has the name), each with the :class:`ModuleCast` its forward gets:
            floating inputs cast to a dtype, outputs optionally cast back. The hooks are
            registered when the call succeeds. Rules compile them for kept modules
            (``Glob(..., boundary=...)``). ``None`` means ``{}``. (Default: ``{}``)
        uncast_inputs (frozenset[str]): Forward argument names of the module(s) passed to
            ``fully_shard`` whose floating tensors the input cast leaves in the dtype they
            arrive in: a timestep embedding or rotary table computed in fp32 that the unit
            upcasts itself (Wan's ``temb``). With ``cast_forward_inputs`` and a
            ``param_dtype``, the unit's input cast then runs in a forward hook the call
            installs, every other argument cast as FSDP casts it; positional arguments match
            through the forward's signature, names the forward does not take match nothing.
            Any iterable of names; ``None`` means none. (Default: ``frozenset()``)

    On torch 2.15 the parent also has ``param_dtype_override_fn`` (keyword-only); it may not be
    combined with a non-empty ``param_dtype_map``.
    """

    param_dtype_map: Mapping[str, torch.dtype] | None = field(default_factory=dict)
    module_casts: Mapping[str, ModuleCast] | None = field(default_factory=dict)
    uncast_inputs: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:  # torch 2.15 validates its own fields
            parent_post_init()
        raw = self.param_dtype_map
        if raw is None:  # Miles' default: no map
            raw = {}
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"param_dtype_map must be a mapping of parameter FQN to torch.dtype, got "
                f"{type(raw).__name__}; pass e.g. {{'norm.weight': torch.float32}}"
            )
        checked: dict[str, torch.dtype] = {}
        for key, dtype in raw.items():
            if not isinstance(key, str) or not key:
                raise ValueError(
                    f"param_dtype_map keys must be non-empty parameter FQNs, got {key!r}; "
                    "use names from module.named_parameters()"
                )
            if _WILDCARDS.intersection(key):
                raise ValueError(
                    f"param_dtype_map key {key!r} contains a wildcard; keys are exact FQNs. "
                    "Compile patterns to exact names with fsdp_precision's rules instead"
                )
            checked[key] = check_mappable_dtype(dtype, where=f"param_dtype_map[{key!r}]")
        # torch 2.15 added param_dtype_override_fn; the map is translated into one, so both
        # together would be ambiguous.
        if checked and getattr(self, "param_dtype_override_fn", None) is not None:
            raise ValueError(
                "ParamDtypeMixedPrecisionPolicy takes param_dtype_map or param_dtype_override_fn, "
                f"not both (map keys: {sorted(checked)[:3]}); on torch 2.15 the map is translated "
                "into an override fn: drop param_dtype_override_fn, or use torch's "
                "MixedPrecisionPolicy with the override fn alone"
            )
        object.__setattr__(self, "param_dtype_map", _FrozenMap(checked))
        object.__setattr__(self, "module_casts", _FrozenMap(_checked_casts(self.module_casts)))
        object.__setattr__(self, "uncast_inputs", check_uncast_inputs(self.uncast_inputs))
        arm(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt through the constructor, so that a policy sent to a spawned process installs
        # the patch there (the default pickle would skip __post_init__).
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        record["param_dtype_map"] = dict(self.param_dtype_map or {})
        record["module_casts"] = dict(self.module_casts or {})
        record["uncast_inputs"] = tuple(sorted(self.uncast_inputs))
        return (unpickled, (type(self), record))


def _checked_casts(raw: object) -> dict[str, ModuleCast]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"module_casts must be a mapping of module FQN to ModuleCast, got "
            f"{type(raw).__name__}; pass e.g. {{'mlp.gate': ModuleCast(torch.float32)}}"
        )
    for key, cast in raw.items():
        if not isinstance(key, str) or _WILDCARDS.intersection(key):
            raise ValueError(
                f"module_casts keys must be exact module FQNs ('' is the module passed to "
                f"fully_shard), got {key!r}; use names from module.named_modules()"
            )
        if not isinstance(cast, ModuleCast):
            raise ValueError(
                f"module_casts[{key!r}] must be a ModuleCast, got {cast!r}; write "
                "ModuleCast(torch.float32) (inputs) or ModuleCast(torch.float32, outputs=True)"
            )
    return dict(raw)
