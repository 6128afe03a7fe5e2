"""A model computing as a precision policy would, on one device, its weights never duplicated.

:class:`Computing` makes an unsharded model compute as FSDP with a uniform compute dtype
(``bf16``) would, except the parameters it keeps, which compute in their storage dtype behind
the boundary their rule asks for, as the library's kept modules do: during each module's forward
its own parameters are cast to the compute dtype (and put back after it), and its floating
inputs cast to the dtype its parameters compute in, as a unit root's input cast does. A module
holding a kept parameter is kept whole (a rule on a LayerNorm's weight alone would leave it
computing with a bf16 bias, which it cannot). Memory:
the model plus one module's low-precision parameters at a time, as FSDP holds one unit's.

It is an emulation, not the sharded run: every module holding parameters casts its inputs (in a
real unit only the unit's root does), and nothing is reduced. What it decides for the advisor
(which expert a token picks, how far logits move) depends on the rounding of values, which it
reproduces exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp_precision._hf.boundaries import returns_activations
from fsdp_precision._policy.casts import Boundary, ModuleCast, cast_for, cast_to

__all__ = ["Computing", "cast_params", "rounded_to"]


class _Swaps:
    """Parameters whose values are cast for a while, counted, so a parameter tied to two
    modules (or a re-entrant forward) is put back only when its last user is done."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[nn.Parameter, torch.Tensor, int]] = {}

    def cast(
        self, params: list[nn.Parameter], dtype: torch.dtype, *, values_only: bool = False
    ) -> None:
        for param in params:
            known = self.kept.get(id(param))
            if known is not None:
                self.kept[id(param)] = (param, known[1], known[2] + 1)
                continue
            if param.dtype == dtype:
                continue
            original = param.data
            self.kept[id(param)] = (param, original, 1)
            low = original.to(dtype)
            param.data = low.to(original.dtype) if values_only else low

    def restore(self, params: list[nn.Parameter]) -> None:
        for param in params:
            known = self.kept.get(id(param))
            if known is None:
                continue
            if known[2] > 1:
                self.kept[id(param)] = (param, known[1], known[2] - 1)
                continue
            param.data = known[1]
            del self.kept[id(param)]

    def restore_all(self) -> None:
        for param, original, _ in self.kept.values():
            param.data = original
        self.kept.clear()


@contextmanager
def cast_params(
    params: list[nn.Parameter], dtype: torch.dtype, *, values_only: bool = False
) -> Iterator[None]:
    """``params`` compute in ``dtype`` while entered (``values_only``: their values rounded
    through ``dtype``, their dtype kept); their values are put back after."""
    swaps = _Swaps()
    swaps.cast(params, dtype, values_only=values_only)
    try:
        yield
    finally:
        swaps.restore_all()


def rounded_to(dtype: torch.dtype) -> Any:
    """For ``tree_map``: floating tensors rounded through ``dtype``, in their own dtype (what a
    kept module's input cast makes of activations that were ``dtype``)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype).to(x.dtype)
        return x

    return cast


class Computing:
    """While entered, ``model`` computes in ``dtype`` but for ``kept``.

    Args:
        model: An unsharded model with values (its parameters in their storage dtype).
        dtype: The uniform compute dtype.
        kept: Root-relative parameter FQN -> the boundary of the rule that keeps it; a kept
            parameter, and the other parameters of its module, compute in their storage dtype.
    """

    def __init__(
        self, model: nn.Module, dtype: torch.dtype, kept: Mapping[str, Boundary] | None = None
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.kept = dict(kept or {})
        self._swaps = _Swaps()
        self._handles: list[Any] = []

    def _plan(self) -> Iterator[tuple[nn.Module, list[nn.Parameter], ModuleCast | None]]:
        for prefix, module in self.model.named_modules():
            own = [
                (f"{prefix}.{n}" if prefix else n, p)
                for n, p in module.named_parameters(recurse=False)
                if p.is_floating_point()
            ]
            if not own:
                continue
            kept_here = [name for name, _ in own if name in self.kept]
            low = [] if kept_here else [p for _, p in own]
            cast = None
            if kept_here:
                kept = [p for _, p in own]
                boundaries = {self.kept[name] for name in kept_here}
                boundary = boundaries.pop() if len(boundaries) == 1 else "auto"
                cast = cast_for(
                    boundary,
                    kept[0].dtype,
                    kept,
                    self.dtype,
                    returns_activations=returns_activations(module),
                )
            yield module, low, cast

    def _hooks(self, low: list[nn.Parameter], cast: ModuleCast | None) -> tuple[Any, Any]:
        inputs = cast_to(self.dtype) if low else cast_to(cast.inputs) if cast else None
        back = cast is not None and cast.outputs

        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            self._swaps.cast(low, self.dtype)
            if inputs is None:
                return None
            return tree_map(inputs, args), tree_map(inputs, kwargs)

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            self._swaps.restore(low)
            return tree_map(cast_to(self.dtype), output) if back else None

        return pre, post

    def __enter__(self) -> Computing:
        for module, low, cast in self._plan():
            pre, post = self._hooks(low, cast)
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(post, with_kwargs=True, always_call=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._swaps.restore_all()
