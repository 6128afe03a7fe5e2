"""The demo's models: a real transformers architecture when transformers is installed, the
built-in decoder otherwise, each with the precision rules that architecture can honour."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_precision._base.quiet import quiet_imports
from fsdp_precision._rules.rules import Glob
from fsdp_precision.testing._models import TinyConfig, TinyDecoder

__all__ = [
    "DemoModel",
    "demo_model",
    "micro_batch",
    "micro_batches_per_step",
    "transformers_available",
]

#: The architecture ``--model auto`` picks when transformers is installed.
DEFAULT_HF = "deepseek_v3"


def transformers_available() -> bool:
    """Whether Hugging Face transformers can be imported."""
    try:
        import transformers  # noqa: F401  # lazy: an optional dependency
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class DemoModel:
    """How the demo builds, feeds and keeps one model.

    Attributes:
        name: Shown in the header (``"DeepseekV3ForCausalLM (transformers 5.x)"``).
        build: Builds the model (fp32 master weights) on the current default device.
        rules: Precision rules, before the model's own keep-in-fp32 declarations.
        rules_note: Why these parameters are kept, shown under the plan.
        vocab: Token ids are drawn from ``range(vocab)``.
        seq: Tokens per sequence.
        loss: ``loss(model, tokens)``: the mean next-token cross-entropy of a batch.
    """

    name: str
    build: Callable[[], nn.Module]
    rules: tuple[Glob, ...]
    rules_note: str
    vocab: int
    seq: int
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _builtin_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model.loss(tokens)  # type: ignore[operator]
    return out


def _hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return out


def _builtin(dim: int, depth: int) -> DemoModel:
    cfg = TinyConfig(dim=dim, depth=depth)
    return DemoModel(
        name=f"TinyDecoder (built in) dim={dim} depth={depth} experts={cfg.experts}",
        build=lambda: TinyDecoder(cfg),
        rules=(Glob("*norm.weight"), Glob("*router.weight")),
        rules_note="norms and the MoE router compute in fp32 (their forwards read fp32 weights "
        "and return the activation dtype)",
        vocab=cfg.vocab,
        seq=cfg.seq,
        loss=_builtin_loss,
    )


def _deepseek_v3(dim: int, depth: int) -> DemoModel:
    with quiet_imports():  # the model class imports torchao: its import-time noise
        # lazy: an optional dependency
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    heads = 4
    config = DeepseekV3Config(
        vocab_size=256,
        hidden_size=dim,
        intermediate_size=2 * dim,
        moe_intermediate_size=dim // 2,
        num_hidden_layers=depth + 1,  # the first layer is dense, as in DeepSeek-V3
        first_k_dense_replace=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        q_lora_rank=dim // 2,
        kv_lora_rank=dim // 2,
        qk_rope_head_dim=dim // (2 * heads),
        qk_nope_head_dim=dim // (2 * heads),
        v_head_dim=dim // heads,
        max_position_embeddings=64,
        use_cache=False,
    )
    import transformers  # lazy: an optional dependency

    return DemoModel(
        name=f"DeepseekV3ForCausalLM (transformers {transformers.__version__}) hidden={dim} "
        f"layers={depth + 1} routed experts=4",
        build=lambda: DeepseekV3ForCausalLM(config),
        # transformers 5 declares it too (_keep_in_fp32_modules_strict); 4.x declares nothing.
        rules=(Glob("*.mlp.gate.weight"),),
        rules_note="the MoE router (mlp.gate.weight) computes in fp32: its forward casts its "
        "input to fp32 (and transformers 5 declares it keep-in-fp32); DeepSeek-V3's RMSNorm "
        "returns weight * x, so an fp32 norm weight would promote the activations: norms stay "
        "bf16 (see docs/rules.md)",
        vocab=256,
        seq=16,
        loss=_hf_loss,
    )


def demo_model(spec: str, *, dim: int, depth: int) -> DemoModel:
    """``auto`` | ``builtin`` | ``hf:deepseek_v3``; ``auto`` is DeepSeek-V3 when transformers is
    installed, the built-in decoder otherwise."""
    if spec == "auto":
        spec = f"hf:{DEFAULT_HF}" if transformers_available() else "builtin"
    if spec == "builtin":
        return _builtin(dim, depth)
    if spec == f"hf:{DEFAULT_HF}":
        if not transformers_available():
            raise ValueError(
                f"--model {spec} needs Hugging Face transformers, which is not installed; "
                "pip install 'fsdp-precision[hf]', or use --model builtin"
            )
        if dim % 8:
            raise ValueError(f"--dim must be a multiple of 8 for {spec}, got {dim}")
        return _deepseek_v3(dim, depth)
    raise ValueError(f"--model {spec!r} is not one of auto, builtin, hf:{DEFAULT_HF}")


def micro_batch(
    model: DemoModel, *, seed: int, step: int, index: int, device: torch.device
) -> torch.Tensor:
    """Micro-batch ``index`` of training step ``step``: the same tokens whichever rank (and
    whatever world size) processes it. Each sequence counts from a random start in a random
    stride (mod the vocabulary); the global batch cycles through four, so that a few steps
    visibly lower the loss."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + (step % 4) * 1009 + index)
    rows = 4
    start = torch.randint(0, model.vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(model.seq + 1)) % model.vocab
    return tokens.to(device)


def micro_batches_per_step(*world_sizes: int) -> int:
    """The global batch in micro-batches: divisible by every world size the run uses."""
    return math.lcm(*world_sizes)
