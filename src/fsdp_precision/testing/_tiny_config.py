"""Shrink a Hugging Face transformers config to a size that runs a step on one CPU core in
seconds, keeping the architecture (attention kind, MoE routing, keep-in-fp32 declarations).
Public through :mod:`fsdp_precision.testing`; ``fsdp-precision verify hf:...`` uses it."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

from fsdp_precision.testing._tiny_constraints import (
    apply_derived,
    code_defaults,
    depth_parts,
    hidden_widths,
    positive_int,
    reindex_layers,
    remap_feature_layers,
    repeat_patterns,
    rescale_mrope,
    select_layers,
    shrink_named,
)

__all__ = ["TINY_SIZES", "tiny_config"]

#: Size attribute -> tiny value. Each is set only where the config has it as a positive integer,
#: and only ever shrinks (``min(original, tiny)``). Attention: hidden 32 = 4 heads x head_dim 8.
TINY_SIZES: dict[str, int] = {
    # width
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "d_ff": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    # depth
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_encoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "n_layer": 2,
    "depth": 2,
    "depths": 1,  # per stage (Florence-2's DaViT, VibeVoice's tokenizer encoders)
    # attention
    "num_attention_heads": 4,
    "num_heads": 4,
    "mamba_n_heads": 4,
    "n_head": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "head_dim": 8,
    "d_kv": 8,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "sliding_window": 8,
    # multi-head latent attention (DeepSeek)
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    # mixture of experts
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    # sparse layers among the kept ones (Switch Transformers derives its step from the count;
    # NLLB-MoE makes every step-th layer sparse, none at a step over the depth)
    "num_sparse_encoder_layers": 1,
    "num_sparse_decoder_layers": 1,
    "encoder_sparse_step": 2,
    "decoder_sparse_step": 2,
    # linear attention (Qwen3-Next, ...)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    # vocabulary
    "vocab_size": 96,
    "decoder_vocab_size": 96,
    "vocab_size_per_layer_input": 96,  # Gemma 3n / 4 per-layer embeddings
    # layers that reuse another layer's key/value cache (Gemma 3n / 4): none at a tiny depth,
    # which keeps no layer to share from
    "num_kv_shared_layers": 0,
    # recurrent and convolutional widths (RecurrentGemma, VibeVoice)
    "lru_width": 32,
    "num_filters": 4,
    "base_channels": 32,  # Janus's VQ image tokenizer (group norms of 32)
    "latent_query_num": 4,  # Kosmos-2: the image's latent queries take as many tokens
}

_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_HEADS = ("num_attention_heads", "num_heads", "n_head")
#: Keyword arguments of transformers' base config class, not fields of the model's class.
_BASE_KEYS = {"per_layer_config"}
_DEPTH = ("num_hidden_layers", "num_layers", "n_layer")
_TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
)


def tiny_config(config: Any) -> Any:
    """A copy of a transformers ``config`` shrunk to a CPU-testable size (well under 2M params).

    Every size attribute in :data:`TINY_SIZES` that the config has is lowered to its tiny value;
    key/value heads stay equal to the query heads where they were (MLA, plain multi-head) and
    become 2 (or 1, for multi-query) otherwise. The layers kept are the first of each kind
    (``layer_types``, per-layer overrides: a hybrid model keeps an attention layer), and every
    per-layer list, layer-index list and ``per_layer_config`` follows them. Special token ids
    outside the tiny vocabulary are folded into it; ``use_cache`` is off. Relations the
    architectures validate are kept (:mod:`~fsdp_precision.testing._tiny_constraints`: derived
    head counts, rotary sections, widths one config takes from another). The config is rebuilt
    through its class (``from_dict``), so derived attributes (DeepSeek's ``head_dim``) and
    validation follow. Nested configs (``text_config``, T5Gemma's ``encoder``, ...) are shrunk
    the same way. The input is not modified.
    """
    data = copy.deepcopy(config.to_dict())
    _shrink(data, config, hidden_widths(data))
    return type(config).from_dict(data)


def _constructor_keys(cls: type) -> set[str] | None:
    if dataclasses.is_dataclass(cls):  # transformers 5.x configs
        return {f.name for f in dataclasses.fields(cls)}
    try:  # transformers 4.x: keyword arguments of __init__
        params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and len(params) <= 2:
        return None
    return set(params)


def _rederive(data: dict[str, Any], config: Any) -> None:
    """Attributes the class derives from others (DeepSeek's head_dim = qk_rope_head_dim) are
    dropped, and fields that default to ``"auto"`` (Mamba2's ``time_step_rank``, Bamba's
    ``mamba_d_head``) reset, so that rebuilding derives them from the shrunk values instead of
    keeping the full-size ones; attribute_map targets and private keys stay."""
    cls = type(config)
    keys = _constructor_keys(cls)
    if keys is not None:
        kept = keys | set((getattr(config, "attribute_map", None) or {}).values()) | _BASE_KEYS
        derived = set(cls().to_dict()) - kept
        for key in derived:
            if not key.startswith("_") and key != "model_type":
                data.pop(key, None)
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default == "auto" and f.name in data:
                data[f.name] = "auto"


def _shrink_sizes(data: dict[str, Any], aliases: dict[str, str], widths: set[int]) -> None:
    """:data:`TINY_SIZES` (through ``attribute_map`` ``aliases`` too), widths taken from
    another config, and key/value heads, in one config dict or one layer's overrides."""
    old_heads = next((data[k] for k in _HEADS if k in data), None)
    for key, tiny in TINY_SIZES.items():
        if positive_int(data.get(key)):
            data[key] = min(data[key], tiny)
    # attribute_map aliases (n_embd -> hidden_size, ...) live on the class, not in to_dict().
    for alias, target in aliases.items():
        if alias in TINY_SIZES and positive_int(data.get(target)):
            data[target] = min(data[target], TINY_SIZES[alias])
    shrink_named(data, TINY_SIZES, widths)
    heads: Any = next((data[k] for k in _HEADS if k in data), None)
    for key in _KV_HEADS:
        kv = data.get(key)
        if positive_int(kv) and positive_int(heads):
            if kv == old_heads:
                data[key] = heads
            else:
                data[key] = 1 if kv == 1 else min(2, heads)


def _shrink(data: dict[str, Any], config: Any, widths: set[int]) -> None:
    code_defaults(data, config)
    old = copy.deepcopy(data)  # relations are rescaled from the full-size values
    _rederive(data, config)
    aliases = dict(getattr(config, "attribute_map", None) or {})
    depth_key = next((k for k in _DEPTH if positive_int(data.get(k))), None)
    old_depth = data[depth_key] if depth_key else None
    parts = depth_parts(data)
    _shrink_sizes(data, aliases, widths)
    if depth_key and old_depth:
        if parts is not None:  # the parts say which layers are which: the first ones
            kept = list(range(min(parts, old_depth)))
        else:
            kept = select_layers(data, old_depth, data[depth_key])
        for key in _DEPTH:
            if old.get(key) == old_depth:
                data[key] = len(kept)
        if len(kept) != old_depth:
            reindex_layers(data, kept, old_depth)
        repeat_patterns(data, len(kept))
    for overrides in (data.get("per_layer_config") or {}).values():
        if isinstance(overrides, dict):
            _shrink_sizes(overrides, aliases, widths)
    apply_derived(data, old)
    rescale_mrope(data, old)
    vocab: Any = data.get("vocab_size")
    if positive_int(vocab):
        for key in [k for k in data if k in _TOKEN_IDS or str(k).endswith("_token_id")]:
            value = data.get(key)
            if isinstance(value, int) and value >= vocab:
                data[key] = value % vocab
            elif isinstance(value, list):
                data[key] = [v % vocab if isinstance(v, int) else v for v in value]
    if data.get("is_encoder_decoder") and data.get("decoder_start_token_id") is None:
        # AutoConfig.for_model("t5") has none (checkpoints' config.json do); the decoder
        # inputs are the labels shifted right behind it.
        data["decoder_start_token_id"] = data.get("pad_token_id") or 0
    for key in ("rope_parameters", "rope_scaling"):  # YaRN: keep factor = max / original
        rope, old_max = data.get(key), old.get("max_position_embeddings")
        if isinstance(rope, dict) and positive_int(rope.get("original_max_position_embeddings")):
            new_max = data.get("max_position_embeddings")
            if positive_int(old_max) and positive_int(new_max):
                scaled = rope["original_max_position_embeddings"] * new_max // old_max
                rope["original_max_position_embeddings"] = max(1, scaled)
    if "use_cache" in data:
        data["use_cache"] = False
    for key, value in data.items():  # nested configs: text_config, vision_config, encoder, ...
        # vars(): a heterogeneous config refuses to read per-layer attributes as globals
        sub = vars(config).get(key)
        if isinstance(value, dict) and hasattr(sub, "to_dict"):
            _shrink(value, sub, widths)
    vision = data.get("vision_config")
    if isinstance(vision, dict):
        depth = next((vision[k] for k in (*_DEPTH, "depth") if positive_int(vision.get(k))), None)
        if depth:
            remap_feature_layers(data, depth)


# --------------------------------------------------------------------------- loading
