"""Which modules become FSDP units: by size or by transformer block, only where torch can run them.

A module is made a unit only when torch can run it as one:

* it is not a container (``ModuleList`` and friends are never called, so FSDP's hooks would
  never gather what they hold);
* none of its parameters is tied to a module outside it (torch shards each parameter once);
* every use of its parameters happens while its forward runs
  (:mod:`fsdp_precision._advise.usage`): a
  multimodal model that calls ``get_input_embeddings()`` from the outer model, or reads
  ``self.dtype`` there, keeps the embedding or that parameter out of an inner unit;
* it is not inside a block declared in ``_no_split_modules``.

What a refused module holds stays with its parent, up to the root, which owns whatever is left.
0-dim parameters (CLIP's ``logit_scale``) are in no unit: torch cannot shard them, so the plan
replicates them (see :mod:`fsdp_precision._plan.replicated`).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn

from fsdp_precision._advise.usage import ParamUsage, param_usage

__all__ = [
    "CONTAINERS",
    "SkippedUnit",
    "UnitChoice",
    "WrapPolicy",
    "accelerate_units",
    "auto_wrap_units",
    "block_class_names",
    "resolve_block_classes",
    "choose_units",
    "default_units",
]

WrapPolicy = Literal["size", "transformer_block"]

#: Modules nobody calls: FSDP's hooks on them would never gather what they hold.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class SkippedUnit:
    """A module the wrap policy selected but torch could not run as a unit.

    Attributes:
        module: Its FQN.
        reason: Why, naming the parameter and the use (shown by ``explain()``).
    """

    module: str
    reason: str


@dataclass(frozen=True)
class UnitChoice:
    """The chosen units and what was refused.

    Attributes:
        units: Modules in ``fully_shard`` order (innermost first, the root last).
        skipped: Selected modules that could not be units, with the reason.
        traced: How the parameter uses were gathered (``ParamUsage.traced``).
    """

    units: tuple[nn.Module, ...]
    skipped: tuple[SkippedUnit, ...]
    traced: str


def block_class_names(model: nn.Module) -> set[str]:
    """Every class name declared in any ``_no_split_modules`` of ``model``'s modules."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def resolve_block_classes(model: nn.Module, given: Collection[str] = ()) -> set[str]:
    """The block class names of ``model`` that name a module of it: ``given``, or the classes
    its ``_no_split_modules`` declare.

    Given names must all resolve (``ValueError`` with a did-you-mean, as accelerate's
    ``TRANSFORMER_BASED_WRAP`` refuses them). Of the declared names, the unresolvable ones are
    named in a warning (composite models often declare the blocks of optional towers); none
    resolving is a ``ValueError`` naming them and the fix, and so is a model that declares none.
    """
    present = {type(m).__name__ for m in model.modules()}
    kind = type(model).__name__
    if given:
        for name in given:
            if name not in present:
                close = difflib.get_close_matches(name, sorted(present), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"fsdp_transformer_block_classes names {name!r}, which no module of {kind} "
                    f"is{hint}; use class names of its blocks"
                )
        return set(given)
    declared = block_class_names(model)
    if not declared:
        raise ValueError(
            f"fsdp_auto_wrap_policy='transformer_block': {kind} declares no _no_split_modules; "
            "name the block classes in fsdp_transformer_block_classes, e.g. "
            "('LlamaDecoderLayer',), or use fsdp_auto_wrap_policy='size'"
        )
    resolved = declared & present
    unresolved = sorted(declared - present)
    if not resolved:
        raise ValueError(
            f"{kind} declares the blocks {unresolved} in _no_split_modules, but none of them is "
            "the class of one of its modules, so no block would be a unit (the root alone would "
            "gather the whole model); name the block classes in fsdp_transformer_block_classes "
            "(as type(module).__name__ spells them) or use fsdp_auto_wrap_policy='size'"
        )
    if unresolved:
        warnings.warn(
            f"{kind} declares blocks in _no_split_modules that are the class of none of its "
            f"modules: {unresolved}; the units are the blocks that are: {sorted(resolved)}",
            UserWarning,
            stacklevel=3,
        )
    return resolved


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every module whose class a ``_no_split_modules`` of the model declares, innermost first
    (a UNet declares its up blocks and the resnet blocks inside them), then the root; the root
    alone for a model that declares none. Declared names that resolve to no class are named in
    a warning; none resolving is a ``ValueError`` (see ``resolve_block_classes``)."""
    if not block_class_names(model):
        return [model]
    names = resolve_block_classes(model)
    blocks = [m for m in _innermost_first(model) if m is not model and type(m).__name__ in names]
    return [*blocks, model]


def _innermost_first(model: nn.Module) -> list[nn.Module]:
    """``model.modules()`` with every module after the modules inside it (siblings in order)."""
    seen: set[int] = set()
    out: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            walk(child)
        out.append(module)

    walk(model)
    return out


def choose_units(
    model: nn.Module,
    *,
    min_params: int,
    policy: WrapPolicy = "size",
    block_classes: Collection[str] = (),
    usage: ParamUsage | None = None,
) -> UnitChoice:
    """The units of ``model`` under ``policy``, bottom-up, only where torch can run them.

    ``"size"``: a module becomes a unit when the parameters under it that no child unit took
    reach ``min_params``. ``"transformer_block"``: every module whose class is in
    ``block_classes`` (default: the model's ``_no_split_modules``) becomes a unit, as
    accelerate's ``TRANSFORMER_BASED_WRAP`` does. Either way a selected module is refused (see
    the module docstring) when torch could not run it, and the refusal is recorded.
    """
    if min_params < 0:
        raise ValueError(f"min_params must be >= 0, got {min_params}")
    if policy not in ("size", "transformer_block"):
        raise ValueError(f"policy is {policy!r}; use 'size' or 'transformer_block'")
    no_split = block_class_names(model)
    blocks: set[str] = set()
    if policy == "transformer_block":
        blocks = resolve_block_classes(model, block_classes)
    usage = usage if usage is not None else param_usage(model)
    module_names = {id(m): (n or "<root>") for n, m in model.named_modules()}
    param_names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, set[int]] = {}
    numel: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.dim() > 0:  # 0-dim: replicated, in no unit
                owners.setdefault(id(param), set()).add(id(module))
                numel[id(param)] = param.numel()

    units: list[nn.Module] = []
    skipped: list[SkippedUnit] = []
    assigned: set[int] = set()

    def subtree(module: nn.Module) -> tuple[set[int], set[int]]:
        modules = {id(m) for m in module.modules()}
        return modules, {pid for pid, own in owners.items() if own & modules}

    def selected(module: nn.Module, remaining: set[int]) -> bool:
        if policy == "transformer_block":
            return type(module).__name__ in blocks
        return sum(numel[pid] for pid in remaining) >= min_params

    def refusal(module: nn.Module, remaining: set[int]) -> str | None:
        modules, _ = subtree(module)
        for pid in sorted(remaining, key=lambda p: param_names[p]):
            if not owners[pid] <= modules:
                return (
                    f"its parameter {param_names[pid]!r} is tied to a module outside it "
                    "(torch shards each parameter in one unit)"
                )
        use = usage.outside(module_names[id(module)], [param_names[p] for p in remaining])
        if use is not None:
            return (
                f"its parameter {use.param!r} is used outside its forward, where it would "
                f"still be sharded: {use.how} in the forward of {use.where} ({use.source})"
            )
        return None

    def visit(module: nn.Module, is_root: bool) -> set[int]:
        name = type(module).__name__
        whole = name in no_split or (policy == "transformer_block" and name in blocks)
        if whole and not is_root:
            remaining = subtree(module)[1]  # never split inside a block
        else:
            remaining = {id(p) for p in module._parameters.values() if id(p) in owners}
            for child in module.children():
                remaining |= visit(child, False)
        remaining -= assigned
        if is_root or isinstance(module, CONTAINERS) or not remaining:
            return remaining
        if not selected(module, remaining):
            return remaining
        reason = refusal(module, remaining)
        if reason is not None:
            skipped.append(SkippedUnit(module_names[id(module)], reason))
            return remaining
        units.append(module)
        assigned.update(remaining)
        return set()

    visit(model, True)
    units.append(model)
    return UnitChoice(tuple(units), tuple(skipped), usage.traced)


def auto_wrap_units(
    model: nn.Module,
    min_params: int,
    *,
    policy: WrapPolicy = "size",
    block_classes: Collection[str] = (),
    example_inputs: object = None,
) -> list[nn.Module]:
    """Units in ``fully_shard`` order (innermost first, the root last), only where torch can
    run them.

    ``"size"`` (default): a module becomes a unit when the parameters under it that no child
    unit took reach ``min_params``. ``"transformer_block"``: the classes in ``block_classes``
    (default: the model's ``_no_split_modules``). A selected module is not made a unit when it
    is a container, when one of its parameters is tied to a module outside it, or when one of
    its parameters is used while its forward is not running (seen in a traced forward on
    ``example_inputs`` or the model's ``dummy_inputs``, or a static fact:
    ``get_input_embeddings()``, ``self.dtype``); nothing is split inside a ``_no_split_modules``
    block. 0-dim parameters are in no unit. :func:`plan_model_for_training`'s ``explain()``
    says why each refused module was refused.
    """
    usage = param_usage(model, example_inputs)
    choice = choose_units(
        model, min_params=min_params, policy=policy, block_classes=block_classes, usage=usage
    )
    return list(choice.units)


def accelerate_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The ``fully_shard`` calls accelerate's FSDP2 ``TRANSFORMER_BASED_WRAP`` makes (accelerate
    1.15 ``fsdp2_prepare_model``), in order: each ``_no_split_modules`` block, the input
    embedding when it is not tied to the head, one grouped call of the final norm (the last
    direct child of the base model whose class name has ``Norm``) with the output embedding
    (and the tied input embedding), then the root. accelerate makes the grouped call with
    ``reshard_after_forward=False``; a plan counts it with the plan's knob."""
    blocks = default_units(model)[:-1]
    taken = {id(m) for m in blocks}
    calls: list[nn.Module | list[nn.Module]] = list(blocks)
    embed = _call_or_none(model, "get_input_embeddings")
    head = _call_or_none(model, "get_output_embeddings")
    tied = embed is not None and head is not None
    tied = tied and _weight(embed) is not None and _weight(embed) is _weight(head)
    if embed is not None and not tied and id(embed) not in taken:
        calls.append(embed)
        taken.add(id(embed))
    tail = [m for m in (_final_norm(model), *((embed,) if tied else ()), head) if m is not None]
    tail = [m for m in tail if id(m) not in taken and m is not model]
    if tail:
        calls.append(tail if len(tail) > 1 else tail[0])
    return [*calls, model]


def _call_or_none(model: nn.Module, method: str) -> nn.Module | None:
    try:
        found = getattr(model, method, lambda: None)()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def _weight(module: nn.Module | None) -> object:
    return getattr(module, "weight", None)


def _final_norm(model: nn.Module) -> nn.Module | None:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, nn.Module):
        return None
    found = None
    for _, child in base.named_children():
        if "Norm" in type(child).__name__:
            found = child
    return found
