"""Parameters as their FSDP units gather them, read in forward pre-hooks right after the
all-gather: the FQN, dtype, shape and numel each unit delivered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["GatherProbe", "GatheredParam"]


@dataclass(frozen=True)
class GatheredParam:
    """A parameter as its FSDP unit delivered it, read right after the unit's all-gather.

    Attributes:
        fqn: Root-relative FQN (every alias of a tied parameter is recorded under its own FQN).
        unit: FQN of the module whose forward pre-hook read it: the FSDP unit (a module that
            ``fully_shard`` was called on; ``""`` is the root, a unit or not).
        dtype: Dtype the unit's forward computes with (its all-gathered compute dtype).
        shape: Shape of the unsharded parameter.
        numel: Number of elements of the unsharded parameter.
        sharded: Still a ``DTensor`` shard: the unit's all-gather did not run.
    """

    fqn: str
    unit: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int
    sharded: bool


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The root and every module ``fully_shard`` was called on (a grouped call's members each)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if not name or isinstance(module, FSDPModule)
    ]


def _managed(unit: nn.Module, prefix: str, inner: set[int]) -> list[tuple[str, nn.Module, str]]:
    """``(fqn, owner, name)`` of each parameter under ``unit`` but not under an inner unit."""
    out: list[tuple[str, nn.Module, str]] = []

    def walk(module: nn.Module, path: str) -> None:
        for name in module._parameters:
            if module._parameters[name] is not None:
                out.append((f"{path}.{name}" if path else name, module, name))
        for name, child in module._modules.items():
            if child is not None and id(child) not in inner:
                walk(child, f"{path}.{name}" if path else name)

    walk(unit, prefix)
    return out


class GatherProbe:
    """Forward pre-hooks recording what each FSDP unit really all-gathered.

    One hook per unit (every module ``fully_shard`` was called on, and the root), registered
    after FSDP's own pre-forward hook (which FSDP prepends): it reads each parameter the unit
    holds (those under it, not under an inner unit) right after the unit's all-gather, and
    records its FQN, dtype, shape and numel in :attr:`seen`, the first time the unit runs.
    On an unwrapped model the root is the only unit and the probe sees the parameters as they
    are. Nothing is changed: the hooks only read.

    >>> with GatherProbe(model) as probe:  # doctest: +SKIP
    ...     model(x)
    >>> probe.seen["norm.weight"].dtype  # doctest: +SKIP
    torch.float32
    """

    def __init__(self, model: nn.Module) -> None:
        #: FQN -> the parameter as its unit delivered it (first forward of the unit).
        self.seen: dict[str, GatheredParam] = {}
        units = _units(model)
        inner = {id(module) for name, module in units if name}
        self._handles = [
            module.register_forward_pre_hook(
                self._hook(name, _managed(module, name, inner - {id(module)}))
            )
            for name, module in units
        ]

    def _hook(self, unit: str, params: list[tuple[str, nn.Module, str]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for fqn, owner, name in params:
                if fqn in self.seen:
                    continue
                param = getattr(owner, name)  # FSDP swaps in the unsharded parameter
                self.seen[fqn] = GatheredParam(
                    fqn=fqn,
                    unit=unit,
                    dtype=param.dtype,
                    shape=tuple(param.shape),
                    numel=param.numel(),
                    sharded=isinstance(param, DTensor),
                )

        return hook

    def by_unit(self) -> dict[str, dict[torch.dtype, int]]:
        """Per unit, the elements it gathered by dtype (``{"blocks.0": {bf16: 4096, ...}}``)."""
        out: dict[str, dict[torch.dtype, int]] = {}
        for seen in self.seen.values():
            dtypes = out.setdefault(seen.unit, {})
            dtypes[seen.dtype] = dtypes.get(seen.dtype, 0) + seen.numel
        return out

    def clear(self) -> None:
        """Forget what was seen (keep observing): the next forward is recorded afresh."""
        self.seen.clear()

    def remove(self) -> None:
        """Remove the hooks (what was seen stays in :attr:`seen`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> GatherProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
