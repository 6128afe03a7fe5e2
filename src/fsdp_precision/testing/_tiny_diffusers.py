"""Shrink a Diffusers model config (the ``config.json`` that ``ModelMixin.save_pretrained``
writes) to a size that runs a training step on one CPU core in a second, keeping the
architecture: the same model class, block kinds, norms, embeddings and keep-in-fp32 declarations.
The Diffusers analogue of :func:`fsdp_precision.testing.tiny_config`; ``fsdp-precision plan`` and
``verify`` use it on a Diffusers model directory.

Data-driven: each size attribute has a tiny value (:data:`TINY_DIFFUSERS_SIZES`, overridden per
model class in :data:`CLASS_SIZES`); the constraints the classes place between attributes are
kept by rules that read the original config, not the class:

* an attribute equal to the attention width (heads x head_dim: SD3's ``caption_projection_dim``,
  LTX-Video's ``cross_attention_dim``) stays equal to the new width;
* a list of rotary axis widths that sums to the head dimension (Flux's and QwenImage's
  ``axes_dims_rope``, HunyuanVideo's ``rope_axes_dim``) is re-split over the new head dimension,
  every axis even;
* layer-index lists (SD3.5's ``dual_attention_layers``) keep the indices below the new depth;
* UNet per-block lists (``block_out_channels``, ``attention_head_dim``, ...) shrink element by
  element, and ``norm_num_groups`` divides every new channel count;
* SDXL's ``projection_class_embeddings_input_dim`` stays 6 time embeddings plus the pooled text
  width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

__all__ = ["CLASS_SIZES", "TINY_DIFFUSERS_SIZES", "tiny_diffusers_config"]

#: Size attribute -> tiny value: set where the config has it as a positive integer (or a list of
#: them, element by element), and only ever shrinks (``min(original, tiny)``).
TINY_DIFFUSERS_SIZES: dict[str, int] = {
    # attention: width 16 = 2 heads x head_dim 8
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 4,
    # depth
    "num_layers": 2,
    "num_single_layers": 1,
    "num_refiner_layers": 1,
    "layers_per_block": 1,
    "transformer_layers_per_block": 1,
    # latent channels
    "in_channels": 4,
    "out_channels": 4,
    "audio_in_channels": 4,
    "audio_out_channels": 4,
    # conditioning and feed-forward widths
    "text_dim": 16,
    "text_embed_dim": 16,
    "joint_attention_dim": 16,
    "caption_channels": 16,
    "cross_attention_dim": 16,
    "audio_cross_attention_dim": 8,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 16,
    "image_dim": 16,
    "added_kv_proj_dim": 16,
    "freq_dim": 16,
    "time_embed_dim": 16,
    "ofs_embed_dim": 16,
    "ffn_dim": 32,
    "encoder_hid_dim": 16,
    "addition_time_embed_dim": 8,
    # positions and sample sizes (latent pixels)
    "rope_max_seq_len": 32,
    "pos_embed_seq_len": 8,
    "pos_embed_max_size": 16,
    "sample_size": 16,
    "sample_width": 8,
    "sample_height": 8,
    "sample_frames": 9,
    "max_text_seq_length": 8,
    # UNet blocks
    "block_out_channels": 8,
    "norm_num_groups": 4,
}

#: Per model class, attributes whose tiny value differs: a UNet's ``attention_head_dim`` is its
#: number of heads (diffusers' historical name), 2 heads of 4 channels.
CLASS_SIZES: dict[str, dict[str, int]] = {
    "UNet2DConditionModel": {"attention_head_dim": 2, "num_attention_heads": 2},
}

#: (heads, head_dim) attribute pairs whose product is an attention width.
_WIDTHS = (
    ("num_attention_heads", "attention_head_dim"),
    ("audio_num_attention_heads", "audio_attention_head_dim"),
)
_DEPTH = ("num_layers",)
_LAYER_INDICES = ("dual_attention_layers",)
#: SDXL: the added conditioning is 6 time ids, each embedded in ``addition_time_embed_dim``.
_TIME_IDS = 6


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _int_list(value: Any) -> TypeGuard[Sequence[int]]:
    return isinstance(value, (list, tuple)) and bool(value) and all(map(_positive_int, value))


def _shrunk(value: Any, tiny: int) -> Any:
    if _positive_int(value):
        return min(value, tiny)
    if _int_list(value):
        return [min(v, tiny) for v in value]
    return value


def _axes(head_dim: int, n: int) -> list[int]:
    """``n`` even rotary axis widths summing to ``head_dim``, the first taking the rest."""
    each = 2 * (head_dim // (2 * n))
    return [head_dim - each * (n - 1), *([each] * (n - 1))]


def tiny_diffusers_config(class_name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a Diffusers model ``config`` (``ModelMixin.config`` or a ``config.json``'s
    contents) for the model class ``class_name``, shrunk to a CPU-testable size (tens of
    thousands of parameters). Keys that are not size attributes, and private keys
    (``_class_name``, ``_diffusers_version``), are kept as they are, except
    ``_use_default_values`` (the keys ``ModelMixin.config`` says its class defaulted, which
    ``from_config`` would take from the class again). The input is not modified.
    """
    data = dict(config)
    # ModelMixin.config lists the keys its class defaulted; from_config would take those from
    # the class again, full size
    data.pop("_use_default_values", None)
    sizes = {**TINY_DIFFUSERS_SIZES, **CLASS_SIZES.get(class_name, {})}
    old_widths = {
        pair: config[pair[0]] * config[pair[1]]
        for pair in _WIDTHS
        if _positive_int(config.get(pair[0])) and _positive_int(config.get(pair[1]))
    }
    old_head_dim = config.get("attention_head_dim")
    for key, tiny in sizes.items():
        if key in data:
            data[key] = _shrunk(data[key], tiny)
    # an attention width stays the width (SD3's caption_projection_dim, LTX's cross_attention_dim)
    for (heads, head_dim), old in old_widths.items():
        new = data[heads] * data[head_dim]
        for key, value in config.items():
            if key not in (heads, head_dim) and _positive_int(value) and value == old:
                data[key] = new
    # rotary axes that split the head dimension are re-split over the new one
    if _positive_int(old_head_dim) and old_head_dim != data.get("attention_head_dim"):
        for key, value in config.items():
            if _int_list(value) and len(value) > 1 and sum(value) == old_head_dim:
                data[key] = _axes(data["attention_head_dim"], len(value))
    depth = next((data[k] for k in _DEPTH if _positive_int(data.get(k))), None)
    for key in _LAYER_INDICES:
        value = data.get(key)
        if depth is not None and isinstance(value, (list, tuple)):
            data[key] = [i for i in value if isinstance(i, int) and i < depth]
    _unet(data, config)
    return data


def _unet(data: dict[str, Any], config: Mapping[str, Any]) -> None:
    channels = data.get("block_out_channels")
    if _int_list(channels) and _positive_int(data.get("norm_num_groups")):
        data["norm_num_groups"] = math.gcd(data["norm_num_groups"], *channels)
    old_time, old_in = (
        config.get("addition_time_embed_dim"),
        config.get("projection_class_embeddings_input_dim"),
    )
    if _positive_int(old_time) and _positive_int(old_in) and old_in > _TIME_IDS * old_time:
        pooled = min(old_in - _TIME_IDS * old_time, TINY_DIFFUSERS_SIZES["pooled_projection_dim"])
        data["projection_class_embeddings_input_dim"] = (
            _TIME_IDS * data["addition_time_embed_dim"] + pooled
        )
