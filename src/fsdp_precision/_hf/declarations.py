"""Keep-in-fp32 declarations of Hugging Face transformers and Diffusers, with their semantics.

Which list applies, and how a pattern matches a name, follow the installed library:

* transformers 5.x: ``PreTrainedModel._get_dtype_plan(dtype)`` picks the lists (non-strict for
  fp16, strict for fp16 and bf16); names match with ``core_model_loading.build_glob_alternation``
  (``*`` -> ``.*``, unanchored ``re.search``: a pattern may match inside a longer name).
* transformers 4.x: the same lists; a pattern matches whole dotted segments
  (``(^|\\.)pattern($|\\.)``), so ``wo`` never matches ``word_embeddings``.
* Diffusers: ``_keep_in_fp32_modules`` for any low-precision dtype (fp16, bf16); a pattern matches
  one dotted segment (``pattern in name.split(".")``).

``from_pretrained(dtype)`` applies the lists to the keys it loads, and this module matches the same
keys (*load names*):

* names relative to the library model, wherever it sits in the module tree: each outermost
  ``PreTrainedModel`` / ``ModelMixin`` (not inside another one) declares for its own subtree, so a
  ``PeftModel`` or any plain wrapper keeps the declarations of the model it wraps;
* PEFT's layers are seen through: ``q_proj.base_layer.weight`` loads as ``q_proj.weight``, and the
  adapters PEFT adds (``lora_A``, ...) were never loaded, so no declaration reaches them;
* parameters and persistent floating buffers only: a non-persistent buffer is never loaded (it
  keeps the dtype the model's code built it in, e.g. rotary ``inv_freq`` in fp32);
* transformers 5.x saves one name per tied group (``all_tied_weights_keys`` maps each tie target
  to its source), so a declaration that matches only a tie target keeps nothing: the target loads
  as its source does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Declaration", "LibraryModel", "declarations", "library_models", "library_of"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Declaration:
    """One declared keep pattern and the exact names it matches in one model.

    Attributes:
        source: Which list declared it, e.g. ``"transformers _keep_in_fp32_modules_strict"``.
        pattern: The pattern as declared.
        params: Root-relative FQNs of the parameters it keeps
            (``named_parameters(remove_duplicate=False)`` names whose load name matches).
        buffers: Root-relative FQNs of the persistent floating buffers it keeps.
    """

    source: str
    pattern: str
    params: frozenset[str]
    buffers: frozenset[str]


@dataclass(frozen=True)
class LibraryModel:
    """An outermost transformers or Diffusers model inside a module tree.

    Attributes:
        prefix: Its FQN in the tree (``""`` for the root itself).
        module: The model.
        library: ``"transformers"`` or ``"diffusers"``.
    """

    prefix: str
    module: nn.Module
    library: str


def _library_of_class(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        origin = cls.__module__
        if cls.__name__ == "PreTrainedModel" and origin.startswith("transformers"):
            return "transformers"
        if cls.__name__ == "ModelMixin" and origin.startswith("diffusers"):
            return "diffusers"
    return None


def library_models(model: nn.Module) -> list[LibraryModel]:
    """Every outermost transformers or Diffusers model in ``model``'s tree, in module order."""
    found: list[LibraryModel] = []

    def walk(prefix: str, module: nn.Module) -> None:
        library = _library_of_class(module)
        if library is not None:
            found.append(LibraryModel(prefix.removesuffix("."), module, library))
            return
        for name, child in module.named_children():
            walk(f"{prefix}{name}.", child)

    walk("", model)
    return found


def library_of(model: nn.Module) -> str | None:
    """``"transformers"``, ``"diffusers"`` or ``None``: the library of ``model``, or of the first
    library model it wraps (a ``PeftModel``'s base model)."""
    found = library_models(model)
    return found[0].library if found else None


def _transformers_major() -> int:
    import transformers  # lazy: an optional dependency

    return int(transformers.__version__.split(".")[0])


def _lists_for(model: LibraryModel, dtype: torch.dtype) -> list[tuple[str, str]]:
    """``[(source, pattern)]`` of the lists the model's library applies at ``dtype``."""
    module = model.module
    pairs: list[tuple[str, str]] = []
    if model.library == "diffusers":
        if dtype in LOW_PRECISION:
            for pattern in getattr(module, "_keep_in_fp32_modules", None) or ():
                pairs.append(("diffusers _keep_in_fp32_modules", pattern))
        return pairs
    keep = list(getattr(module, "_keep_in_fp32_modules", None) or ())
    strict = list(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    get_plan = getattr(module, "_get_dtype_plan", None)
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


def _matcher(library: str, pattern: str) -> Callable[[str], bool]:
    if library == "diffusers":
        return lambda name: pattern in name.split(".")
    if _transformers_major() >= 5:
        # lazy: an optional dependency, and a 5.x module
        from transformers.core_model_loading import build_glob_alternation

        regex, _, _ = build_glob_alternation([pattern])
        return lambda name: regex.search(name) is not None
    regex4 = re.compile(rf"((^|\.){pattern}($|\.))")  # 4.x modeling_utils keep_in_fp32_regex
    return lambda name: regex4.search(name) is not None


#: Children of a PEFT wrapper layer that hold the wrapped module's own tensors.
_PEFT_WRAPPED = ("base_layer", "original_module")


def _is_peft_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.") and any(
        isinstance(getattr(module, name, None), nn.Module) for name in _PEFT_WRAPPED
    )


def _load_names(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor, bool]]:
    """``(load name, FQN in model, tensor, is a parameter)`` of every parameter and persistent
    floating buffer of ``model`` that ``from_pretrained`` loads, every alias included."""

    def walk(module: nn.Module, load: str, path: str) -> Iterator[tuple[str, str, Any, bool]]:
        for name, param in module._parameters.items():
            if param is not None:
                yield f"{load}{name}", f"{path}{name}", param, True
        for name, buf in module._buffers.items():
            persistent = name not in module._non_persistent_buffers_set
            if buf is not None and persistent and buf.is_floating_point():
                yield f"{load}{name}", f"{path}{name}", buf, False
        peft = _is_peft_layer(module)
        for name, child in module._modules.items():
            if child is None:
                continue
            if not peft:
                yield from walk(child, f"{load}{name}.", f"{path}{name}.")
            elif name in _PEFT_WRAPPED:  # the wrapped module's tensors, under the layer's name
                yield from walk(child, load, f"{path}{name}.")
            elif name == "modules_to_save":  # trainable copies of the wrapped module
                for copy_name, copy in child._modules.items():
                    if copy is not None:
                        yield from walk(copy, load, f"{path}{name}.{copy_name}.")
            # anything else a PEFT layer holds is an adapter: never loaded

    yield from walk(model, "", "")


def _tie_targets(model: LibraryModel, names: dict[str, list[str]]) -> set[str]:
    """Load names that transformers 5.x never saves: targets of ``all_tied_weights_keys`` that
    are tied to another name (``names``: tensor ``id`` as a string -> its load names)."""
    tied = getattr(model.module, "all_tied_weights_keys", None)
    if model.library != "transformers" or not isinstance(tied, dict):
        return set()
    shared = {n for group in names.values() if len(group) > 1 for n in group}
    return {target for target in tied if target in shared}


def declarations(model: nn.Module, dtype: torch.dtype) -> list[Declaration]:
    """The keep-in-fp32 declarations the model's library applies when loading at ``dtype``.

    ``dtype`` is the dtype the model computes in (the FSDP ``param_dtype``, or the storage dtype
    when ``param_dtype`` is ``None``). Each outermost library model in ``model``'s tree declares
    for its own subtree; names are root-relative. Returns an empty list for plain modules and for
    dtypes the library does not keep anything for (fp32, or bf16 with only non-strict lists).
    """
    result = []
    for found in library_models(model):
        prefix = f"{found.prefix}." if found.prefix else ""
        entries = list(_load_names(found.module))
        groups: dict[str, list[str]] = {}
        for load, _, tensor, _ in entries:
            groups.setdefault(str(id(tensor)), []).append(load)
        skipped = _tie_targets(found, groups)
        for source, pattern in _lists_for(found, dtype):
            match = _matcher(found.library, pattern)
            hits = [
                (path, is_param)
                for load, path, _, is_param in entries
                if load not in skipped and match(load)
            ]
            result.append(
                Declaration(
                    source=source,
                    pattern=pattern,
                    params=frozenset(prefix + path for path, is_param in hits if is_param),
                    buffers=frozenset(prefix + path for path, is_param in hits if not is_param),
                )
            )
    return result
