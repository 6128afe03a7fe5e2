"""Dtype errors at the first forward, named: which kept parameter, which module, which fix.

A kept parameter meets activations of another dtype. Where its module does not cast for itself
and no boundary cast is set, torch raises deep inside the model ("expected m1 and m2 to have the
same dtype") and names nothing of ours. The hooks here add a note to that exception (``add_note``;
the message on Python 3.10) as it passes through:

- the module that holds kept parameters and raised inside its own forward: its parameters, their
  dtype, why it has no boundary cast, and the rule to change;
- the ``fully_shard`` call's module, when the error came after kept modules returned activations
  in their kept dtype (an fp32 norm's output meeting the next bf16 ``Linear``): which ones, and
  ``boundary="inputs_outputs"``.

Hooks are ``always_call`` forward hooks: they run while the exception propagates and change
nothing on the way (a forward that succeeds only records dtypes). Pure public torch.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._policy.casts import ModuleCast, incoming_dtype, installed_cast

__all__ = [
    "NOTE_PREFIX",
    "KeptModule",
    "class_name",
    "install_diagnosis",
    "is_dtype_mismatch",
    "kept_modules",
    "notes_of",
]

#: Every note starts with it (the CLI finds them in a rank's traceback by it).
NOTE_PREFIX = "fsdp-precision: "
_NOTED = "_fsdp_precision_noted"
_ATTR = "_fsdp_precision_diagnosis"
_MISMATCH = re.compile(
    r"same dtype|expected scalar type|dtype mismatch|expected both vectors to have same dtype|"
    r"Input type \(.*\) and (weight|bias) type|expected .* to have .* dtype|"
    r"should be the same|found dtype \w+ but expected \w+|"
    r"mixed dtype \(CPU\): expect parameter to have scalar type",
    re.IGNORECASE,
)


def is_dtype_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing operands of different dtypes."""
    return isinstance(exc, (RuntimeError, TypeError)) and bool(_MISMATCH.search(str(exc)))


def notes_of(exc: BaseException) -> list[str]:
    """The notes this module added to ``exc``."""
    notes = getattr(exc, "__notes__", None) or str(exc).splitlines()
    return [n for n in notes if n.startswith(NOTE_PREFIX)]


def _add_note(exc: BaseException, note: str) -> None:
    setattr(exc, _NOTED, True)
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):  # 3.10: into the message
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])


def class_name(module: nn.Module) -> str:
    """The module's own class name: the class ``fully_shard`` swapped in (``FSDPLinear``, a
    subclass of ``FSDPModule`` and the module's class) named as the model defines it."""
    cls: type = type(module)
    if issubclass(cls, FSDPModule):
        own = [base for base in cls.__bases__ if not issubclass(base, FSDPModule)]
        cls = own[0] if own else cls
    return cls.__name__


def _dtypes(tree: Any) -> list[torch.dtype]:
    leaves, _ = tree_flatten(tree)
    return [x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]


@dataclass(frozen=True)
class KeptModule:
    """A module holding kept parameters, as one ``fully_shard`` call sees it.

    Attributes:
        name: Its FQN relative to the call's module (``""``: that module).
        params: Its kept parameters' FQNs (same base), with the dtype each computes in.
        whole: Every parameter under it computes in that one dtype (a boundary cast can apply).
    """

    name: str
    params: tuple[tuple[str, torch.dtype], ...]
    whole: bool


@dataclass
class _Call:
    """The diagnosis of one ``fully_shard`` call: what its kept modules returned this forward."""

    owner: str  # class of the call's module
    wide: list[tuple[str, str, torch.dtype, torch.dtype]] = field(default_factory=list)
    #: the call module's own entry, where it holds kept parameters itself
    own: KeptModule | None = None

    def pre(self, module: nn.Module, args: Any) -> None:
        self.wide.clear()

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        exc = sys.exc_info()[1]
        if exc is None or getattr(exc, _NOTED, False) or not is_dtype_mismatch(exc):
            return
        if self.wide:
            _add_note(exc, _after_note(self))
        elif self.own is not None and not self.own.whole:
            _add_note(exc, _mixed_note(self))


def kept_modules(
    modules: Sequence[nn.Module],
    by_slot: Mapping[tuple[int, str], torch.dtype],
    casts: Sequence[tuple[nn.Module, ModuleCast]],
) -> list[KeptModule]:
    """The modules of one call that hold kept parameters (``by_slot``: ``(id(module),
    attribute) -> dtype``) or have a boundary cast, named under the first member that has
    them."""
    cast_ids = {id(m) for m, _ in casts}
    found: dict[int, KeptModule] = {}
    for member in modules:
        for name, sub in member.named_modules():
            if id(sub) in found:
                continue
            own = [(a, by_slot[(id(sub), a)]) for a in sub._parameters if (id(sub), a) in by_slot]
            if not own and id(sub) not in cast_ids:
                continue
            under = [
                (f"{name}.{n}" if name else n, by_slot.get(_slot(sub, n)))
                for n, p in sub.named_parameters()
                if p.dim() > 0
            ]
            dtypes = {d for _, d in under}
            params = [(f"{name}.{a}" if name else a, d) for a, d in own] or [
                (n, d) for n, d in under if d is not None
            ]
            found[id(sub)] = KeptModule(
                name, tuple(params), whole=len(dtypes) == 1 and None not in dtypes
            )
    return list(found.values())


def _slot(module: nn.Module, fqn: str) -> tuple[int, str]:
    prefix, _, attr = fqn.rpartition(".")
    return id(module.get_submodule(prefix) if prefix else module), attr


def install_diagnosis(call_modules: Sequence[nn.Module], kept: Sequence[KeptModule]) -> None:
    """Register the naming hooks of one call: on each module of ``kept`` (by FQN under the
    first call module that has it) and on the call's modules. Idempotent per module. Hooks
    are appended, never prepended: torch 2.11's dynamo guards a module's hooks by registration
    order and fails on a prepended one when it compiles the block around them."""
    for member in call_modules:
        if getattr(member, _ATTR, None) is not None:
            continue
        call = _Call(class_name(member))
        setattr(member, _ATTR, call)
        member.register_forward_pre_hook(call.pre)
        member.register_forward_hook(call.post, always_call=True)
        named = dict(member.named_modules())
        for entry in kept:
            module = named.get(entry.name)
            if module is member and entry.params:
                call.own = entry
            if module is None or getattr(module, _ATTR, None) is not None or module is member:
                continue
            setattr(module, _ATTR, entry)
            watch = _KeptWatch(entry, call, after_cast=installed_cast(module) is not None)
            module.register_forward_pre_hook(watch.pre, with_kwargs=True)
            module.register_forward_hook(watch.post, always_call=True)


class _KeptWatch:
    """The hooks on one kept module: the dtype each forward came in (before any boundary cast:
    read from the cast when it was installed first, its hooks then running first), and the
    note an error passing through gets."""

    def __init__(self, entry: KeptModule, call: _Call, *, after_cast: bool) -> None:
        self.entry = entry
        self.call = call
        self.after_cast = after_cast
        # (incoming dtype, len(call.wide)) per running forward of the module
        self.frames: list[tuple[torch.dtype | None, int]] = []

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        dtypes = _dtypes((args, kwargs))
        came = incoming_dtype(module) if self.after_cast else (dtypes[0] if dtypes else None)
        self.frames.append((came, len(self.call.wide)))

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        came, wide_before = self.frames.pop() if self.frames else (None, 0)
        exc = sys.exc_info()[1]
        if exc is None:  # returned: record activations that leave in another dtype
            out = _dtypes(output)
            if came is not None and out and out[0] != came:
                self.call.wide.append((self.entry.name, class_name(module), came, out[0]))
            elif came is not None and out:  # cast back: what its kept insides returned stays in
                del self.call.wide[wide_before:]
            return
        if getattr(exc, _NOTED, False) or not is_dtype_mismatch(exc):
            return
        if len(self.call.wide) > wide_before:  # kept modules inside returned wide activations
            _add_note(exc, _after_note(self.call))
        else:
            _add_note(exc, _inside_note(self.entry, module, came))


def _shown(params: Sequence[tuple[str, torch.dtype]]) -> str:
    names = ", ".join(repr(n) for n, _ in params[:3]) + (" ..." if len(params) > 3 else "")
    return f"{names} ({', '.join(sorted({dtype_name(d) for _, d in params}))})"


def _inside_note(entry: KeptModule, module: nn.Module, came: torch.dtype | None) -> str:
    where = f"module {entry.name or '<the fully_shard module>'!r} ({class_name(module)})"
    got = f" got {dtype_name(came)} inputs and" if came is not None else ""
    cast: ModuleCast | None = installed_cast(module)
    kept = f"holds kept {_shown(entry.params)}"
    if cast is not None:
        return (
            f"{NOTE_PREFIX}{where} {kept}; its inputs were cast to {dtype_name(cast.inputs)}, "
            "yet its forward mixes dtypes (a buffer or a tensor it builds in another dtype). "
            "Keep what it mixes too, or leave the module in the unit's dtype"
        )
    why = (
        "the rules that keep it ask for boundary='none'"
        if entry.whole
        else "it also holds parameters in another dtype, so it is not kept whole"
    )
    fix = (
        "set boundary='auto' (the default) or 'inputs' on the rule that keeps it"
        if entry.whole
        else "keep all its parameters in one dtype, or keep none"
    )
    if entry.whole:
        fix += (
            f"; or pass module_casts={{{entry.name!r}: "
            f"ModuleCast(torch.{dtype_name(entry.params[0][1])})}}"
        )
    return (
        f"{NOTE_PREFIX}{where} {kept},{got} raised this dtype mismatch: its forward does not "
        f"cast its inputs to its weights' dtype, and it has no boundary cast ({why}). Fix: {fix}"
    )


def _mixed_note(call: _Call) -> str:
    assert call.own is not None
    return (
        f"{NOTE_PREFIX}the {call.owner} holds kept {_shown(call.own.params)} itself, beside "
        "parameters in another dtype, and this dtype mismatch came from its own forward: its "
        "code mixes the kept parameters into its activations (which then meet a layer in the "
        "unit's dtype), and no module boundary lies between them to cast at. Fix: keep none "
        "of them (drop the rule that keeps them), or keep the layers they feed too"
    )


def _after_note(call: _Call) -> str:
    shown = "; ".join(
        f"{name or '<the fully_shard module>'!r} ({cls}) returned {dtype_name(out)} for "
        f"{dtype_name(came)} inputs"
        for name, cls, came, out in call.wide[:3]
    )
    more = f" and {len(call.wide) - 3} more" if len(call.wide) > 3 else ""
    return (
        f"{NOTE_PREFIX}this dtype mismatch in the {call.owner} came after kept modules returned "
        f"activations in their kept dtype: {shown}{more}. Fix: cast their outputs back to the "
        "activations' dtype on the rule that keeps them: boundary='auto' (the default) does for "
        "modules of norm weights and scales, boundary='inputs_outputs' for any module"
    )
