"""Ranks agree on every ``fully_shard`` call before anything is sharded.

A map that differs across ranks (a rule reading a rank-dependent value, a model built differently
on one rank, a file read on rank 0 only) makes the ranks build all-gather buffers of different
sizes: gloo aborts the process ("Received data size doesn't match expected size"), NCCL hangs
until its watchdog. So each call, while the patch is installed, describes what it resolved (per
managed parameter: its local name, shape, storage and compute dtypes, whether it trains; the
call's modules and policy dtypes) and the ranks of its mesh compare a 16-byte digest of it with
one small all-gather. Where the digests differ, or a rank refused the call, the descriptions are
gathered and every rank raises the same :class:`~fsdp_precision._base.errors.RankMismatchError`,
naming the ranks and the first entry that differs. Pure public torch (``torch.distributed``).

Which call is compared with which needs no numbering: the agreement is itself a collective on
the call's group, so the ``n``-th call that checks over a group meets the ``n``-th on every other
rank of it, whatever the rank did on other groups. The digest is therefore only what the call
resolved; the call's number in messages is counted per process group object, which is right per
rank where the ranks are threads of one process (torch's threaded process group gives each
thread its own group objects) and ignores calls a rank made on other groups (a sub-mesh only
some ranks hold).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import RankMismatchError

__all__ = ["CallRecord", "agree", "call_record", "checking", "set_checking"]

_checking = True  # apply_param_dtype_map_patch(check_ranks=...)
# Checked calls per process group (its identity: a thread of torch's threaded process group has
# its own group objects); only names a call in messages.
_calls: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
_calls_lock = threading.Lock()
#: What a rank that already saw a difference sends instead of its digest (a digest equal to it
#: has probability 2**-128).
_FLAG = [0, 0]


def set_checking(enabled: bool) -> None:
    """Whether ``fully_shard`` calls compare what they resolved across ranks (on by default)."""
    global _checking
    _checking = enabled


def checking() -> bool:
    """See :func:`set_checking`."""
    return _checking


@dataclass(frozen=True)
class CallRecord:
    """What one rank resolved for one ``fully_shard`` call.

    Attributes:
        head: The call's modules and policy, one line.
        entries: One line per managed parameter, in the order the call manages them.
        refusal: This rank refused the call: its error's message. (Default: ``""``)
    """

    head: str
    entries: tuple[str, ...]
    refusal: str = ""

    def digest(self) -> list[int]:
        """Two int64 of the record's SHA-256 (what the ranks compare)."""
        text = "\n".join((self.head, *self.entries, self.refusal))
        raw = hashlib.sha256(text.encode()).digest()
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)]


def call_record(
    modules: Sequence[nn.Module],
    params: Sequence[nn.Parameter],
    names: Mapping[int, Sequence[str]],
    compute: Mapping[int, torch.dtype],
    policy_dtypes: tuple[torch.dtype | None, torch.dtype | None],
    refusal: str = "",
) -> CallRecord:
    """The record of one call: ``names`` maps ``id(param)`` to its local names, ``compute`` to
    the dtype it is mapped to (absent: the policy's ``param_dtype``, else its storage)."""
    param_dtype, reduce_dtype = policy_dtypes
    head = (
        f"modules {', '.join(type(m).__name__ for m in modules)}; param_dtype "
        f"{_name(param_dtype)}, reduce_dtype {_name(reduce_dtype)}"
    )
    entries = []
    for param in params:
        mapped = compute.get(id(param))
        dtype = mapped or (param_dtype if param.is_floating_point() else None) or param.dtype
        name = ", ".join(names.get(id(param), ("?",)))
        entries.append(
            f"{name!r} {list(param.shape)} {dtype_name(param.dtype)} -> {dtype_name(dtype)}"
            f"{' (mapped)' if mapped is not None else ''}"
            f"{'' if param.requires_grad else ' (frozen)'}"
        )
    return CallRecord(head, tuple(entries), refusal)


def agree(
    record: CallRecord, groups: Sequence[dist.ProcessGroup | None], device: torch.device
) -> None:
    """Compare ``record`` across the ranks of each group (the mesh's shard group, and its
    replicate group for HSDP); raise :class:`RankMismatchError` on every rank of every group
    when any rank differs or refused the call. A group of one rank, or no process group, checks
    nothing.

    Every rank takes part in every group's comparison before any rank raises: a rank that
    already saw a difference (or refused the call) sends a flag instead of its digest, so a
    difference confined to one shard group reaches every other shard group through the
    replicate group (each of which holds a rank of every shard group), instead of one shard
    group raising while the others wait on the replicate group. The explanation (every record)
    is then gathered over each group whose comparison showed something wrong, which all of that
    group's ranks saw alike."""
    live = [
        g for g in groups if g is not None and dist.is_initialized() and dist.get_world_size(g) > 1
    ]
    if not live:
        return
    call = _next_call(live[0])
    flagged = bool(record.refusal)
    wrong: list[dist.ProcessGroup] = []
    for group in live:
        size = dist.get_world_size(group)
        sent = _FLAG if flagged else record.digest()
        mine = torch.tensor(sent, dtype=torch.int64, device=device)
        gathered = torch.empty(size * 2, dtype=torch.int64, device=device)
        _all_gather(gathered, mine, group=group)
        rows = {tuple(row) for row in gathered.view(size, 2).tolist()}
        if len(rows) > 1 or tuple(_FLAG) in rows:
            wrong.append(group)
            flagged = True
    if not wrong:
        return
    messages = []
    for group in wrong:
        records: list[CallRecord | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(records, record, group=group)
        ranks = dist.get_process_group_ranks(group)
        messages.append(_message(call, [r for r in records if r is not None], ranks))
    raise RankMismatchError(next((m for m in messages if m), _elsewhere(call, wrong)))


def _elsewhere(call: int, groups: Sequence[dist.ProcessGroup]) -> str:
    ranks = sorted({r for g in groups for r in dist.get_process_group_ranks(g)})
    return (
        f"{_call(call, ranks)}: ranks of another group of the mesh resolved it differently or "
        "refused it (their error names what differs); every rank stops here, before anything "
        "is sharded"
    )


def _next_call(group: dist.ProcessGroup) -> int:
    """The number of this checked call among those over ``group`` (the same on its every rank)."""
    with _calls_lock:
        call = _calls.get(group, 0)
        _calls[group] = call + 1
    return call


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (a deprecation warning since) to
    # all_gather_single; 2.11 and 2.12 have only the old name. Looked up per call: a
    # collective recorder (testing.CollectiveRecorder) wraps the module attribute.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _message(call: int, records: list[CallRecord], ranks: list[int]) -> str:
    refused = [(rank, r.refusal) for rank, r in zip(ranks, records, strict=True) if r.refusal]
    if refused:
        rank, why = refused[0]
        others = [r for r, rec in zip(ranks, records, strict=True) if not rec.refusal]
        return (
            f"{_call(call, ranks)} differs across ranks: rank {rank} refused it ({why}); "
            + (f"ranks {others} did not. " if others else "")
            + "Every rank stops here, before anything is sharded"
        )
    base_rank, base = ranks[0], records[0]
    for rank, other in zip(ranks[1:], records[1:], strict=True):
        if other == base:
            continue
        what = _first_difference(base, other)
        return (
            f"{_call(call, ranks)} differs across ranks: rank {rank} resolved something "
            f"other than rank {base_rank}: {what}. A map must be the same on every rank (a "
            "rule reading a rank-dependent value, a model built differently on one rank, or a "
            "file read on rank 0 only make them differ); every rank stops here, before "
            "anything is sharded"
        )
    return ""  # the same records here: the difference is in another group


def _call(call: int, ranks: list[int]) -> str:
    return f"fully_shard call #{call} over ranks {ranks}"


def _first_difference(a: CallRecord, b: CallRecord) -> str:
    if a.head != b.head:
        return f"{b.head!r} where the other has {a.head!r}"
    for i, (x, y) in enumerate(zip(a.entries, b.entries, strict=False)):
        if x != y:
            return f"parameter #{i}: {y} where the other has {x}"
    return f"{len(b.entries)} parameters where the other has {len(a.entries)}"


def _name(dtype: torch.dtype | None) -> str:
    return dtype_name(dtype) if dtype is not None else "None"
