"""Transformers' side of a ``MODEL`` (:mod:`fsdp_precision._cli.spec` resolves it): the config
of ``hf:<model_type>`` or of a directory's config.json, the classes that build from it, and the
model built from the config (no weights) or loaded with its weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._base.quiet import quiet_imports
from fsdp_precision.testing._tiny_config import tiny_config

__all__ = [
    "TINY_MAX_PARAMS",
    "from_pretrained",
    "load_config",
    "model_classes",
    "one_line",
    "tiny_config",
]

#: A tiny build with more parameters than this is refused before it is built on a real device:
#: its config has sizes ``tiny_config`` does not know by name.
TINY_MAX_PARAMS = 100_000_000


def _require_transformers(spec: str) -> None:
    try:
        import transformers  # noqa: F401  # lazy: an optional dependency
    except ImportError as exc:
        raise ValueError(
            f"MODEL {spec!r} needs Hugging Face transformers, which is not installed; "
            "pip install 'fsdp-precision[hf]'"
        ) from exc


def load_config(spec: str) -> Any:
    """The transformers config of ``hf:<model_type>`` or of a local directory's config.json."""
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
    except Exception as exc:  # noqa: BLE001 - the config class refused a value the user wrote
        raise ValueError(
            f"MODEL {spec!r}: transformers refuses its config.json ({one_line(_root(exc))}); "
            "fix that value in config.json"
        ) from exc


def _root(exc: BaseException) -> BaseException:
    """The first error of ``exc``'s chain of causes (a validator's own ``ValueError`` under
    huggingface_hub's ``StrictDataclassClassValidationError``)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def one_line(exc: BaseException) -> str:
    """``"Type: message"`` on one line; a message that opens with a heading ending in ``:``
    (transformers' config validation) keeps its next line, which says what is wrong."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return f"{type(exc).__name__}: {text}"[:240]


#: Where the model class of a transformers model type is looked up, in order: its causal LM,
#: else its seq2seq LM, else its image-text-to-text (vision-to-sequence: the name of the table in
#: transformers 4.x) or multimodal LM, else its base model.
_HF_TABLES = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def model_classes(config: Any) -> list[type]:
    """The transformers classes that can be built from ``config``, in :data:`_HF_TABLES`'s
    order: looked up by ``config.model_type`` (a config class shared by several model types,
    or registered under another type, is still found), then by the config's class through the
    auto classes (models registered with ``AutoModel*.register``)."""
    with quiet_imports():  # the model classes import torchao: its import-time noise
        import transformers  # lazy: an optional dependency
        from transformers.models.auto import modeling_auto

        found: list[type] = []
        model_type = getattr(config, "model_type", None)
        for table in _HF_TABLES:
            names = getattr(modeling_auto, table, {}).get(model_type)
            for name in names if isinstance(names, (list, tuple)) else (names,):
                cls = getattr(transformers, name, None) if isinstance(name, str) else None
                if isinstance(cls, type) and cls not in found:
                    found.append(cls)
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
        try:
            cls = mapping[type(config)] if mapping is not None else None
        except (KeyError, ValueError):
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return found


def _config_for(cls: type, config: Any) -> Any:
    """The config ``cls`` is built from: ``config``, or its text config for a text-only class
    of a multimodal type (Emu3's causal LM), as transformers' auto classes do."""
    text_class = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text_class is not None and getattr(cls, "config_class", None) is text_class:
        return config.get_text_config()
    return config


def _from_config(config: Any, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """The first class of :func:`model_classes` that builds; a causal LM whose config is not
    marked as a decoder is retried as one (Reformer's LM head refuses ``is_decoder=False``). When
    none builds, the first class's (last) error is raised."""
    classes = model_classes(config)
    if not classes:
        raise ValueError(f"no transformers model class for {type(config).__name__}")
    kwargs = {"dtype": dtype} if dtype is not None else {}
    first: Exception | None = None
    with device:
        for cls in classes:
            own = _config_for(cls, config)
            configs = [own]
            if cls.__name__.endswith(("ForCausalLM", "LMHeadModel", "WithLMHead")) and (
                getattr(own, "is_decoder", None) is False
                and not getattr(own, "is_encoder_decoder", False)
            ):
                decoder = copy.deepcopy(own)
                decoder.is_decoder = True
                configs.append(decoder)
            error: Exception | None = None
            for candidate in configs:
                try:
                    return cls._from_config(candidate, **kwargs)  # type: ignore[attr-defined,no-any-return]
                except Exception as exc:  # noqa: BLE001 - the next class may build
                    error = exc
            first = first or error
    assert first is not None
    raise first


def from_pretrained(spec: str, config: Any) -> nn.Module:
    """The transformers model of the directory ``spec`` with its weights, in float32: the first
    class of :func:`model_classes`, from its safetensors (never remote code)."""
    import transformers  # lazy: an optional dependency

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    classes = model_classes(config)
    if not classes:
        raise ValueError(f"MODEL {spec!r}: transformers has no model class for its config")
    dtype_arg = "dtype" if _major_minor(transformers.__version__) >= (4, 56) else "torch_dtype"
    kwargs = {dtype_arg: torch.float32, "use_safetensors": True, "trust_remote_code": False}
    built: Any = classes[0]
    model: nn.Module = built.from_pretrained(spec, **kwargs)
    return model


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
