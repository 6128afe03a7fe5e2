"""MODEL arguments of the CLI: ``hf:<model_type>``, a Hugging Face directory (transformers or
Diffusers), ``module:callable``.

:func:`load_model` builds the model (on meta for ``plan``, on the CPU for ``verify``), shrunk by
:func:`fsdp_precision.testing.tiny_config` when asked (Diffusers models:
:mod:`fsdp_precision._cli.diffusers_models`).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._cli.diffusers_models import DiffusersConfig, build, diffusers_config
from fsdp_precision.testing._tiny_config import tiny_config

__all__ = ["is_hf_spec", "load_config", "load_model"]


def is_hf_spec(spec: str) -> bool:
    """Whether ``spec`` names a Hugging Face architecture (``hf:...``, or a transformers or
    Diffusers config directory)."""
    return spec.startswith("hf:") or Path(spec).is_dir()


def _require_transformers(spec: str) -> None:
    try:
        import transformers  # noqa: F401  # lazy: an optional dependency
    except ImportError as exc:
        raise ValueError(
            f"MODEL {spec!r} needs Hugging Face transformers, which is not installed; "
            "pip install 'fsdp-precision[hf]'"
        ) from exc


def load_config(spec: str) -> Any:
    """The transformers config of ``hf:<model_type>`` or of a local directory's config.json; a
    :class:`DiffusersConfig` for a Diffusers model directory (``_class_name`` in config.json)."""
    if not spec.startswith("hf:"):
        diffusers = diffusers_config(spec)
        if diffusers is not None:
            return diffusers
    _require_transformers(spec)
    from transformers import AutoConfig  # lazy: an optional dependency

    if spec.startswith("hf:"):
        model_type = spec[3:]
        try:
            return AutoConfig.for_model(model_type)
        except ValueError as exc:
            raise ValueError(
                f"MODEL {spec!r}: transformers knows no model_type {model_type!r} "
                "(examples: hf:llama, hf:deepseek_v3, hf:t5, hf:gpt_oss)"
            ) from exc
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ValueError(f"MODEL {spec!r} is a directory without config.json")
    try:
        return AutoConfig.from_pretrained(str(path))
    except OSError as exc:  # transformers' word for a config.json that is not JSON
        raise ValueError(
            f"MODEL {spec!r}: its config.json cannot be read ({exc}); fix the file, or pass "
            "hf:<model_type>"
        ) from exc


def load_model(
    spec: str,
    *,
    device: str | torch.device = "meta",
    tiny: bool = False,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build MODEL: ``hf:<model_type>`` | a local Hugging Face directory | ``module:callable``.

    Args:
        spec: ``hf:deepseek_v3``, ``path/to/dir`` (with config.json, transformers' or
            Diffusers'; no weights are read) or ``package.module:factory`` (any callable
            returning an ``nn.Module``; the module is looked up from the current directory
            first, as ``python -m`` does).
        device: Where to build it (the factory is called under ``torch.device(device)``).
            (Default: ``"meta"``: no memory, no initialisation)
        tiny: Shrink a transformers config with :func:`tiny_config` first (a Diffusers one
            with ``tiny_diffusers_config``); ignored for ``module:callable``. (Default: ``False``)
        dtype: Floating dtype for a transformers model (``from_config(dtype=...)``) or a
            Diffusers one (cast after building); ``None``
            keeps the config's. Ignored for ``module:callable``. (Default: ``None``)

    Raises ``ValueError`` with a one-line message for anything the user got wrong.
    """
    if is_hf_spec(spec):
        config = load_config(spec)
        if isinstance(config, DiffusersConfig):
            return build(config, torch.device(device), tiny=tiny, dtype=dtype)
        if tiny:
            config = tiny_config(config)
        return _from_config(config, torch.device(device), dtype)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"MODEL {spec!r} is not hf:<model_type>, a directory with config.json, or "
            "module:callable"
        )
    if not {"", os.getcwd()} & set(sys.path):  # the current directory's modules, as python -m
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"MODEL {spec!r}: cannot import {attr} from {module_name} ({exc})"
        ) from exc
    if not callable(factory):
        raise ValueError(
            f"MODEL {spec!r}: {module_name}.{attr} is a {type(factory).__name__}, not a callable; "
            "pass module:factory, a function or class that returns an nn.Module"
        )
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"MODEL {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _from_config(config: Any, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    # lazy: an optional dependency
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    kwargs = {"dtype": dtype} if dtype is not None else {}
    with device:
        for auto in (AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModel):
            try:
                return auto.from_config(config, **kwargs)  # type: ignore[no-any-return,no-untyped-call]
            except ValueError:
                continue
    raise ValueError(f"no transformers model class for {type(config).__name__}")
