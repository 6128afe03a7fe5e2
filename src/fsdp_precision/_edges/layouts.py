"""The layouts exports write and the hand-off names tensors in: what the target library loads.

- ``transformers``: ``config.json`` (+ ``generation_config.json``), ``model.safetensors`` or
  shards with ``model.safetensors.index.json``; names in the on-disk checkpoint format
  (transformers 5 reverts its load-time conversions, e.g. fused MoE experts back to
  ``experts.{i}.*``, with its own ``revert_weight_conversion``); tied weights once.
- ``diffusers``: the model's ``config.json`` and ``diffusion_pytorch_model*.safetensors``.
- ``peft``: ``adapter_config.json`` and ``adapter_model.safetensors``, the adapter's tensors named
  as PEFT's own ``get_peft_model_state_dict`` names them.
- ``plain``: ``model.safetensors`` and nothing else (any ``nn.Module``).

Every conversion runs on one group of tensors at a time (one FSDP unit), on meta tensors first
(names, dtypes and shapes before any gather) and then on the gathered ones. The packages are
imported lazily: each is an optional dependency.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["Layout", "LayoutName", "check_layout_name", "layout_for", "unwrapped_class"]

LayoutName = Literal["auto", "transformers", "diffusers", "peft", "plain"]
_NAMES = ("auto", "transformers", "diffusers", "peft", "plain")
#: Layout -> (package, base class) a model of that layout derives from; "auto" tries them in order.
_BASES = {
    "peft": ("peft", "PeftModel"),
    "transformers": ("transformers", "PreTrainedModel"),
    "diffusers": ("diffusers", "ModelMixin"),
}

Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    """How one target library names and stores a model's weights.

    Attributes:
        name: ``"transformers"``, ``"diffusers"``, ``"peft"`` or ``"plain"``.
        weights_name: The single-file name; shards insert ``-0000i-of-0000n`` before
            ``.safetensors``, and the index is ``<weights_name>.index.json``.
        convert: One group's tensors (state-dict names) -> the layout's names and tensors.
        save_config: Writes the layout's config files into a directory; returns their names.
    """

    name: str
    weights_name: str
    convert: Convert
    save_config: Callable[[Path, torch.dtype | None], list[str]]


def unwrapped_class(model: nn.Module) -> type:
    """The model's own class: FSDP2 swaps in a subclass named ``FSDP<Name>``."""
    cls: type = type(model)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls


def _is(model: nn.Module, package: str, base: str) -> bool:
    return any(c.__module__.startswith(package) and c.__name__ == base for c in type(model).__mro__)


def check_layout_name(layout: object) -> None:
    """``ValueError`` unless ``layout`` names a layout."""
    if layout not in _NAMES:
        raise ValueError(
            f"layout={layout!r} is not a layout; pass one of {list(_NAMES)} ('auto' picks the "
            "model's own)"
        )


def layout_for(model: nn.Module, layout: object = "auto") -> Layout:
    """The layout for ``model`` (``"auto"``: PEFT for a ``PeftModel``, transformers for a
    ``PreTrainedModel``, Diffusers for a ``ModelMixin``, else plain). ``ValueError`` for an
    unknown name or a layout the model is not."""
    check_layout_name(layout)
    kinds = {name: _is(model, *base) for name, base in _BASES.items()}
    if layout == "auto":
        layout = next((k for k, found in kinds.items() if found), "plain")
    elif layout != "plain" and not kinds[str(layout)]:
        package, base = _BASES[str(layout)]
        raise ValueError(
            f"layout={layout!r} but the model is a {unwrapped_class(model).__name__}, not a "
            f"{package}.{base}; pass layout='auto' (or 'plain' for model.safetensors alone)"
        )
    if layout == "transformers":
        return Layout("transformers", "model.safetensors", _revert(model), _hf_config(model))
    if layout == "diffusers":
        return Layout(
            "diffusers", "diffusion_pytorch_model.safetensors", _same, _diffusers_config(model)
        )
    if layout == "peft":
        return Layout("peft", "adapter_model.safetensors", _adapter(model), _peft_config(model))
    return Layout("plain", "model.safetensors", _same, _no_config)


def _same(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return group


def _no_config(out: Path, dtype: torch.dtype | None) -> list[str]:
    return []


# ------------------------------------------------------------------ transformers


def _revert(model: nn.Module) -> Convert:
    """transformers' own reversal of its load-time conversions (5.x), one group at a time."""
    try:  # lazy: an optional dependency; 4.x has no conversions to revert
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return _same

    def convert(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(revert_weight_conversion(model, dict(group)))  # type: ignore[arg-type]

    return convert


def _hf_config(model: nn.Module) -> Callable[[Path, torch.dtype | None], list[str]]:
    def save(out: Path, dtype: torch.dtype | None) -> list[str]:
        config = _copy(model.config)
        config.architectures = [unwrapped_class(model).__name__]
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")  # what dtype="auto" loads
        config.save_pretrained(out)
        written = ["config.json"]
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)()
        if generation is not None and can_generate:
            generation.save_pretrained(out)
            written.append("generation_config.json")
        return written

    return save


def _copy(config: Any) -> Any:
    import copy  # lazy: only exports with a config need it

    return copy.deepcopy(config)


# ------------------------------------------------------------------ diffusers


def _diffusers_config(model: nn.Module) -> Callable[[Path, torch.dtype | None], list[str]]:
    def save(out: Path, dtype: torch.dtype | None) -> list[str]:
        data = json.loads(model.to_json_string())  # type: ignore[operator]
        data["_class_name"] = unwrapped_class(model).__name__
        (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return ["config.json"]

    return save


# ------------------------------------------------------------------ peft


def _adapter(model: nn.Module) -> Convert:
    from peft.utils import get_peft_model_state_dict  # lazy: an optional dependency

    adapter = str(getattr(model, "active_adapter", "default"))

    def convert(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        picked = get_peft_model_state_dict(
            model, state_dict=dict(group), adapter_name=adapter, save_embedding_layers=False
        )
        return dict(picked)

    return convert


def _peft_config(model: nn.Module) -> Callable[[Path, torch.dtype | None], list[str]]:
    """The adapter's config as ``PeftModel.save_pretrained`` writes it: ``inference_mode``
    true, the base model's name filled in, and the ``auto_mapping`` that ``AutoPeftModel``
    reads when the config has no ``task_type``. Set-valued fields (``target_modules``) are
    written sorted, so two exports of one adapter write the same bytes (PEFT writes a set in
    its iteration order, which a copy or another process can change)."""

    def save(out: Path, dtype: torch.dtype | None) -> list[str]:
        adapter = str(getattr(model, "active_adapter", "default"))
        config = _copy(model.peft_config[adapter])  # type: ignore[index]
        config.inference_mode = True
        for key, value in vars(config).items():
            if isinstance(value, (set, frozenset)):
                setattr(config, key, sorted(value, key=str))
        base: Any = model.base_model
        inner = base if config.is_prompt_learning else base.model
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = inner.__dict__.get("name_or_path") or None
        auto = None
        if config.task_type is None:
            cls = unwrapped_class(inner)
            auto = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        config.save_pretrained(str(out), auto_mapping_dict=auto)
        return ["adapter_config.json"]

    return save
