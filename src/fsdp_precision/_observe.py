"""Observe what FSDP actually does: collectives on the wire and parameters as units gather them.

Public through :mod:`fsdp_precision.testing`; used by verify, the demo, the tests and the
benchmarks. Nothing here changes numerics: the recorder
wraps ``torch.distributed``'s collective functions and forwards every call unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["Collective", "CollectiveRecorder", "GatheredParam", "GatherProbe"]

# name in torch.distributed -> (kind, index of the positional arg carrying the input tensor)
_WRAPPED: dict[str, tuple[str, str]] = {
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}


@dataclass(frozen=True)
class Collective:
    """One collective call as it went to the process group.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        dtype: Dtype on the wire (``torch.uint8`` when FSDP packs mixed dtypes as bytes).
        input_bytes: Bytes this rank contributed.
        group_size: Ranks in the group.
    """

    kind: str
    dtype: torch.dtype
    input_bytes: int
    group_size: int

    @property
    def output_bytes(self) -> int:
        """Bytes every rank receives (all-gather) or contributes in total (reduce-scatter)."""
        if self.kind == "all_gather":
            return self.input_bytes * self.group_size
        return self.input_bytes


@dataclass
class CollectiveRecorder:
    """Context manager recording FSDP's collectives by wrapping ``torch.distributed``.

    >>> with CollectiveRecorder() as rec:  # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> rec.count("all_gather")  # doctest: +SKIP
    """

    calls: list[Collective] = field(default_factory=list)
    _saved: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)

    def _wrap(self, name: str, kind: str, arg: str) -> Callable[..., Any]:
        original = getattr(dist, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs.get(arg)
            if tensor is None:
                tensor = args[1] if kind != "all_reduce" else args[0]
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            self.calls.append(
                Collective(kind, tensor.dtype, tensor.numel() * tensor.element_size(), size)
            )
            return original(*args, **kwargs)

        return wrapper

    def __enter__(self) -> CollectiveRecorder:
        for name, (kind, arg) in _WRAPPED.items():
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, kind, arg))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def of(self, kind: str) -> list[Collective]:
        """The recorded calls of one kind, in order."""
        return [c for c in self.calls if c.kind == kind]

    def count(self, kind: str) -> int:
        """How many calls of one kind were recorded."""
        return len(self.of(kind))

    def clear(self) -> None:
        """Forget what was recorded so far (keep recording)."""
        self.calls.clear()


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
    from torch.distributed.fsdp import FSDPModule

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
        from torch.distributed.tensor import DTensor

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
