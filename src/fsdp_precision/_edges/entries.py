"""What a model's weights are, tensor by tensor, before anything is gathered: each state-dict
entry's name, shape, storage dtype, the dtype training computed it in, its unit, and why it is
kept when that dtype is not the bulk's.

A parameter is *kept* when the dtype its FSDP unit computes it in differs from the bulk compute
dtype (the root unit's ``param_dtype``; without FSDP, the most common dtype by elements): a
mapped router or norm, a unit of its own in fp32, a buffer FSDP never casts. Exports and the
hand-off send kept tensors in that dtype and the rest in the dtype asked for.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._policy.scope import ModelScopedPolicy

if TYPE_CHECKING:
    from fsdp_precision._patch.inspect import ManagedParam

__all__ = [
    "Dtype",
    "WeightEntry",
    "block_of",
    "bulk_dtype",
    "check_dtype",
    "out_dtype",
    "strip_wrappers",
    "tensor_slots",
    "weight_entries",
]

#: What a caller asks tensors to come out as: each in its storage dtype, each in the dtype
#: training computed it in, or one dtype for the bulk with kept tensors in theirs.
Dtype = Literal["stored", "compute"] | torch.dtype

#: Wrapper segments that state dicts of wrapped modules carry and checkpoints do not (torch's
#: ``torch.compile`` and activation-checkpoint wrappers, as DCP strips them).
_WRAPPER_SEGMENTS = re.compile(
    r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\."
)


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the model's state dict (tied aliases once).

    Attributes:
        name: Its state-dict key (wrapper segments removed).
        tensor: The parameter or buffer itself (a ``DTensor`` shard under FSDP2).
        shape: Its full shape.
        storage: The dtype it is stored in.
        compute: The dtype training computed it in (its storage dtype outside FSDP units).
        group: The unit it is gathered with: the FQN of the innermost FSDP module around it, or
            without FSDP the first numbered block of its name (``model.layers.3``, ``0``);
            tensors of one group are consecutive.
        kept: Why it computes in a dtype other than the bulk's; ``None`` for the bulk.
    """

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    storage: torch.dtype
    compute: torch.dtype
    group: str
    kept: str | None


def strip_wrappers(name: str) -> str:
    """``name`` without the segments of torch's wrappers (``_orig_mod``, ...)."""
    return _WRAPPER_SEGMENTS.sub(r"\1", name + ".")[:-1] if name else name


def check_dtype(dtype: object, *, name: str = "dtype") -> Dtype:
    """``dtype`` if it is ``"stored"``, ``"compute"`` or a floating torch dtype; ``ValueError``."""
    if dtype in ("stored", "compute") or (
        isinstance(dtype, torch.dtype) and dtype.is_floating_point
    ):
        return dtype
    raise ValueError(
        f"{name}={dtype!r} is not an export dtype; pass 'stored' (each tensor as stored), "
        "'compute' (each in the dtype training computed it in) or a floating torch dtype for "
        "the bulk (e.g. torch.bfloat16; kept tensors stay in theirs)"
    )


def out_dtype(entry: WeightEntry, dtype: Dtype, *, cast_kept: bool = False) -> torch.dtype:
    """The dtype ``entry`` leaves in when ``dtype`` is asked for."""
    if not entry.storage.is_floating_point or dtype == "stored":
        return entry.storage
    if dtype == "compute":
        return entry.compute
    assert isinstance(dtype, torch.dtype)  # check_dtype
    return entry.compute if entry.kept is not None and not cast_kept else dtype


def bulk_dtype(entries: Sequence[WeightEntry], root_policy: torch.dtype | None) -> torch.dtype:
    """The root unit's ``param_dtype``, else the most common compute dtype by elements."""
    if root_policy is not None:
        return root_policy
    counts: Counter[torch.dtype] = Counter()
    for e in entries:
        if e.storage.is_floating_point:
            counts[e.compute] += e.tensor.numel()
    return counts.most_common(1)[0][0] if counts else torch.float32


def weight_entries(model: nn.Module) -> tuple[list[WeightEntry], torch.dtype]:
    """Every state-dict tensor of ``model`` (tied aliases once), in state-dict order, and the bulk
    compute dtype. Local: reads the model and its FSDP state, gathers nothing."""
    if isinstance(model, DistributedDataParallel):  # names as DCP's: without ``module.``
        model = model.module
    # lazy: importing the package loads no submodule of the patch package
    from fsdp_precision._patch.inspect import managed_params

    managed = managed_params(model)
    units = _unit_prefixes(model)
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or ())
    raw: list[tuple[str, torch.Tensor]] = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            raw.append((strip_wrappers(key), tensor))
    # After state_dict(): FSDP2's state-dict hook re-registers a unit's sharded parameters, and a
    # unit left unsharded (the root after a no-grad forward) held its unsharded ones until then.
    owners = _owners(model)
    # Tied aliases once: transformers' declared source name, else the first one.
    names_of: dict[int, list[str]] = {}
    for name, tensor in raw:
        names_of.setdefault(id(tensor), []).append(name)
    keep = {i: next((n for n in ns if n not in tied_targets), ns[0]) for i, ns in names_of.items()}
    root = managed_root_dtype(model, managed)
    staged: list[tuple[str, torch.Tensor, torch.dtype, str, ManagedParam | None, bool]] = []
    modules: dict[str, nn.Module] = {}
    for name, tensor in raw:
        if keep[id(tensor)] != name:
            continue
        slot = owners.get(id(tensor))
        info = managed.get(slot) if slot is not None else None
        if slot is None:  # no module holds it: a state-dict hook made it (torchtitan's QKV split)
            modules = modules or {strip_wrappers(n): m for n, m in model.named_modules()}
            info = _hook_source(name, modules, managed)
        compute = info.compute if info is not None else tensor.dtype
        is_buffer = slot is not None and not isinstance(tensor, nn.Parameter)
        staged.append((name, tensor, compute, _group(name, units), info, is_buffer))
    entries = [
        WeightEntry(n, t, tuple(int(s) for s in t.shape), t.dtype, c, g, None)
        for n, t, c, g, _, _ in staged
    ]
    bulk = bulk_dtype(entries, root)
    out = []
    for entry, (_, _, _, _, info, is_buffer) in zip(entries, staged, strict=True):
        why = None
        if entry.storage.is_floating_point and entry.compute != bulk:
            why = _reason(entry, info, is_buffer)
        out.append(WeightEntry(**{**entry.__dict__, "kept": why}))
    return out, bulk


def managed_root_dtype(
    model: nn.Module, managed: Mapping[tuple[int, str], ManagedParam]
) -> torch.dtype | None:
    """The ``param_dtype`` of the unit that includes ``model`` itself, if it is wrapped."""
    for info in managed.values():
        if info.unit == "":
            return info.policy.param_dtype
    return None


def _owners(model: nn.Module) -> dict[int, tuple[int, str]]:
    """``id(tensor) -> (id(owner module), attribute)`` for every parameter and buffer."""
    owners: dict[int, tuple[int, str]] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is not None:
                    owners.setdefault(id(tensor), (id(module), attr))
    return owners


def _hook_source(
    name: str, modules: Mapping[str, nn.Module], managed: Mapping[tuple[int, str], ManagedParam]
) -> ManagedParam | None:
    """How the parameters of the module a state-dict hook made ``name`` in compute, when they
    agree: torchtitan's fused ``qkv_linear.wqkv.weight`` is saved as ``qkv_linear.wq.weight``,
    ``wk``, ``wv``, new tensors no module holds. The closest enclosing module with managed
    parameters decides; ``None`` (kept as stored) when there is none or they differ."""
    prefix = name
    while "." in prefix:
        prefix = prefix.rsplit(".", 1)[0]
        module = modules.get(prefix)
        if module is None:
            continue  # a name the hook made (``wq``), not a module
        found = [
            managed[(id(m), attr)]
            for m in module.modules()
            for attr in m._parameters
            if (id(m), attr) in managed
        ]
        if found:
            return found[0] if len({f.compute for f in found}) == 1 else None
    return None


def _unit_prefixes(model: nn.Module) -> list[str]:
    """State-dict prefixes of the FSDP modules, deepest first (``""``: the root)."""
    prefixes = {
        strip_wrappers(name)
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
    }
    return sorted(prefixes, key=lambda p: -p.count(".") - bool(p))


#: The shortest prefix of a name that ends in a numeric segment: ``model.layers.3`` of
#: ``model.layers.3.mlp.weight``, ``0`` of an ``nn.Sequential``'s ``0.weight``.
_NUMBERED = re.compile(r"^((?:[^.]*\.)*?\d+)(\.|$)")


def block_of(name: str) -> str:
    """The numbered block ``name`` lies in (``model.layers.3``, or ``0`` for a block at the root
    of an ``nn.Sequential``); ``""`` when no segment of it is a number."""
    match = _NUMBERED.match(name)
    return match.group(1) if match else ""


def _group(name: str, units: Sequence[str]) -> str:
    for prefix in units:
        if prefix == "" or name.startswith(prefix + "."):
            return prefix
    return block_of(name)


def _reason(entry: WeightEntry, info: ManagedParam | None, is_buffer: bool) -> str:
    compute = dtype_name(entry.compute)
    if info is None:
        what = "a buffer" if is_buffer else "not in an FSDP unit"
        return f"{what}: computes in its storage dtype, {compute}"
    if info.mapped:
        policy = info.policy
        if isinstance(policy, ModelScopedPolicy) and policy.scope is not None:
            found = policy.scope.reasons.get(entry.name)
            if found is not None:
                return f"{found} -> {compute}"
        return f"param_dtype_map of fully_shard({info.unit or 'root'}) -> {compute}"
    return (
        f"unit {info.unit or 'root'} computes in {compute} (param_dtype={info.policy.param_dtype})"
    )


def tensor_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """State-dict name (wrapper segments removed) -> (owner module, attribute, tensor), every
    alias of a tied tensor."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is not None:
                    owners.setdefault(id(tensor), (module, attr))
    found: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        owner = owners.get(id(tensor))
        if owner is not None:
            found[strip_wrappers(key)] = (owner[0], owner[1], tensor)
    return found
