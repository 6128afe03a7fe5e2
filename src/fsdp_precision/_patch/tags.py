"""What the patch records on torch's ``FSDPParam`` objects of mapped units.

Set at construction (``construct``) and at lazy init (``mp_dtypes``); read on the hot paths
(``gather``, ``reduce``), where a unit without the tag costs one attribute lookup before the
call goes to torch's original.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "MAPPED_CALL_ATTR",
    "MAPPED_DTYPE_ATTR",
    "MAPPED_UNIT_ATTR",
    "in_mapped_call",
    "in_mapped_unit",
    "mapped_dtype",
    "tag_call",
    "tagged_call",
]

#: FSDPParam attribute holding the mapped compute dtype (absent or None: unmapped).
MAPPED_DTYPE_ATTR = "_fsdp_precision_dtype"
#: FSDPParam attribute set on every parameter of a unit with mapped parameters.
MAPPED_UNIT_ATTR = "_fsdp_precision_unit"
#: FSDPParam attribute set at construction on every parameter of a ``fully_shard`` call whose map
#: resolved to at least one entry, whichever machinery (native override or patch) takes it.
MAPPED_CALL_ATTR = "_fsdp_precision_call"
#: FSDPParam attribute set at construction on every parameter of a mapped call, whichever
#: machinery takes it: ``(the policy the call was given, the dtype its map resolved or None)``.
#: Read by what inspects a wrapped model (``inspect``); never on the hot paths.
CALL_ATTR = "_fsdp_precision_given"


def mapped_dtype(fsdp_param: Any) -> torch.dtype | None:
    """The dtype the map gave this ``FSDPParam``, or None."""
    return getattr(fsdp_param, MAPPED_DTYPE_ATTR, None)


def in_mapped_unit(fsdp_param: Any) -> bool:
    """Whether this ``FSDPParam`` belongs to a unit with mapped parameters (after lazy init)."""
    return bool(getattr(fsdp_param, MAPPED_UNIT_ATTR, False))


def in_mapped_call(fsdp_param: Any) -> bool:
    """Whether this ``FSDPParam`` belongs to a ``fully_shard`` call with mapped parameters."""
    return bool(getattr(fsdp_param, MAPPED_CALL_ATTR, False))


def tag_call(fsdp_param: Any, policy: Any, dtype: torch.dtype | None) -> None:
    """Record the policy a mapped call was given and this parameter's resolved dtype."""
    setattr(fsdp_param, CALL_ATTR, (policy, dtype))


def tagged_call(fsdp_param: Any) -> tuple[Any, torch.dtype | None] | None:
    """``(policy given, resolved dtype)`` for a parameter of a mapped call, or None."""
    return getattr(fsdp_param, CALL_ATTR, None)
