"""Unit inputs the input cast leaves alone (``uncast_inputs``).

FSDP's ``cast_forward_inputs`` casts every floating tensor a unit's forward receives to the
unit's ``param_dtype``. Some of them were computed wider on purpose and the unit upcasts them
itself: Wan's block receives the timestep projection ``temb`` from a time embedder kept in fp32
and computes ``scale_shift_table + temb.float()``; rotary tables arrive fp32 from a module that
builds them in fp32. Cast at the unit's boundary they reach the block rounded to bf16, which the
unsharded model never does (a timestep of 998.39 becomes 1000 in bf16).

A policy's ``uncast_inputs`` names such forward arguments. The unit's own input cast then runs
here instead of in FSDP: the same cast (every floating tensor to ``param_dtype``) for every
argument but the named ones, which keep the dtype they arrive in. Positional arguments are
matched to names through the forward's signature; a container argument is left whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp_precision._policy.casts import cast_to

__all__ = ["argument_names", "cast_inputs", "check_uncast_inputs", "install_input_cast"]

_ATTR = "_fsdp_precision_input_cast"


def check_uncast_inputs(raw: object) -> frozenset[str]:
    """``raw`` (an iterable of argument names, or ``None``) as a frozenset; ``ValueError``
    naming the bad entry otherwise."""
    if raw is None:
        return frozenset()
    if isinstance(raw, str) or not isinstance(raw, Iterable):
        raise ValueError(
            f"uncast_inputs must be a collection of forward argument names, got {raw!r}; "
            "pass e.g. ('temb', 'rotary_emb')"
        )
    names = tuple(raw)
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"uncast_inputs entries are forward argument names (identifiers), got "
                f"{name!r} in {names!r}"
            )
    return frozenset(names)


def argument_names(module: nn.Module) -> tuple[tuple[str | None, ...], frozenset[str], bool]:
    """The names of ``module.forward``'s positional slots (``None`` past them: ``*args``), its
    keyword names, and whether it takes ``**kwargs``."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return (), frozenset(), True
    positional: list[str | None] = []
    keywords: set[str] = set()
    var_keyword = False
    for p in signature.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            keywords.add(p.name)
        var_keyword |= p.kind == p.VAR_KEYWORD
    return tuple(positional), frozenset(keywords), var_keyword


def accepted(module: nn.Module, names: Iterable[str]) -> frozenset[str]:
    """The ``names`` ``module.forward`` can receive (every one, where it takes ``**kwargs``)."""
    positional, keywords, var_keyword = argument_names(module)
    wanted = frozenset(names)
    if var_keyword:
        return wanted
    return wanted & (keywords | {n for n in positional if n is not None})


def cast_inputs(
    positional: tuple[str | None, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    keep: frozenset[str],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """FSDP's input cast to ``dtype``, except the arguments named in ``keep``."""
    cast = cast_to(dtype)
    new_args = tuple(
        a if i < len(positional) and positional[i] in keep else tree_map(cast, a)
        for i, a in enumerate(args)
    )
    new_kwargs = {k: v if k in keep else tree_map(cast, v) for k, v in kwargs.items()}
    return new_args, new_kwargs


class _InputCast:
    def __init__(self, module: nn.Module, dtype: torch.dtype, keep: frozenset[str]) -> None:
        self.positional = argument_names(module)[0]
        self.dtype = dtype
        self.keep = keep

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        return cast_inputs(self.positional, args, kwargs, self.dtype, self.keep)


def install_input_cast(module: nn.Module, dtype: torch.dtype, keep: frozenset[str]) -> None:
    """Cast ``module``'s floating inputs to ``dtype`` in a forward pre-hook, except the
    arguments named in ``keep``; once per module (a second call changes nothing)."""
    if isinstance(getattr(module, _ATTR, None), _InputCast):
        return
    hook = _InputCast(module, dtype, keep)
    module.register_forward_pre_hook(hook, with_kwargs=True)
    setattr(module, _ATTR, hook)


def installed_input_cast(module: nn.Module) -> tuple[torch.dtype, frozenset[str]] | None:
    """The dtype and the uncast names of the input cast installed on ``module``, or None."""
    hook = getattr(module, _ATTR, None)
    return (hook.dtype, hook.keep) if isinstance(hook, _InputCast) else None
