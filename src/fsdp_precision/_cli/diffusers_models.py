"""Diffusers model directories as ``MODEL`` of ``plan`` and ``verify``: a ``config.json`` with
``_class_name`` (what ``ModelMixin.save_pretrained`` writes).

The class named there is built from the config (no weights are read): on meta for ``plan``, at a
tiny size (:func:`~fsdp_precision.testing._tiny_diffusers.tiny_diffusers_config`) on the CPU for
the traced first forward and for ``verify``. Forward inputs come from a table of builders per
class family (:data:`INPUTS`), made from the model's config and a generator only, so every rank
gets the same ones.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._base.quiet import quiet_imports
from fsdp_precision.testing._tiny_diffusers import tiny_diffusers_config

__all__ = ["INPUTS", "DiffusersConfig", "build", "diffusers_config", "inputs_source"]

_INSTALL = "pip install 'fsdp-precision[hf]'"
#: Batch and text tokens of every builder's inputs.
BATCH, TEXT = 2, 5


@dataclass(frozen=True)
class DiffusersConfig:
    """A Diffusers model directory's config.

    Attributes:
        spec: The ``MODEL`` argument, for messages.
        class_name: ``_class_name`` of its config.json (``"WanTransformer3DModel"``).
        config: The config.json's contents.
    """

    spec: str
    class_name: str
    config: dict[str, Any]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not this module's to report: the transformers reader says why


def diffusers_config(spec: str) -> DiffusersConfig | None:
    """The config of ``spec`` when it is a Diffusers model directory, else ``None`` (a
    transformers directory, or a file the transformers reader reports on). Raises
    ``ValueError`` for a Diffusers pipeline directory (``model_index.json``, no config.json)."""
    path = Path(spec)
    data = _read_json(path / "config.json")
    if data is None and (path / "model_index.json").is_file():
        subfolders = sorted(p.name for p in path.iterdir() if (p / "config.json").is_file())
        raise ValueError(
            f"MODEL {spec!r} is a Diffusers pipeline (model_index.json), not a model; pass one "
            f"of its model subfolders: {', '.join(subfolders) or 'none has a config.json'}"
        )
    if not isinstance(data, dict) or not isinstance(data.get("_class_name"), str):
        return None
    return DiffusersConfig(spec, data["_class_name"], data)


def model_class(config: DiffusersConfig) -> type[Any]:
    """The Diffusers model class ``config`` names; ``ValueError`` naming the fix when diffusers
    is missing, lacks the class, or the class is not a model."""
    try:
        import diffusers  # lazy: an optional dependency
    except ImportError as exc:
        raise ValueError(
            f"MODEL {config.spec!r} is a Diffusers model directory (_class_name "
            f"{config.class_name!r}), which needs diffusers, not installed; {_INSTALL}"
        ) from exc
    with quiet_imports():  # a model class imports torchao: its import-time noise
        cls = getattr(diffusers, config.class_name, None)
    if cls is None:
        raise ValueError(
            f"MODEL {config.spec!r}: diffusers {diffusers.__version__} has no class "
            f"{config.class_name!r} (config.json's _class_name); fix _class_name, or install a "
            "diffusers release that has it (pip install -U diffusers)"
        )
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise ValueError(
            f"MODEL {config.spec!r}: {config.class_name!r} (config.json's _class_name) is not "
            "a Diffusers model (ModelMixin); pass the directory of a model, such as a "
            "pipeline's transformer/ or unet/ subfolder"
        )
    return cls


def build(
    config: DiffusersConfig, device: torch.device, *, tiny: bool, dtype: torch.dtype | None
) -> nn.Module:
    """The model ``config`` names, built from its config (shrunk when ``tiny``) under
    ``device``, in ``dtype`` when given (Diffusers builds in fp32)."""
    cls = model_class(config)
    data = config.config
    if tiny:  # shrink the class's defaults too: a config.json may leave some out
        defaults = {
            k: p.default
            for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not p.empty
        }
        data = tiny_diffusers_config(config.class_name, {**defaults, **data})
    with device:
        model = cls.from_config(data)
    if dtype is not None and any(p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)  # Diffusers builds in fp32; only a change warns
    return model  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- inputs

#: Builds forward keyword arguments from a model's config and a generator.
Builder = Callable[[Mapping[str, Any], torch.Generator], dict[str, Any]]


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _timestep(g: torch.Generator, scale: float = 1000.0) -> torch.Tensor:
    return torch.rand(BATCH, generator=g) * scale


def _pair(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


def _wan(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    pt, ph, pw = c["patch_size"]  # 2 latent frames of 2 x 2 patches
    out = {
        "hidden_states": _randn(g, BATCH, c["in_channels"], 2 * pt, 2 * ph, 2 * pw),
        "timestep": _timestep(g),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, c["text_dim"]),
        "return_dict": False,
    }
    if c.get("image_dim"):  # image-to-video: CLIP image tokens
        out["encoder_hidden_states_image"] = _randn(g, BATCH, 4, c["image_dim"])
    return out


def _grid_ids(h: int, w: int) -> torch.Tensor:
    """Flux's and its kin's position ids of an ``h x w`` token grid: (0, row, column)."""
    ids = torch.zeros(h * w, 3)
    ids[:, 1] = torch.arange(h).repeat_interleave(w)
    ids[:, 2] = torch.arange(w).repeat(h)
    return ids


def _flux(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    out = {
        "hidden_states": _randn(g, BATCH, 4, c["in_channels"]),  # 2 x 2 packed latent tokens
        "encoder_hidden_states": _randn(g, BATCH, TEXT, c["joint_attention_dim"]),
        "pooled_projections": _randn(g, BATCH, c["pooled_projection_dim"]),
        "timestep": _timestep(g, 1.0),  # the model multiplies by 1000
        "img_ids": _grid_ids(2, 2),
        "txt_ids": torch.zeros(TEXT, 3),
        "return_dict": False,
    }
    if c.get("guidance_embeds"):
        out["guidance"] = torch.full((BATCH,), 3.5)
    return out


def _sd3(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    side = 2 * c["patch_size"]  # 2 x 2 patches
    return {
        "hidden_states": _randn(g, BATCH, c["in_channels"], side, side),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, c["joint_attention_dim"]),
        "pooled_projections": _randn(g, BATCH, c["pooled_projection_dim"]),
        "timestep": _timestep(g),
        "return_dict": False,
    }


def _hunyuan_video(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    pt, p = c["patch_size_t"], c["patch_size"]
    out = {
        "hidden_states": _randn(g, BATCH, c["in_channels"], 2 * pt, 2 * p, 2 * p),
        "timestep": _timestep(g),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, c["text_embed_dim"]),
        "encoder_attention_mask": torch.ones(BATCH, TEXT, dtype=torch.bool),
        "pooled_projections": _randn(g, BATCH, c["pooled_projection_dim"]),
        "return_dict": False,
    }
    if c.get("guidance_embeds"):
        out["guidance"] = torch.full((BATCH,), 6000.0)  # the pipeline's scale x 1000
    return out


def _ltx_video(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    frames, side = 2, 2  # tokens after patching
    return {
        "hidden_states": _randn(g, BATCH, frames * side * side, c["in_channels"]),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, c["caption_channels"]),
        "timestep": _timestep(g),
        "encoder_attention_mask": torch.ones(BATCH, TEXT, dtype=torch.bool),
        "num_frames": frames,
        "height": side,
        "width": side,
        "return_dict": False,
    }


def _ltx2_video(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    video, audio = _ltx_video(c, g), 9  # audio frames
    prompted = c.get("use_prompt_embeddings", True)  # LTX-2.0; 2.3 projects in its connector
    audio_width = c["audio_num_attention_heads"] * c["audio_attention_head_dim"]
    video_width = c["num_attention_heads"] * c["attention_head_dim"]
    return {
        **video,
        "encoder_hidden_states": _randn(
            g, BATCH, TEXT, c["caption_channels"] if prompted else video_width
        ),
        "audio_hidden_states": _randn(g, BATCH, audio, c["audio_in_channels"]),
        "audio_encoder_hidden_states": _randn(
            g, BATCH, TEXT, c["caption_channels"] if prompted else audio_width
        ),
        "sigma": torch.rand(BATCH, generator=g),
        "audio_num_frames": audio,
        "fps": 25.0,
    }


def _cogvideox(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    # the sample size the config was made for (learned position embeddings need it)
    frames = (c["sample_frames"] - 1) // c["temporal_compression_ratio"] + 1
    pt = c.get("patch_size_t") or 1
    frames += -frames % pt
    out = {
        "hidden_states": _randn(
            g, BATCH, frames, c["in_channels"], c["sample_height"], c["sample_width"]
        ),
        "encoder_hidden_states": _randn(g, BATCH, c["max_text_seq_length"], c["text_embed_dim"]),
        "timestep": _timestep(g),
        "return_dict": False,
    }
    if c.get("ofs_embed_dim"):
        out["ofs"] = torch.full((BATCH,), 2.0)
    return out


def _qwenimage(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    out = {
        "hidden_states": _randn(g, BATCH, 4, c["in_channels"]),  # 2 x 2 packed latent tokens
        "encoder_hidden_states": _randn(g, BATCH, TEXT, c["joint_attention_dim"]),
        "timestep": _timestep(g, 1.0),
        "img_shapes": [[(1, 2, 2)]] * BATCH,
        "return_dict": False,
    }
    if c.get("guidance_embeds"):
        out["guidance"] = torch.full((BATCH,), 4.0)
    if c.get("use_additional_t_cond"):
        out["additional_t_cond"] = torch.zeros(BATCH, dtype=torch.long)
    return out


def _unet_2d_condition(c: Mapping[str, Any], g: torch.Generator) -> dict[str, Any]:
    side = 2 ** len(c["block_out_channels"])  # halved at every level but the last, twice over
    text = c.get("encoder_hid_dim") or _pair(c["cross_attention_dim"])[0]
    out = {
        "sample": _randn(g, BATCH, c["in_channels"], side, side),
        "timestep": _timestep(g),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, text),
        "return_dict": False,
    }
    if c.get("addition_embed_type") == "text_time":  # SDXL: pooled text and 6 time ids
        pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
        out["added_cond_kwargs"] = {
            "text_embeds": _randn(g, BATCH, pooled),
            "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * BATCH),
        }
    return out


#: Diffusers model class -> its inputs' builder.
INPUTS: dict[str, Builder] = {
    "WanTransformer3DModel": _wan,
    "FluxTransformer2DModel": _flux,
    "SD3Transformer2DModel": _sd3,
    "HunyuanVideoTransformer3DModel": _hunyuan_video,
    "LTXVideoTransformer3DModel": _ltx_video,
    "LTX2VideoTransformer3DModel": _ltx2_video,
    "CogVideoXTransformer3DModel": _cogvideox,
    "QwenImageTransformer2DModel": _qwenimage,
    "UNet2DConditionModel": _unet_2d_condition,
}


def inputs_source(spec: str, model: nn.Module) -> Callable[[torch.Generator], dict[str, Any]]:
    """The maker of ``model``'s forward inputs from :data:`INPUTS` (by class, then by base
    class); ``ValueError`` naming the known classes and the way out when there is none."""
    for cls in type(model).__mro__:
        builder = INPUTS.get(cls.__name__)
        if builder is not None:
            config: Mapping[str, Any] = model.config  # type: ignore[assignment]
            return lambda g: builder(config, g)
    raise ValueError(
        f"MODEL {spec!r}: no input builder for the Diffusers class {type(model).__name__} "
        f"(known: {', '.join(INPUTS)}); wrap it in a module:callable factory whose model has "
        "example_inputs(generator) -> dict"
    )
