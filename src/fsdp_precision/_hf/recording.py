"""transformers' output recording, kept for modules whose class ``fully_shard`` swaps.

transformers 5 looks a model's ``_can_record_outputs`` up by class name
(``output_capturing._CAN_RECORD_REGISTRY``, filled in ``post_init``); ``fully_shard`` turns a
module's class into ``FSDP<Name>``, after which a wrapped vision tower or decoder would record no
hidden states (LLaVA's ``image_outputs.hidden_states`` would be ``None``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["keep_output_recording"]


def keep_output_recording(modules: Iterator[nn.Module] | Sequence[nn.Module]) -> int:
    """Keep transformers' output recording for modules whose class ``fully_shard`` swaps.

    ``fully_shard`` turns a module's class into ``FSDP<Name>``. transformers 5 looks a model's
    ``_can_record_outputs`` up by class name (``output_capturing._CAN_RECORD_REGISTRY``, filled
    in ``post_init``), so a wrapped vision tower or decoder would record no hidden states and
    LLaVA's ``image_outputs.hidden_states`` would be ``None``. Each module is registered again
    the way ``post_init`` registers it: now if its class is already swapped, else by a one-shot
    forward pre-hook (the swap comes at the end of the ``fully_shard`` call, whose construction
    step calls this). Returns how many modules have flags; 0 when transformers (or the registry)
    is absent.
    """
    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        return 0
    count = 0
    for module in modules:
        flags = getattr(module, "_can_record_outputs", None)
        if not flags:
            continue
        count += 1
        if isinstance(module, FSDPModule):
            registry[module] = flags
        elif not getattr(module, _RECORDING_HOOK, False):
            setattr(module, _RECORDING_HOOK, True)
            _register_at_first_forward(module, registry, flags)
    return count


#: Marks a module whose output recording is registered at its first forward.
_RECORDING_HOOK = "_fsdp_precision_output_recording"


def _register_at_first_forward(module: nn.Module, registry: Any, flags: object) -> None:
    """Register ``flags`` for ``module``'s (by then swapped) class at its first forward."""

    def hook(module: nn.Module, args: Any) -> None:
        registry[module] = flags
        handle.remove()  # torch iterates over a copy of the hooks

    handle = module.register_forward_pre_hook(hook, prepend=True)
