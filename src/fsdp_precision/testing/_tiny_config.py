"""Shrink a Hugging Face transformers config to a size that runs a step on one CPU core in
seconds, keeping the architecture (attention kind, MoE routing, keep-in-fp32 declarations).
Public through :mod:`fsdp_precision.testing`; ``fsdp-precision verify hf:...`` uses it."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

__all__ = ["TINY_SIZES", "tiny_config"]

#: Size attribute -> tiny value. Each is set only where the config has it as a positive integer,
#: and only ever shrinks (``min(original, tiny)``). Attention: hidden 32 = 4 heads x head_dim 8.
TINY_SIZES: dict[str, int] = {
    # width
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
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
    # attention
    "num_attention_heads": 4,
    "num_heads": 4,
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
    # vocabulary
    # linear attention (Qwen3-Next, ...)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    # vocabulary
    "vocab_size": 96,
}

_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
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


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def tiny_config(config: Any) -> Any:
    """A copy of a transformers ``config`` shrunk to a CPU-testable size (well under 2M params).

    Every size attribute in :data:`TINY_SIZES` that the config has is lowered to its tiny value;
    key/value heads stay equal to the query heads where they were (MLA, plain multi-head) and
    become 2 (or 1, for multi-query) otherwise; per-layer lists (``layer_types``, ...) are
    truncated to the new depth, layer-index lists filtered; special token ids outside the tiny
    vocabulary are folded into it; ``use_cache`` is off. The config is rebuilt through its class
    (``from_dict``), so derived attributes (DeepSeek's ``head_dim``) and validation follow.
    Nested text/vision sub-configs are shrunk the same way. The input is not modified.
    """
    data = copy.deepcopy(config.to_dict())
    _shrink(data, config)
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


def _shrink(data: dict[str, Any], config: Any) -> None:
    # Attributes the class derives from others (DeepSeek's head_dim = qk_rope_head_dim) are
    # dropped, so that rebuilding derives them from the shrunk values instead of keeping the
    # full-size ones; attribute_map targets and private keys stay.
    keys = _constructor_keys(type(config))
    if keys is not None:
        kept = keys | set((getattr(config, "attribute_map", None) or {}).values())
        derived = set(type(config)().to_dict()) - kept
        for key in derived:
            if not key.startswith("_") and key != "model_type":
                data.pop(key, None)
    old_depth = next((data[k] for k in _DEPTH if _positive_int(data.get(k))), None)
    old_heads = next(
        (data[k] for k in ("num_attention_heads", "num_heads", "n_head") if k in data), None
    )
    for key, tiny in TINY_SIZES.items():
        if _positive_int(data.get(key)):
            data[key] = min(data[key], tiny)
    # attribute_map aliases (n_embd -> hidden_size, ...) live on the class, not in to_dict().
    for alias, target in (getattr(config, "attribute_map", None) or {}).items():
        if alias in TINY_SIZES and _positive_int(data.get(target)):
            data[target] = min(data[target], TINY_SIZES[alias])
    heads: Any = next(
        (data[k] for k in ("num_attention_heads", "num_heads", "n_head") if k in data), None
    )
    for key in _KV_HEADS:
        kv = data.get(key)
        if _positive_int(kv) and _positive_int(heads):
            if kv == old_heads:
                data[key] = heads
            else:
                data[key] = 1 if kv == 1 else min(2, heads)
    new_depth = next((data[k] for k in _DEPTH if _positive_int(data.get(k))), None)
    if old_depth and new_depth and new_depth != old_depth:
        for key, value in list(data.items()):
            if isinstance(value, list) and len(value) == old_depth:
                data[key] = value[:new_depth]
        for key in ("mlp_only_layers", "moe_layers"):
            value = data.get(key)
            if isinstance(value, list) and all(isinstance(i, int) for i in value):
                data[key] = [i for i in value if i < new_depth]
    vocab: Any = data.get("vocab_size")
    if _positive_int(vocab):
        for key in _TOKEN_IDS:
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
        rope, old_max = data.get(key), config.to_dict().get("max_position_embeddings")
        if isinstance(rope, dict) and _positive_int(rope.get("original_max_position_embeddings")):
            new_max = data.get("max_position_embeddings")
            if _positive_int(old_max) and _positive_int(new_max):
                scaled = rope["original_max_position_embeddings"] * new_max // old_max
                rope["original_max_position_embeddings"] = max(1, scaled)
    if "use_cache" in data:
        data["use_cache"] = False
    for key, value in data.items():  # composite models: text_config, vision_config, ...
        sub = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(sub, "to_dict") and key.endswith("_config"):
            _shrink(value, sub)


# --------------------------------------------------------------------------- loading
