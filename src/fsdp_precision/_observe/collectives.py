"""Collectives on the wire: every all-gather, reduce-scatter and all-reduce, with dtype and bytes.

Nothing here changes numerics: the recorder wraps ``torch.distributed``'s collective functions
(FSDP's own) and its functional collectives (``torch.distributed._functional_collectives``,
which DTensor's redistributions issue: tensor parallelism's, and the all-reduce of a gradient
that is ``Partial`` over a TP mesh dim) and forwards every call unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["Collective", "CollectiveRecorder"]

# name in torch.distributed -> (kind, index of the positional arg carrying the input tensor)
_WRAPPED: dict[str, tuple[str, str]] = {
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}

# name in torch.distributed._functional_collectives -> (kind, where ``group`` sits among the
# positional arguments after the input tensor)
_FUNCTIONAL: dict[str, tuple[str, int]] = {
    "all_gather_tensor": ("all_gather", 1),  # (self, gather_dim, group)
    "reduce_scatter_tensor": ("reduce_scatter", 2),  # (self, reduceOp, scatter_dim, group)
    "all_reduce": ("all_reduce", 1),  # (self, reduceOp, group)
}


@dataclass(frozen=True)
class Collective:
    """One collective call as it went to the process group.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        dtype: Dtype on the wire (``torch.uint8`` when FSDP packs mixed dtypes as bytes).
        input_bytes: Bytes this rank contributed.
        group_size: Ranks in the group.
        functional: Issued through torch's functional collectives (DTensor's redistributions:
            tensor parallelism, a gradient reduced over a TP mesh dim), not FSDP's own.
    """

    kind: str
    dtype: torch.dtype
    input_bytes: int
    group_size: int
    functional: bool = False

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

    Where the ranks are threads of one process (torch's threaded process group), each rank's
    recorder sees its own rank's calls: a call goes to the recorders entered in the thread that
    issues it. A call from a thread Python did not start (autograd's device threads, which run
    FSDP's post-backward reduce-scatters on a GPU) goes to every recorder active in the process;
    one from another Python thread that entered none (another rank's) goes to none.
    """

    calls: list[Collective] = field(default_factory=list)

    def __enter__(self) -> CollectiveRecorder:
        with _lock:
            if not _active:
                _install()
            _active.append(self)
        _entered().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _entered().remove(self)
        with _lock:
            _active.remove(self)
            if not _active:
                _uninstall()

    def of(self, kind: str, *, functional: bool = False) -> list[Collective]:
        """The recorded calls of one kind, in order: FSDP's own (``torch.distributed``'s), or
        with ``functional=True`` the functional ones (DTensor's redistributions)."""
        return [c for c in self.calls if c.kind == kind and c.functional == functional]

    def count(self, kind: str, *, functional: bool = False) -> int:
        """How many calls of one kind were recorded (see :meth:`of`)."""
        return len(self.of(kind, functional=functional))

    def clear(self) -> None:
        """Forget what was recorded so far (keep recording)."""
        self.calls.clear()


# One set of wrappers per process, in place while any recorder is active; each call is appended
# to the recorders that should see it (_recipients).
_lock = threading.Lock()
_active: list[CollectiveRecorder] = []
_originals: dict[str, Callable[..., Any]] = {}
_local = threading.local()


def _entered() -> list[CollectiveRecorder]:
    """The recorders entered in this thread, innermost last."""
    entered: list[CollectiveRecorder] | None = getattr(_local, "recorders", None)
    if entered is None:
        entered = _local.recorders = []
    return entered


def _record(call: Collective) -> None:
    recipients = list(_entered())
    if not recipients and isinstance(threading.current_thread(), threading._DummyThread):
        with _lock:  # a thread torch started (autograd's): the process's recorders
            recipients = list(_active)
    for recorder in recipients:
        recorder.calls.append(call)


def _install() -> None:
    for name, (kind, arg) in _WRAPPED.items():
        if hasattr(dist, name):
            _originals[name] = getattr(dist, name)
            setattr(dist, name, _wrap(_originals[name], kind, arg))
    for name, (kind, at) in _FUNCTIONAL.items():
        _originals["funcol." + name] = getattr(funcol, name)
        setattr(funcol, name, _wrap_functional(getattr(funcol, name), kind, at))


def _uninstall() -> None:
    for name, original in _originals.items():
        owner, _, attr = name.rpartition(".")
        setattr(funcol if owner == "funcol" else dist, attr, original)
    _originals.clear()


def _wrap(original: Callable[..., Any], kind: str, arg: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensor = kwargs.get(arg)
        if tensor is None:
            tensor = args[1] if kind != "all_reduce" else args[0]
        group = kwargs.get("group")
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        _record(Collective(kind, tensor.dtype, tensor.numel() * tensor.element_size(), size))
        return original(*args, **kwargs)

    return wrapper


def _wrap_functional(original: Callable[..., Any], kind: str, at: int) -> Callable[..., Any]:
    def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[at] if len(args) > at else None)
        nbytes = tensor.numel() * tensor.element_size()
        _record(Collective(kind, tensor.dtype, nbytes, _size(group), True))
        return original(tensor, *args, **kwargs)

    return wrapper


def _size(group: Any) -> int:
    """Ranks in a functional collective's group: a process group, a 1-D device mesh, a
    ``(mesh, mesh_dim)`` pair or a list of ranks."""
    if isinstance(group, tuple):
        mesh, dim = group
        return int(mesh.size(dim))
    if isinstance(group, list):
        return len(group)
    if hasattr(group, "size") and not isinstance(group, dist.ProcessGroup):
        return int(group.size())  # a 1-D DeviceMesh
    return dist.get_world_size(group)
