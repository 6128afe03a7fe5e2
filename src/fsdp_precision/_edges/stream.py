"""The full weights of a (wrapped) model, unit by unit, in the dtypes the plan keeps: the stream
exports write to disk and inference engines take in ``load_weights``.

What comes out is known before anything is gathered (:attr:`WeightStream.metadata`: names, dtypes,
shapes, in order, the same on every rank), as vLLM's ``WeightSource.metadata`` and SGLang's
``update_weights_from_distributed(names, dtypes, shapes)`` want it. Then one group at a time (one
FSDP unit, or one numbered block of an unwrapped model): each tensor is cast on its shard to the
dtype it leaves in, all-gathered (``DTensor.full_tensor``), converted to the layout's names, and
handed out. Memory: one group's full tensors at a time, never the whole model on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._edges.entries import (
    Dtype,
    WeightEntry,
    check_dtype,
    out_dtype,
    tensor_slots,
    weight_entries,
)
from fsdp_precision._edges.layouts import Layout, LayoutName, layout_for
from fsdp_precision._edges.record import RecordedCast, install_casts, recorded_casts

__all__ = ["Fetch", "Ranks", "WeightMeta", "WeightStream", "full_weights", "plan_stream"]

#: Which ranks receive the tensors: every rank, or rank 0 alone (the others gather and drop).
Ranks = Literal["all", "rank0"]


#: Brings one group's full tensors, each in its dtype: ``None`` on a rank that receives nothing.
Fetch = Callable[[Sequence[WeightEntry], Sequence[torch.dtype]], "dict[str, torch.Tensor] | None"]


@dataclass(frozen=True)
class WeightMeta:
    """One tensor the stream will yield, known before any gather.

    Attributes:
        name: Its name in the layout (a Hugging Face checkpoint name for transformers models).
        dtype: The dtype it is yielded in.
        shape: Its full shape.
        kept: Why it is in a dtype other than the bulk's (``None``: the bulk).
        param: The model's state-dict name it comes from unchanged (``None``: a layout
            conversion made it from several, e.g. one expert of a fused tensor).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kept: str | None
    param: str | None


@dataclass(frozen=True)
class _Group:
    entries: tuple[WeightEntry, ...]  # what is gathered
    dtypes: tuple[torch.dtype, ...]  # each entry's dtype on the wire and out
    out: tuple[WeightMeta, ...]  # what is yielded


class WeightStream:
    """An iterable of ``(name, tensor)``: a model's full weights, unit by unit.

    Built by :func:`full_weights`. Iterating is collective: every rank of the model's process
    group iterates it to the end (ranks that receive nothing: :meth:`drain`). One pass: the
    stream gathers the model's current values when iterated.

    Attributes:
        metadata: Every tensor it yields, in order: name, dtype, shape, why kept.
        bulk: The dtype training computed the bulk of the model in.
        layout: The layout naming the tensors (``"transformers"``, ``"diffusers"``, ``"peft"``,
            ``"plain"``).
        casts: The boundary casts training ran kept modules with (a router's input cast to
            fp32), by the model's module names: what a consumer installs to compute as training
            did.
    """

    def __init__(
        self,
        groups: Sequence[_Group],
        *,
        bulk: torch.dtype,
        layout: Layout,
        fetch: Fetch,
        casts: tuple[RecordedCast, ...] = (),
    ) -> None:
        self._groups = tuple(groups)
        self._layout = layout
        self._fetch = fetch
        self.bulk = bulk
        self.casts = casts
        self.layout = layout.name
        self.metadata: tuple[WeightMeta, ...] = tuple(m for g in groups for m in g.out)

    @property
    def kept(self) -> dict[str, WeightMeta]:
        """The tensors yielded in a dtype other than the bulk's, by name."""
        return {m.name: m for m in self.metadata if m.kept is not None}

    @property
    def nbytes(self) -> int:
        """Bytes of every yielded tensor together."""
        return sum(_numel(m.shape) * m.dtype.itemsize for m in self.metadata)

    def install_casts(self, model: nn.Module) -> list[str]:
        """Install :attr:`casts` on ``model`` (a consumer's copy of the architecture, loaded
        from this stream), so that its kept modules compute as training's did; return the
        modules that got one (those ``model`` lacks, or that cast already, are left alone)."""
        return install_casts(model, self.casts)

    def load_into(self, model: nn.Module, *, casts: bool = True) -> list[str]:
        """Copy the stream into ``model``, a consumer's copy of the architecture whose
        state-dict names are the stream's (``layout="plain"``, or the same model class): each
        tensor copied into its parameter or buffer, kept tensors allocated in their kept dtype
        (a router stays fp32 in a bf16 copy), and with ``casts`` the training's boundary casts
        installed: the copy computes as the trained model. Returns the names loaded.

        Collective like iterating: every rank calls it; with ``ranks="rank0"`` the others load
        nothing. Checked first, against :attr:`metadata`: a name ``model`` lacks or a shape it
        does not have raises ``ValueError`` before anything is gathered or modified."""
        slots = tensor_slots(model)
        missing = [m.name for m in self.metadata if m.name not in slots]
        shapes = [
            f"{m.name} {m.shape} vs {tuple(slots[m.name][2].shape)}"
            for m in self.metadata
            if m.name in slots and tuple(slots[m.name][2].shape) != m.shape
        ]
        if missing or shapes:
            raise ValueError(
                f"the stream does not fit {type(model).__name__}: names it lacks {missing[:3]}, "
                f"shapes {shapes[:3]}; load it into the same architecture (for a transformers "
                "model under another name mapping, iterate the stream with layout='plain')"
            )
        kept = self.kept
        loaded = []
        with torch.no_grad():
            for name, tensor in self:
                module, attr, current = slots[name]
                if name in kept and current.dtype != tensor.dtype:  # allocated in its kept dtype
                    if isinstance(current, nn.Parameter):
                        current.data = tensor.to(current.device)
                    else:
                        module._buffers[attr] = tensor.to(current.device)
                else:
                    current.copy_(tensor)
                loaded.append(name)
        if casts:
            self.install_casts(model)
        return loaded

    def __len__(self) -> int:
        return len(self.metadata)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for group in self._groups:
                yield from self._gather(group)

    def groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The same tensors, one list per unit (a unit's tensors are in memory together)."""
        with torch.no_grad():
            for group in self._groups:
                yield list(self._gather(group))

    def drain(self) -> None:
        """Take part in every gather without keeping anything (ranks that receive nothing)."""
        for _ in self:
            pass

    def _gather(self, group: _Group) -> Iterator[tuple[str, torch.Tensor]]:
        gathered = self._fetch(group.entries, group.dtypes)
        if gathered is None:  # this rank receives nothing
            return
        converted = self._layout.convert(gathered)
        del gathered
        for meta in group.out:
            tensor = converted.pop(meta.name)
            if tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
                raise RuntimeError(  # the layout's conversion differs on meta and real tensors
                    f"{meta.name}: the layout gave {dtype_name(tensor.dtype)} "
                    f"{tuple(tensor.shape)}, its metadata said {dtype_name(meta.dtype)} "
                    f"{meta.shape}"
                )
            yield meta.name, tensor


def full_weights(
    model: nn.Module,
    *,
    dtype: Dtype = "compute",
    cast_kept: bool = False,
    ranks: Ranks = "all",
    device: torch.device | str | None = None,
    layout: LayoutName = "auto",
) -> WeightStream:
    """The full weights of ``model``, unit by unit, for an inference engine's ``load_weights``.

    ``model`` is FSDP2-wrapped (DTensor shards; any mesh) or not. The stream yields
    ``(name, tensor)`` pairs in the layout's names (``"auto"``: Hugging Face checkpoint names for
    a transformers model, unfused as on disk, tied weights once; PEFT's adapter names for a
    ``PeftModel``), in state-dict order, one unit in memory at a time.

    ``dtype``: ``"compute"`` (default): each tensor in the dtype training computed it in (the
    bulk in ``param_dtype``, kept routers and norms in theirs); a torch dtype: the bulk in it,
    kept tensors in theirs (``cast_kept=True``: everything in it, for engines that assert one
    dtype); ``"stored"``: each as stored (fp32 master weights stay fp32).

    ``ranks``: ``"all"`` (every rank receives every tensor, for engines colocated per rank) or
    ``"rank0"`` (the others gather and receive nothing: they call :meth:`WeightStream.drain`).
    ``device``: where yielded tensors live (default: where the gather ran, the parameters'
    device). Collective when iterated; building it is local and gathers nothing.

    Raises ``ValueError`` for a bad ``dtype``, ``ranks`` or ``layout`` before anything is read.
    """
    dtype = check_dtype(dtype)
    if ranks not in ("all", "rank0"):
        raise ValueError(f"ranks={ranks!r}; pass 'all' (every rank receives) or 'rank0'")
    if not isinstance(cast_kept, bool):
        raise ValueError(f"cast_kept={cast_kept!r}; pass True or False")
    chosen = layout_for(model, layout)
    entries, bulk = weight_entries(model)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    receive = ranks == "all" or rank == 0
    target = torch.device(device) if device is not None else None

    def fetch(
        entries: Sequence[WeightEntry], dtypes: Sequence[torch.dtype]
    ) -> dict[str, torch.Tensor] | None:
        full = {e.name: _full(e.tensor, d) for e, d in zip(entries, dtypes, strict=True)}
        if not receive:
            return None  # gathered for the others; nothing copied to this rank's host
        return full if target is None else to_device(full, target)

    stream = plan_stream(
        entries, bulk, dtype=dtype, cast_kept=cast_kept, layout=chosen, fetch=fetch
    )
    stream.casts = recorded_casts(model)
    return stream


def plan_stream(
    entries: Sequence[WeightEntry],
    bulk: torch.dtype,
    *,
    dtype: Dtype,
    cast_kept: bool,
    layout: Layout,
    fetch: Fetch,
) -> WeightStream:
    """The stream of ``entries`` (in groups of consecutive entries of one unit), worked out on
    meta tensors; ``fetch`` brings one group's full tensors (or ``None`` on a rank that receives
    nothing) when iterated."""
    groups = [_plan_group(run, dtype, cast_kept, layout) for run in _runs(entries)]
    return WeightStream([g for g in groups if g.out], bulk=bulk, layout=layout, fetch=fetch)


def _runs(entries: Sequence[WeightEntry]) -> Iterator[list[WeightEntry]]:
    """Consecutive entries of one group."""
    run: list[WeightEntry] = []
    for entry in entries:
        if run and run[-1].group != entry.group:
            yield run
            run = []
        run.append(entry)
    if run:
        yield run


def _plan_group(
    run: Sequence[WeightEntry], dtype: Dtype, cast_kept: bool, layout: Layout
) -> _Group:
    """What one group gathers and yields, worked out on meta tensors."""
    dtypes = [out_dtype(e, dtype, cast_kept=cast_kept) for e in run]
    meta = {
        e.name: torch.empty(e.shape, dtype=d, device="meta")
        for e, d in zip(run, dtypes, strict=True)
    }
    source = {id(t): e for e, t in zip(run, meta.values(), strict=True)}
    converted = layout.convert(dict(meta))
    same_objects = all(id(t) in source for t in converted.values())
    needed = {id(source[id(t)]) for t in converted.values()} if same_objects else None
    survived = {id(source[id(t)]) for t in converted.values() if id(t) in source}
    consumed = [(e, d) for e, d in zip(run, dtypes, strict=True) if id(e) not in survived]
    out = []
    for name, t in converted.items():
        entry = source.get(id(t))
        why = entry.kept if entry is not None else _consumed_reason(consumed, t.dtype)
        shape = tuple(int(s) for s in t.shape)
        out.append(WeightMeta(name, t.dtype, shape, why, entry.name if entry else None))
    pairs = [(e, d) for e, d in zip(run, dtypes, strict=True) if needed is None or id(e) in needed]
    return _Group(tuple(e for e, _ in pairs), tuple(d for _, d in pairs), tuple(out))


def _consumed_reason(
    consumed: Sequence[tuple[WeightEntry, torch.dtype]], dtype: torch.dtype
) -> str | None:
    """Why a tensor a conversion made (from the ``consumed`` inputs) is kept: the reasons of the
    kept inputs of its dtype, when no bulk input of that dtype went into the conversion."""
    same = [e for e, d in consumed if d == dtype]
    if not same or any(e.kept is None for e in same):
        return None
    return "; ".join(sorted({str(e.kept) for e in same}))


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """One group's tensors on ``device``. From a GPU to the host: into pinned buffers, every copy
    queued without waiting, then one synchronization for the group (one per tensor before)."""
    if device.type != "cpu" or not any(t.is_cuda for t in tensors.values()):
        return {name: t.to(device) for name, t in tensors.items()}
    out = {}
    for name, tensor in tensors.items():
        if not tensor.is_cuda:
            out[name] = tensor.to(device)
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out[name] = host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return out


def _full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` whole, in ``dtype``: cast on the shard, then all-gathered (DTensor)."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        mesh = tensor.device_mesh
        if local.device.type != mesh.device_type:  # CPU offload: gather on the mesh's device
            local = local.to(mesh.device_type)
        local = local.to(dtype)
        full = DTensor.from_local(
            local, mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
        ).full_tensor()
    else:
        full = tensor.detach().to(dtype=dtype, copy=True)
    return full


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
