"""In-memory state dicts: full (consolidated on rank 0) or sharded (DTensors), validated first."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_precision._base.errors import CheckpointError, StateDictMismatchError
from fsdp_precision._edges.checkpoint.collective import (
    distributed,
    from_rank0,
    raise_collectively,
    rank_world,
)

__all__ = [
    "StateDictType",
    "check_type",
    "load_model_state_dict",
    "mismatch_error",
    "model_shapes",
    "model_state_dict",
]

StateDictType = Literal["full", "sharded"]
_TYPES: tuple[str, ...] = ("full", "sharded")


def check_type(state_dict_type: object, *, name: str = "state_dict_type") -> StateDictType:
    """``state_dict_type`` if it is ``"full"`` or ``"sharded"``; :class:`CheckpointError` else."""
    if state_dict_type not in _TYPES:
        raise CheckpointError(
            f"{name}={state_dict_type!r} is not a state dict type; "
            f"pass {name}='full' (consolidated) or {name}='sharded' (DTensor shards per rank)"
        )
    return cast(StateDictType, state_dict_type)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)  # a DTensor's shape is its global shape


def _template(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's sharded state dict: keys, global shapes and dtypes, without a gather."""
    return {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in the model's state dict, by key (no gather)."""
    return {k: _shape(v) for k, v in _template(model).items()}


def mismatch_error(
    what: str,
    destination: Mapping[str, tuple[int, ...]],
    incoming: Mapping[str, tuple[int, ...]],
) -> StateDictMismatchError | None:
    """The error listing every missing key, unexpected key and shape mismatch (None: they match)."""
    missing = sorted(k for k in destination if k not in incoming)
    unexpected = sorted(k for k in incoming if k not in destination)
    shapes = sorted(
        (k, incoming[k], destination[k])
        for k in destination
        if k in incoming and incoming[k] != destination[k]
    )
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {missing}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {unexpected}")
    if shapes:
        listed = ", ".join(f"{k!r} incoming {tuple(a)} vs model {tuple(b)}" for k, a, b in shapes)
        parts.append(f"{len(shapes)} shape mismatch(es): {listed}")
    return StateDictMismatchError(
        f"{what} does not match the model: {'; '.join(parts)}. Nothing was loaded; load a state "
        "dict of the same architecture, or rename, drop or reshape those keys before loading",
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=[(k, tuple(a), tuple(b)) for k, a, b in shapes],
    )


def model_state_dict(model: nn.Module, state_dict_type: StateDictType = "full") -> dict[str, Any]:
    """The model's state dict with every tensor in its own storage dtype.

    Collective: every rank of the model's process group must call it.

    - ``"full"``: consolidated tensors offloaded to CPU, **on rank 0 only**; every other rank gets
      ``{}`` (a full copy per rank would cost world-size times the memory). The matching
      :func:`load_model_state_dict` reads rank 0's dict and broadcasts it.
    - ``"sharded"``: every rank gets its DTensor shards (no gather, no copy).

    Built on :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`.
    """
    kind = check_type(state_dict_type)
    if kind == "sharded":
        return get_model_state_dict(model)
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_model_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    state_dict_type: StateDictType = "full",
) -> None:
    """Load a state dict made by :func:`model_state_dict` (or any matching one) into ``model``.

    Collective: every rank must call it. ``"full"``: only rank 0's ``state_dict`` is read (other
    ranks may pass ``{}``); it is validated on rank 0 and broadcast tensor by tensor. ``"sharded"``:
    every rank passes its own DTensor shards.

    Keys and (global) shapes are checked first: missing keys, unexpected keys and shape
    mismatches raise :class:`StateDictMismatchError`, listing them all, on every rank, **before
    anything is modified**. A state dict of the other type (DTensors for ``"full"``, plain tensors
    where ``"sharded"`` expects DTensors) raises :class:`CheckpointError`.

    An incoming tensor whose dtype differs from the destination parameter's is cast to the
    destination dtype in a copy: the model keeps its dtypes, the caller's dict is not modified.
    The state dict's ``_metadata`` (each module's version, by which its ``_load_from_state_dict``
    migrates older layouts) reaches the modules on every rank: in a full load across ranks,
    rank 0's is broadcast with its validation (module versions: a few bytes per module).

    Built on :func:`torch.distributed.checkpoint.state_dict.set_model_state_dict`.
    """
    kind = check_type(state_dict_type)
    rank, _ = rank_world()
    destination = _template(model)
    reads_input = kind == "sharded" or rank == 0
    error: BaseException | None = None
    # The modules' versions, which their _load_from_state_dict migrates old layouts by.
    metadata = getattr(state_dict, "_metadata", None) if reads_input else None
    if reads_input:
        error = _validate(destination, state_dict, kind)
    if kind == "full":
        error, metadata = from_rank0((error, metadata if error is None else None))
        if error is not None:
            raise error
    else:
        raise_collectively(error)

    prepared: dict[str, Any] = OrderedDict()
    if metadata is not None:
        prepared._metadata = copy.copy(metadata)  # type: ignore[attr-defined]
    if not reads_input and metadata is not None:
        # DCP's broadcast fills this rank's dict in place and loads it, unless the dict is
        # empty: then it loads a new one, without the versions. Every key this rank holds,
        # each replaced by what rank 0 sends (strict: the keys are rank 0's, validated).
        prepared.update(destination)
    if reads_input:
        for key, value in state_dict.items():
            dest = destination.get(key)
            if isinstance(value, torch.Tensor) and dest is not None and value.dtype != dest.dtype:
                value = value.to(dest.dtype)  # a copy: the caller's tensor is left as it is
            prepared[key] = value
    options = StateDictOptions(
        full_state_dict=kind == "full",
        broadcast_from_rank0=kind == "full" and distributed(),
        strict=True,
    )
    set_model_state_dict(model, prepared, options=options)


def _validate(
    destination: Mapping[str, torch.Tensor], state_dict: object, kind: StateDictType
) -> BaseException | None:
    if not isinstance(state_dict, Mapping):
        return CheckpointError(
            f"state_dict is a {type(state_dict).__name__}, not a mapping of names to tensors; "
            "pass the dict returned by model_state_dict()"
        )
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    if kind == "full":
        dtensors = sorted(k for k, v in tensors.items() if isinstance(v, DTensor))
        if dtensors:
            return CheckpointError(
                f"state_dict_type='full' got DTensor shards (e.g. {dtensors[0]!r}): this is a "
                "sharded state dict; pass state_dict_type='sharded', or make a full one with "
                "model_state_dict(model, 'full')"
            )
    else:
        plain = sorted(
            k
            for k, v in tensors.items()
            if isinstance(destination.get(k), DTensor) and not isinstance(v, DTensor)
        )
        if plain:
            return CheckpointError(
                f"state_dict_type='sharded' got plain tensors where the model has DTensor shards "
                f"(e.g. {plain[0]!r}): this is a full state dict; pass state_dict_type='full' "
                "(on rank 0), or make a sharded one with model_state_dict(model, 'sharded')"
            )
    return mismatch_error(
        "state_dict",
        {k: _shape(v) for k, v in destination.items()},
        {k: _shape(v) for k, v in tensors.items()},
    )
