# mypy: disable-error-code="call-arg,arg-type,no-untyped-call,return-value"
# (transformers 5 types each config's own __init__ but not the PretrainedConfig kwargs it
# forwards, such as num_labels; Diffusers model constructors are untyped)
"""The architecture screen's models: real transformers/diffusers classes at tiny sizes, as data.

Each :class:`ScreenArch` builds one architecture from its config class (no downloads, fp32
parameters as ``from_config`` leaves them), one deterministic batch and its loss. ``rules`` are
the precision rules the screen passes for models with no keep declaration of their own at bf16
(a rule that matches nothing is an error, so each names what exists in that model); models that
declare ``_keep_in_fp32_modules_strict`` (DeepSeek-V3's router) or Diffusers
``_keep_in_fp32_modules`` (Wan) keep their own. Multimodal batches feed images through the
model: ``input_ids`` hold exactly the number of image tokens the vision side produces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision import DistributedConfig, Glob, ModuleClass

from tests.support.hf_models import deepseek_v3  # the tiny DeepSeek-V3 the HF parity tests use

__all__ = [
    "ARCHS",
    "LR",
    "STEPS",
    "ScreenArch",
    "batch_of",
    "build",
    "threshold",
    "train_unwrapped",
]

VOCAB = 96
IMAGE_TOKEN = 95  # the last id of VOCAB: an image placeholder in multimodal input_ids
Batch = dict[str, Any]


@dataclass(frozen=True)
class ScreenArch:
    """One architecture of the screen.

    Attributes:
        name: Case name (an identifier).
        build: Builds the model in fp32 (call under a fixed seed: see :func:`build`).
        batch: One batch from a seeded generator (same generator, same batch).
        loss: The training loss of the model on a batch.
        rules: Precision rules for models without their own keep declarations. (Default: ``()``)
        note: The tiny config in words. (Default: ``""``)
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    rules: tuple[Glob | ModuleClass, ...] = ()
    note: str = ""


def build(arch: ScreenArch, seed: int = 0) -> nn.Module:
    """``arch``'s model, identical on every rank (fixed seed), in train mode."""
    import transformers

    transformers.logging.set_verbosity_error()  # tiny vocabularies: token-id range warnings
    torch.manual_seed(seed)
    model = arch.build()
    return model.train()


def batch_of(arch: ScreenArch, step: int, rank: int = 0) -> Batch:
    """``arch``'s batch for ``step`` on ``rank`` (deterministic; ranks see different data)."""
    return arch.batch(torch.Generator().manual_seed(1000 + 100 * rank + step))


STEPS = 2
LR = 1e-3


def threshold(model: nn.Module, fraction: float | None) -> int:
    """``fsdp_auto_wrap_min_params`` for ``fraction`` of ``model``'s parameters."""
    if fraction is None:
        return int(DistributedConfig().fsdp_auto_wrap_min_params)
    return int(sum(p.numel() for p in model.parameters()) * fraction)


def train_unwrapped(arch: ScreenArch, rank: int) -> tuple[list[float], set[str]]:
    """Losses of ``STEPS`` fp32 AdamW steps of the unwrapped model, and the FQNs that changed."""
    model = build(arch)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = arch.loss(model, batch_of(arch, step, rank))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    changed = {k for k, p in model.named_parameters() if not torch.equal(p.detach(), before[k])}
    return losses, changed


# ------------------------------------------------------------------ losses and inputs


def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The ``loss`` the Hugging Face model computes from the batch's labels."""
    return model(**batch).loss  # type: ignore[no-any-return]


def sample_mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean square of a Diffusers model's ``sample`` (a denoising loss against zero)."""
    return model(**batch).sample.float().pow(2).mean()  # type: ignore[no-any-return]


def _ids(
    g: torch.Generator, shape: tuple[int, int] = (2, 8), high: int = VOCAB - 1
) -> torch.Tensor:
    return torch.randint(3, high, shape, generator=g)


def lm_batch(g: torch.Generator) -> Batch:
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids}


def seq2seq_batch(g: torch.Generator) -> Batch:
    return {"input_ids": _ids(g), "labels": _ids(g, (2, 6))}


def mlm_batch(g: torch.Generator) -> Batch:
    ids = _ids(g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def image_batch(size: int = 16, classes: int = 4) -> Callable[[torch.Generator], Batch]:
    def make(g: torch.Generator) -> Batch:
        return {
            "pixel_values": torch.randn(2, 3, size, size, generator=g),
            "labels": torch.randint(0, classes, (2,), generator=g),
        }

    return make


def image_ids(
    g: torch.Generator, n_image: int, n_text: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` of ``n_image`` image tokens then ``n_text`` text tokens, and labels (text)."""
    text = _ids(g, (2, n_text), high=IMAGE_TOKEN)
    ids = torch.cat([torch.full((2, n_image), IMAGE_TOKEN), text], dim=1)
    labels = ids.clone()
    labels[:, :n_image] = -100
    return ids, labels


# ------------------------------------------------------------------ causal LMs

_DEC = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_DEC))


def _llama_text(**extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**_DEC, "pad_token_id": 0, **extra})


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_DEC))


def qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_DEC, head_dim=8))


def gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        **_DEC, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, tie_word_embeddings=False
    )
    return Gemma2ForCausalLM(cfg)


def phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**_DEC, pad_token_id=0))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return GPT2LMHeadModel(cfg)


def _opt_config(**extra: Any) -> Any:
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        pad_token_id=1,
        **extra,
    )


def opt() -> nn.Module:
    from transformers import OPTForCausalLM

    return OPTForCausalLM(_opt_config())


# ------------------------------------------------------------------ mixture of experts


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**_DEC, num_local_experts=4, num_experts_per_tok=2, head_dim=8)
    return MixtralForCausalLM(cfg)


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **_DEC, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    )
    return Qwen3MoeForCausalLM(cfg)


# ------------------------------------------------------------------ encoder-decoder


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
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


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return BartForConditionalGeneration(cfg)


def whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=8,
        max_target_positions=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    return WhisperForConditionalGeneration(cfg)


def whisper_batch(g: torch.Generator) -> Batch:
    # the encoder's two convolutions halve 16 frames to max_source_positions=8
    return {"input_features": torch.randn(2, 8, 16, generator=g), "labels": _ids(g, (2, 6))}


# ------------------------------------------------------------------ encoders


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return BertForMaskedLM(cfg)


def deberta_v2() -> nn.Module:
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    cfg = DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
    )
    return DebertaV2ForMaskedLM(cfg)


# ------------------------------------------------------------------ vision


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=4,
    )
    return ViTForImageClassification(cfg)


def convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(
        num_channels=3,
        patch_size=2,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_labels=4,
    )
    return ConvNextForImageClassification(cfg)


# ------------------------------------------------------------------ dual encoders

_TEXT_TOWER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
}
_VISION_TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "image_size": 16,
    "patch_size": 8,
}


def clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config={**_TEXT_TOWER, "eos_token_id": 2},
        vision_config=_VISION_TOWER,
        projection_dim=16,
    )
    return CLIPModel(cfg)


def siglip() -> nn.Module:
    from transformers import SiglipConfig, SiglipModel

    return SiglipModel(SiglipConfig(text_config=_TEXT_TOWER, vision_config=_VISION_TOWER))


def pair_batch(g: torch.Generator) -> Batch:
    return {
        "input_ids": _ids(g),
        "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
        "return_loss": True,
    }


# ------------------------------------------------------------------ vision-language


def llava() -> nn.Module:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**_VISION_TOWER),
        text_config=_llama_text(),
        image_token_index=IMAGE_TOKEN,
        image_seq_length=4,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration(cfg)


def llava_batch(g: torch.Generator) -> Batch:
    # 16x16 pixels in 8x8 patches: 4 patch features (the CLS one is dropped)
    ids, labels = image_ids(g, 4)
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
        "labels": labels,
    }


def blip2_opt() -> nn.Module:
    from transformers import Blip2Config, Blip2ForConditionalGeneration

    cfg = Blip2Config(
        vision_config={**_VISION_TOWER, "image_size": 16, "patch_size": 8},
        qformer_config={
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "encoder_hidden_size": 32,
            "cross_attention_frequency": 1,
            "max_position_embeddings": 32,
        },
        text_config=_opt_config().to_dict(),
        num_query_tokens=4,
        image_token_index=IMAGE_TOKEN,
    )
    return Blip2ForConditionalGeneration(cfg)


def qwen2_vl() -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config={
            **_DEC,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2]},
            "pad_token_id": 0,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=94,
        vision_start_token_id=93,
        vision_end_token_id=92,
    )
    return Qwen2VLForConditionalGeneration(cfg)


def qwen2_vl_batch(g: torch.Generator) -> Batch:
    # one 16x16 image per sample: a 1x4x4 grid of 4x4 patches, merged 2x2 into 4 tokens
    ids, labels = image_ids(g, 4)
    patch = 3 * 2 * 4 * 4  # channels x temporal_patch_size x patch_size^2
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(2 * 16, patch, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),  # 1 marks an image token
        "labels": labels,
    }


def smolvlm() -> nn.Module:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    cfg = SmolVLMConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
        text_config=_llama_text().to_dict(),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    return SmolVLMForConditionalGeneration(cfg)


def smolvlm_batch(g: torch.Generator) -> Batch:
    # one 32x32 image: 4x4 patches of 8x8, pixel-shuffled by scale_factor 2 into 4 tokens
    ids, labels = image_ids(g, 4)
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(2, 1, 3, 32, 32, generator=g),
        "labels": labels,
    }


def blip2_batch(g: torch.Generator) -> Batch:
    ids, labels = image_ids(g, 4)
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
        "labels": labels,
    }


# ------------------------------------------------------------------ state-space models


def mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=4,
        num_hidden_layers=2,
        conv_kernel=4,
        tie_word_embeddings=False,
    )
    return MambaForCausalLM(cfg)


def mamba2() -> nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=8,
        expand=2,
        n_groups=1,
        chunk_size=4,
        conv_kernel=4,
    )
    return Mamba2ForCausalLM(cfg)


# ------------------------------------------------------------------ diffusers transformers


def flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    )


def flux_batch(g: torch.Generator) -> Batch:
    img = torch.zeros(16, 3)
    img[:, 1] = torch.arange(16) // 4
    img[:, 2] = torch.arange(16) % 4
    return {
        "hidden_states": torch.randn(2, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
        "pooled_projections": torch.randn(2, 16, generator=g),
        "timestep": torch.tensor([0.5, 0.25]),
        "img_ids": img,
        "txt_ids": torch.zeros(5, 3),
    }


def sd3() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=8,
    )


def sd3_batch(g: torch.Generator) -> Batch:
    return {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
        "pooled_projections": torch.randn(2, 16, generator=g),
        "timestep": torch.tensor([10, 500]),
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


def wan_batch(g: torch.Generator) -> Batch:
    return {
        "hidden_states": torch.randn(2, 4, 2, 4, 4, generator=g),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
    }


# ------------------------------------------------------------------ the table

_LN = ModuleClass(nn.LayerNorm)
_QK_NORMS = (Glob("*.norm_q.weight"), Glob("*.norm_k.weight"))

_TABLE = [
    ScreenArch("llama", llama, lm_batch, hf_loss, (), "h32 ff64 2L 4/2 heads"),
    ScreenArch("qwen2", qwen2, lm_batch, hf_loss, (), "h32 ff64 2L 4/2 heads"),
    ScreenArch("qwen3", qwen3, lm_batch, hf_loss, (), "h32 2L head_dim 8, q/k norms"),
    ScreenArch("gemma2", gemma2, lm_batch, hf_loss, (), "h32 2L head_dim 8, sliding 4, untied"),
    ScreenArch("phi3", phi3, lm_batch, hf_loss, (), "h32 ff64 2L fused qkv"),
    ScreenArch("gpt2", gpt2, lm_batch, hf_loss, (_LN,), "n_embd 32, 2L, tied wte/lm_head"),
    ScreenArch("opt", opt, lm_batch, hf_loss, (_LN,), "h32 ffn64 2L, tied"),
    ScreenArch("mixtral", mixtral, lm_batch, hf_loss, (), "h32 2L 4 experts top2"),
    ScreenArch(
        "qwen3_moe",
        qwen3_moe,
        lm_batch,
        hf_loss,
        (),
        "h32 2L 4 experts top2 moe_ff16",
    ),
    ScreenArch(
        "deepseek_v3", deepseek_v3, lm_batch, hf_loss, (), "h32 2L (1 dense), 4 experts, MLA"
    ),
    ScreenArch("t5", t5, seq2seq_batch, hf_loss, (Glob("*.wo.weight"),), "d32 ff64 2+2L, tied"),
    ScreenArch("bart", bart, seq2seq_batch, hf_loss, (_LN,), "d32 ff64 1+1L, tied"),
    ScreenArch("whisper", whisper, whisper_batch, hf_loss, (_LN,), "d32 1+1L, 8 mels x 16"),
    ScreenArch("bert", bert, mlm_batch, hf_loss, (_LN,), "h32 ff64 2L MLM, tied"),
    ScreenArch("deberta_v2", deberta_v2, mlm_batch, hf_loss, (_LN,), "h32 2L rel-attn MLM"),
    ScreenArch("vit", vit, image_batch(16), hf_loss, (_LN,), "h32 2L, 16px / 4px patches"),
    ScreenArch(
        "convnext",
        convnext,
        image_batch(16),
        hf_loss,
        (_LN,),
        "2 stages 16/32 ch, depth 1+1",
    ),
    ScreenArch("clip", clip, pair_batch, hf_loss, (_LN,), "1L text + 1L vision h32, proj 16"),
    ScreenArch("siglip", siglip, pair_batch, hf_loss, (_LN,), "1L text + 1L vision h32"),
    ScreenArch(
        "llava",
        llava,
        llava_batch,
        hf_loss,
        (_LN,),
        "CLIP vision 1L h32 16px/8 + Llama h32 2L, 4 image tokens",
    ),
    ScreenArch(
        "blip2_opt",
        blip2_opt,
        blip2_batch,
        hf_loss,
        (Glob("vision_model.*layer_norm*"),),  # the Q-Former casts to its LayerNorm's dtype
        "vision 1L + Q-Former 1L, 4 queries + OPT h32 2L (tied)",
    ),
    ScreenArch(
        "qwen2_vl",
        qwen2_vl,
        qwen2_vl_batch,
        hf_loss,
        (_LN,),
        "vision depth 1 d32 + text h32 2L, mrope, 4 image tokens",
    ),
    ScreenArch(
        "smolvlm",
        smolvlm,
        smolvlm_batch,
        hf_loss,
        (_LN,),
        "vision 1L h32 32px/8 + Llama h32 2L, scale 2, 4 image tokens",
    ),
    ScreenArch(
        "mamba", mamba, lm_batch, hf_loss, (Glob("*.A_log"), Glob("*.D")), "h32 2L state 4, untied"
    ),
    ScreenArch(
        "mamba2",
        mamba2,
        lm_batch,
        hf_loss,
        (Glob("*.A_log"), Glob("*.dt_bias")),
        "h32 2L 8 heads x 8, chunk 4",
    ),
    ScreenArch("flux", flux, flux_batch, sample_mse, _QK_NORMS, "1 double + 1 single block"),
    ScreenArch("sd3", sd3, sd3_batch, sample_mse, (), "1 joint block, 8x8 latents"),
    ScreenArch("wan", wan, wan_batch, sample_mse, (), "2 blocks, 2x4x4 latents"),
]

ARCHS: dict[str, ScreenArch] = {arch.name: arch for arch in _TABLE}
