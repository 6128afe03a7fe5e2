"""Keep-in-fp32 declarations of Hugging Face transformers and Diffusers, with their semantics.

Which list applies, and how a pattern matches a name, follow the installed library:

* transformers 5.x: ``PreTrainedModel._get_dtype_plan(dtype)`` picks the lists (non-strict for
  fp16, strict for fp16 and bf16); names match with ``core_model_loading.build_glob_alternation``
  (``*`` -> ``.*``, unanchored ``re.search``: a pattern may match inside a longer name).
* transformers 4.x: the same lists; a pattern matches whole dotted segments
  (``(^|\\.)pattern($|\\.)``), so ``wo`` never matches ``word_embeddings``.
* Diffusers: ``_keep_in_fp32_modules`` for any low-precision dtype (fp16, bf16); a pattern matches
  one dotted segment (``pattern in name.split(".")``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Declaration", "declarations", "library_of"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Declaration:
    """One declared keep pattern and the exact names it matches in one model.

    Attributes:
        source: Which list declared it, e.g. ``"transformers _keep_in_fp32_modules_strict"``.
        pattern: The pattern as declared.
        params: Matched parameter FQNs (``named_parameters(remove_duplicate=False)``).
        buffers: Matched floating buffer FQNs (persistent or not).
    """

    source: str
    pattern: str
    params: frozenset[str]
    buffers: frozenset[str]


def library_of(model: nn.Module) -> str | None:
    """``"transformers"``, ``"diffusers"`` or ``None`` for a plain module."""
    for cls in type(model).__mro__:
        module = cls.__module__
        if cls.__name__ == "PreTrainedModel" and module.startswith("transformers"):
            return "transformers"
        if cls.__name__ == "ModelMixin" and module.startswith("diffusers"):
            return "diffusers"
    return None


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _lists_for(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, str]]:
    """``[(source, pattern)]`` of the lists the model's library applies at ``dtype``."""
    library = library_of(model)
    pairs: list[tuple[str, str]] = []
    if library == "diffusers":
        if dtype in LOW_PRECISION:
            for pattern in getattr(model, "_keep_in_fp32_modules", None) or ():
                pairs.append(("diffusers _keep_in_fp32_modules", pattern))
        return pairs
    if library != "transformers":
        return pairs
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or ())
    strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    get_plan = getattr(model, "_get_dtype_plan", None)
    if get_plan is not None:  # transformers 5.x decides which lists apply
        chosen = set(get_plan(dtype))
    else:  # transformers 4.x: non-strict for fp16, strict for fp16 and bf16
        chosen = set(keep if dtype == torch.float16 else ()) | set(
            strict if dtype in LOW_PRECISION else ()
        )
    for pattern in strict:
        if pattern in chosen:
            pairs.append(("transformers _keep_in_fp32_modules_strict", pattern))
            chosen.discard(pattern)
    for pattern in keep:
        if pattern in chosen:
            pairs.append(("transformers _keep_in_fp32_modules", pattern))
            chosen.discard(pattern)
    return pairs


def _matcher(model: nn.Module, pattern: str) -> Callable[[str], bool]:
    library = library_of(model)
    if library == "diffusers":
        return lambda name: pattern in name.split(".")
    if _transformers_major() >= 5:
        from transformers.core_model_loading import build_glob_alternation

        regex, _, _ = build_glob_alternation([pattern])
        return lambda name: regex.search(name) is not None
    regex4 = re.compile(rf"((^|\.){pattern}($|\.))")  # 4.x modeling_utils keep_in_fp32_regex
    return lambda name: regex4.search(name) is not None


def _floating_buffers(model: nn.Module) -> Iterator[str]:
    for name, buf in model.named_buffers(remove_duplicate=False):
        if buf is not None and buf.is_floating_point():
            yield name


def declarations(model: nn.Module, dtype: torch.dtype) -> list[Declaration]:
    """The keep-in-fp32 declarations the model's library applies when loading at ``dtype``.

    ``dtype`` is the dtype the model computes in (the FSDP ``param_dtype``, or the storage dtype
    when ``param_dtype`` is ``None``). Returns an empty list for plain modules and for dtypes the
    library does not keep anything for (fp32, or bf16 with only non-strict lists).
    """
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    buffers = list(_floating_buffers(model))
    result = []
    for source, pattern in _lists_for(model, dtype):
        match = _matcher(model, pattern)
        result.append(
            Declaration(
                source=source,
                pattern=pattern,
                params=frozenset(n for n in params if match(n)),
                buffers=frozenset(n for n in buffers if match(n)),
            )
        )
    return result


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
    import sys

    from torch.distributed.fsdp import FSDPModule

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
