"""What a unit's input cast does to the activations it receives, seen by the plan's trace.

FSDP casts every floating tensor a unit's forward receives to the unit's ``param_dtype``. Where a
tensor arrives wider (an fp32 timestep embedding from a kept embedder, an fp32 rotary table),
the cast rounds what the unsharded model would have used as computed. :class:`InputWatch`
records, per unit and argument, each such input, the module that produced it and whether the
unit's ``uncast_inputs`` leave it; the trace reports them and suggests the names that look
computed wide on purpose.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from fsdp_precision._base.dtypes import dtype_name, exact_upcast
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._policy.inputs import argument_names

__all__ = ["InputWatch", "RoundedInput"]

#: Producer or argument names of tensors computed wide on purpose: timestep features, rotary and
#: positional tables.
_WIDE_ON_PURPOSE = re.compile(r"time|temb|timestep|rotar|rope|freq|pos_emb|sincos", re.I)
_MODEL_INPUT = "<model input>"


@dataclass(frozen=True)
class RoundedInput:
    """A floating input a unit's input cast rounds (or, named in ``uncast_inputs``, leaves).

    Attributes:
        unit: The unit's name.
        argument: The forward argument it came in (``args[i]`` past the named ones).
        producer: FQN of the module whose output it is (the innermost; ``"<model input>"`` for
            the model's own inputs, ``"?"`` where no module returned it).
        dtype: The dtype it arrived in.
        cast_to: The unit's ``param_dtype``.
        uncast: Left in ``dtype`` by the unit's ``uncast_inputs``.
        suggested: Computed (or given) wider on purpose, by the look of it (a kept producer, a
            timestep or rotary name, the model's own ``timestep`` input): a candidate for
            ``uncast_inputs``.
    """

    unit: str
    argument: str
    producer: str
    dtype: str
    cast_to: str
    uncast: bool
    suggested: bool


class InputWatch:
    """Hooks on a reference copy (:class:`~fsdp_precision._verify.reference.Reference`) that
    record the inputs its units' casts round; :meth:`seen` reads them."""

    def __init__(self, module: nn.Module, plan: PrecisionPlan) -> None:
        self._producers: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._seen: dict[tuple[str, str], RoundedInput] = {}
        kept = {p.fqn.rpartition(".")[0] for u in plan.units for p in u.params if p.mapped}
        self._kept_modules = kept
        names = {id(m): n for n, m in plan.model.named_modules(remove_duplicate=False)}
        for fqn, sub in module.named_modules():
            sub.register_forward_hook(self._producer(fqn))
        for unit in plan.units:
            cast_to = unit.policy.param_dtype
            if cast_to is None or not (unit.policy.cast_forward_inputs or unit.uncast_inputs):
                continue
            for member in unit.modules:
                ref = module.get_submodule(names[id(member)])
                ref.register_forward_pre_hook(
                    self._unit(unit.name, ref, cast_to, unit.uncast_inputs),
                    prepend=True,
                    with_kwargs=True,
                )
        # prepended last: before the root unit's hook, which reads what it records
        module.register_forward_pre_hook(self._model_inputs, prepend=True, with_kwargs=True)

    def seen(self) -> tuple[RoundedInput, ...]:
        return tuple(self._seen.values())

    def _remember(self, tensor: torch.Tensor, fqn: str) -> None:
        if id(tensor) not in self._producers or self._producers[id(tensor)][0]() is None:
            self._producers[id(tensor)] = (weakref.ref(tensor), fqn)

    def _model_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._remember(leaf, _MODEL_INPUT)

    def _producer(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for leaf in pytree.tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    self._remember(leaf, fqn)

        return hook

    def _producer_of(self, tensor: torch.Tensor) -> str:
        for candidate in (tensor, tensor._base):  # a view (unflatten, chunk) of an output
            if candidate is None:
                continue
            found = self._producers.get(id(candidate))
            if found is not None and found[0]() is candidate:
                return found[1]
        return "?"

    def _unit(
        self, unit: str, module: nn.Module, cast_to: torch.dtype, uncast: frozenset[str]
    ) -> Any:
        positional = argument_names(module)[0]

        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            named = [
                (positional[i] if i < len(positional) else None, a) for i, a in enumerate(args)
            ]
            for i, (name, value) in enumerate([*named, *kwargs.items()]):
                argument = name or f"args[{i}]"
                if (unit, argument) not in self._seen:
                    self._look(unit, argument, value, cast_to, uncast)

        return hook

    def _look(
        self, unit: str, argument: str, value: Any, cast_to: torch.dtype, uncast: frozenset[str]
    ) -> None:
        for leaf in pytree.tree_leaves(value):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                continue
            if leaf.dtype == cast_to or exact_upcast(leaf.dtype, cast_to):
                continue  # the cast loses nothing
            producer = self._producer_of(leaf)
            wide = (
                producer in self._kept_modules
                or any(producer.startswith(f"{k}.") for k in self._kept_modules if k)
                or bool(_WIDE_ON_PURPOSE.search(f"{producer} {argument}"))
            )
            self._seen[(unit, argument)] = RoundedInput(
                unit=unit,
                argument=argument,
                producer=producer,
                dtype=dtype_name(leaf.dtype),
                cast_to=dtype_name(cast_to),
                uncast=argument in uncast,
                suggested=wide,  # a model input counts by its name: the caller's timestep
            )
            return
