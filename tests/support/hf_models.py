"""Real architectures from their config classes at tiny sizes (no downloads), with inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def _transformers_major() -> int | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except PackageNotFoundError:
        return None


#: What these tests expect of the architectures is transformers 5's: DeepSeek-V3 declares its
#: router keep-in-fp32 (4.x declares nothing), and gpt-oss's attention accepts fp32 sinks with
#: bf16 activations (4.x's does not).
requires_transformers_5 = pytest.mark.skipif(
    (_transformers_major() or 5) < 5, reason="expects transformers 5's declarations and models"
)


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], dict[str, Any]]
    dtype: torch.dtype  # compute dtype at which the library keeps something
    kept: tuple[str, ...]  # substrings of FQNs expected to be kept in fp32


def tiny_llama(vocab: int, dtype: torch.dtype = fp32, **config: int) -> nn.Module:
    """A 2-layer Llama (hidden 32 unless ``config`` says otherwise) seeded with 0, in ``dtype``."""
    import transformers

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, **config}  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, **sizes))
    return model.to(dtype)


def _ids(g: torch.Generator, vocab: int = 96, shape: tuple[int, int] = (2, 8)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=g)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=96,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


def deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    return DeepseekV3ForCausalLM(cfg)


def gpt_oss() -> nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    return GptOssForCausalLM(cfg)


def rwkv() -> nn.Module:
    from transformers import RwkvConfig, RwkvForCausalLM

    cfg = RwkvConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        attention_hidden_size=32,
        intermediate_size=64,
        context_length=16,
    )
    return RwkvForCausalLM(cfg)


def afmoe() -> nn.Module:
    from transformers import AfmoeConfig, AfmoeForCausalLM

    cfg = AfmoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_dense_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        max_position_embeddings=64,
    )
    return AfmoeForCausalLM(cfg)


def lm_inputs(g: torch.Generator) -> dict[str, Any]:
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids}


def t5_inputs(g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _ids(g), "labels": _ids(g, shape=(2, 6))}


def wan_block() -> nn.Module:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    return WanTransformerBlock(
        dim=32,
        ffn_dim=64,
        num_heads=4,
        qk_norm="rms_norm_across_heads",
        cross_attn_norm=True,
        eps=1e-6,
    )


def wan_inputs(g: torch.Generator) -> dict[str, Any]:
    seq, dim = 6, 32
    freqs = torch.randn(1, seq, 1, 4, generator=g)  # (cos, sin) halves of head_dim 8
    return {
        "hidden_states": torch.randn(2, seq, dim, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, dim, generator=g),
        "temb": torch.randn(2, 6, dim, generator=g),
        "rotary_emb": (freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)),
    }


def wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )


#: LTX-2.3's shape of LTX2VideoTransformer3DModel (diffusers' transformer_ltx2.py): gated
#: attention and prompt modulation on both modalities, no caption projection (2.3 projects per
#: modality in its connector). ``ltx23(full=True)``: the released sizes (video 32 x 128, audio
#: 32 x 64, one layer), for the opt-in slow tier.
LTX23 = {
    "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True,
    "audio_cross_attn_mod": True, "use_prompt_embeddings": False, "patch_size": 1,
    "patch_size_t": 1, "qk_norm": "rms_norm_across_heads", "rope_double_precision": False,
}  # fmt: skip
LTX23_TINY = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
    "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
    "audio_num_attention_heads": 2, "audio_attention_head_dim": 4,
    "audio_cross_attention_dim": 8, "num_layers": 2, "caption_channels": 16,
}  # fmt: skip
LTX23_FULL = {
    "in_channels": 128, "out_channels": 128, "num_attention_heads": 32,
    "attention_head_dim": 128, "cross_attention_dim": 4096, "audio_in_channels": 128,
    "audio_out_channels": 128, "audio_num_attention_heads": 32, "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048, "num_layers": 1, "caption_channels": 3840,
}  # fmt: skip


def ltx23(full: bool = False) -> nn.Module:
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(**LTX23, **(LTX23_FULL if full else LTX23_TINY))


def ltx23_inputs(model: nn.Module, g: torch.Generator) -> dict[str, Any]:
    """Video (2 frames of 4 x 4 latents), audio (9 frames) and 6 prompt tokens per modality."""
    config: Any = model.config  # type: ignore[union-attr]
    frames, height, width, prompt = 2, 4, 4, 6
    video_dim = config.num_attention_heads * config.attention_head_dim
    audio_dim = config.audio_num_attention_heads * config.audio_attention_head_dim
    return {
        "hidden_states": torch.randn(1, frames * height * width, config.in_channels, generator=g),
        "audio_hidden_states": torch.randn(1, 9, config.audio_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, prompt, video_dim, generator=g),
        "audio_encoder_hidden_states": torch.randn(1, prompt, audio_dim, generator=g),
        "timestep": torch.rand(1, generator=g) * 1000,
        "sigma": torch.rand(1, generator=g),
        "encoder_attention_mask": torch.ones(1, prompt, dtype=torch.bool),
        "num_frames": frames, "height": height, "width": width, "audio_num_frames": 9,
        "fps": 25.0, "return_dict": False,
    }  # fmt: skip


def wan_model_inputs(g: torch.Generator) -> dict[str, Any]:
    return {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=g),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
        "return_dict": False,
    }


def wan_model() -> Arch:
    return Arch("wan", wan, wan_model_inputs, bf16, ("scale_shift_table", "time_embedder", "norm2"))


ARCHS = {
    "t5": Arch("t5", t5, t5_inputs, fp16, (".wo.",)),
    "deepseek_v3": Arch("deepseek_v3", deepseek_v3, lm_inputs, bf16, ("mlp.gate.weight",)),
    "gpt_oss": Arch("gpt_oss", gpt_oss, lm_inputs, fp16, ("layernorm.weight", "model.norm.weight")),
    "rwkv": Arch("rwkv", rwkv, lm_inputs, fp16, ("time_decay", "time_first")),
    "afmoe": Arch("afmoe", afmoe, lm_inputs, fp16, ("norm.weight", "expert_bias")),
}


def tiny_qwen3_moe(dtype: torch.dtype = fp32, seed: int = 0, **overrides: Any) -> nn.Module:
    """A Qwen3-MoE at a tiny size (fused experts in transformers 5), seeded, built in ``dtype``
    as ``from_pretrained(dtype=...)`` builds it (fp32 rotary frequencies whatever the dtype)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **{
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "max_position_embeddings": 64, **overrides,
        }
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)
