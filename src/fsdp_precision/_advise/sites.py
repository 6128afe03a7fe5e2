"""At each candidate module, on the same inputs: the module run again with its candidate
parameters in the compute dtype and kept, and what changed (:mod:`._advise.measure`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_precision._advise.emulate import cast_params, rounded_to
from fsdp_precision._base.watch import ROOT
from fsdp_precision._policy.casts import cast_to

__all__ = ["Site", "floating", "owner_of", "within"]


# ------------------------------------------------------------------------------- selections


class _Selections(TorchFunctionMode):
    """Records every ``topk`` a forward runs: its input's last size and what it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "topk" and args and isinstance(out, tuple):
            values, indices = out[0], out[1]
            size = int(args[0].shape[-1]) if args[0].dim() else 1
            self.calls.append((size, values.detach(), indices.detach()))
        return out


def _add_selections(
    totals: list[float],
    low: list[tuple[int, torch.Tensor, torch.Tensor]],
    kept: list[tuple[int, torch.Tensor, torch.Tensor]],
) -> None:
    """Adds to ``totals`` (tokens, flipped tokens, summed weight differences, summed kept
    weights) the paired ``topk`` calls of two forwards of one module (nothing where they
    selected a different number of times)."""
    if len(low) != len(kept):
        return
    for (size, values_low, idx_low), (_, values_kept, idx_kept) in zip(low, kept, strict=True):
        rows = idx_kept.reshape(-1, idx_kept.shape[-1] if idx_kept.dim() else 1).cpu()
        rows_low = idx_low.reshape(rows.shape).cpu()
        differ = (rows.sort(-1).values != rows_low.sort(-1).values).any(-1)
        dense_kept = torch.zeros(rows.shape[0], size).scatter_(
            1, rows, values_kept.reshape(rows.shape).float().cpu()
        )
        dense_low = torch.zeros(rows.shape[0], size).scatter_(
            1, rows_low, values_low.reshape(rows.shape).float().cpu()
        )
        totals[0] += rows.shape[0]
        totals[1] += float(differ.sum())
        totals[2] += float((dense_low - dense_kept).abs().sum())
        totals[3] += float(dense_kept.abs().sum())


def floating(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _relative_error(low: list[torch.Tensor], kept: list[torch.Tensor]) -> float | None:
    if len(low) != len(kept) or not kept:
        return None
    diff = sum(float((a.float() - b.float()).pow(2).sum()) for a, b in zip(low, kept, strict=True))
    ref = sum(float(b.float().pow(2).sum()) for b in kept)
    return (diff / ref) ** 0.5 if ref else 0.0


def _holds_below(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` holds floating parameters of its own."""
    return any(
        p.is_floating_point()
        for child in module.modules()
        if child is not module
        for p in child.parameters(recurse=False)
    )


def within(fqn: str, module: str) -> bool:
    return module == ROOT or fqn == module or fqn.startswith(f"{module}.")


def owner_of(param: str) -> str:
    return param.rpartition(".")[0] or ROOT


def _module(model: nn.Module, fqn: str) -> nn.Module:
    return model if fqn == ROOT else model.get_submodule(fqn)


# ------------------------------------------------------------------------- at each candidate


class Site:
    """One module run again for one candidate: the candidate's parameters (of ``params``) below
    it, the modules that own them, and what the runs gave, summed over batches."""

    def __init__(self, model: nn.Module, name: str, params: Sequence[str]) -> None:
        self.name = name
        self.module = _module(model, name)
        names = [p for p in params if within(p, name)]
        self.owners = {o: _module(model, o) for o in dict.fromkeys(owner_of(p) for p in names)}
        # A module computes whole in one dtype (a LayerNorm cannot mix a bf16 bias in). One
        # whose submodules hold parameters too (a Wan block's scale_shift_table) is run on
        # values rounded to the compute dtype, in its own dtype: its submodules stay as stored.
        self.leaves = {name: not _holds_below(owner) for name, owner in self.owners.items()}
        self.params = [
            p
            for name, owner in self.owners.items()
            if self.leaves[name]
            for p in owner.parameters(recurse=False)
            if p.is_floating_point()
        ]
        self.rounded = [
            p
            for name, owner in self.owners.items()
            if not self.leaves[name]
            for p in owner.parameters(recurse=False)
            if p.is_floating_point()
        ]
        self.errors: list[float] = []
        self.selections = [0.0, 0.0, 0.0, 0.0]

    def rerun(self, args: Any, kwargs: Any, dtype: torch.dtype) -> None:
        low_out, low_sel = self._run(args, kwargs, dtype, low=True)
        kept_out, kept_sel = self._run(args, kwargs, dtype, low=False)
        for owner in self.owners:
            error = _relative_error(low_out[owner], kept_out[owner])
            if error is not None:
                self.errors.append(error)
        _add_selections(self.selections, low_sel, kept_sel)

    def _run(
        self, args: Any, kwargs: Any, dtype: torch.dtype, *, low: bool
    ) -> tuple[dict[str, list[torch.Tensor]], list[tuple[int, torch.Tensor, torch.Tensor]]]:
        outputs: dict[str, list[torch.Tensor]] = {o: [] for o in self.owners}
        handles = []
        for name, owner in self.owners.items():
            incoming: list[torch.dtype | None] = []

            leaf = self.leaves[name]

            def pre(
                module: nn.Module,
                a: Any,
                kw: Any,
                incoming: list[Any] = incoming,
                leaf: bool = leaf,
            ) -> Any:
                found = floating((a, kw))
                incoming.append(found[0].dtype if found else None)
                cast = cast_to(dtype) if low and leaf else rounded_to(dtype)
                return tree_map(cast, a), tree_map(cast, kw)

            def post(
                module: nn.Module,
                a: Any,
                kw: Any,
                out: Any,
                name: str = name,
                incoming: list[Any] = incoming,
            ) -> Any:
                outputs[name].extend(t.detach().clone() for t in floating(out))
                back = incoming.pop() if incoming else None
                inner = module is not self.module
                return tree_map(cast_to(back), out) if low and inner and back else None

            handles.append(owner.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(owner.register_forward_hook(post, with_kwargs=True))
        selections = _Selections()
        try:
            with (
                cast_params(self.params if low else [], dtype),
                cast_params(self.rounded if low else [], dtype, values_only=True),
                selections,
            ):
                self.module(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return outputs, selections.calls
