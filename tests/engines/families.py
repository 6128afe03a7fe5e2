"""Real architectures at tiny sizes, trained the library's way and exported: what an RL trainer
hands vLLM. Built from transformers' config classes (no download), sized for vLLM's CPU build
(attention heads of 32), in fp32 master weights; wrapped with FSDP2 on one gloo process from a
compiled plan (the rules' boundary casts installed, as in training), then exported with the bulk
in bf16 and the kept tensors in fp32 (the record beside the weights).

``export_family`` runs in a process of its own (``fsdp_precision.testing.launch``): the trainer
is not the engine's process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fsdp_precision as fp

bf16, fp32 = torch.bfloat16, torch.float32
GATES, NORMS = fp.Glob("*.mlp.gate.weight"), fp.Glob("*norm.weight")
SIZE = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "max_position_embeddings": 128}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Family:
    """An architecture as the tests build it: its config, the rules training keeps with."""

    config: Callable[[], Any]
    rules: tuple[fp.Glob, ...]


def _config(kind: str, **extra: int) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        return getattr(transformers, kind)(**SIZE, **extra)

    return make


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        _config("Qwen3MoeConfig", intermediate_size=128, moe_intermediate_size=32, head_dim=32,
                num_key_value_heads=1, num_experts=8, num_experts_per_tok=2),
        (GATES,),
    ),
    "qwen2_moe": Family(
        _config("Qwen2MoeConfig", intermediate_size=128, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, num_key_value_heads=1, num_experts=8,
                num_experts_per_tok=2),
        (GATES,),
    ),
    "mixtral": Family(
        _config("MixtralConfig", intermediate_size=64, num_key_value_heads=1,
                num_local_experts=8, num_experts_per_tok=2),
        (GATES,),
    ),
    "olmoe": Family(
        _config("OlmoeConfig", intermediate_size=32, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2),
        (GATES,),
    ),
    "llama": Family(_config("LlamaConfig", intermediate_size=128, num_key_value_heads=1), (NORMS,)),
    "qwen3": Family(
        _config("Qwen3Config", intermediate_size=128, num_key_value_heads=1, head_dim=32),
        (NORMS,),
    ),
}  # fmt: skip

#: Not run through the plain causal-LM tests: a reward model is made from it (its norms kept).
POOLING: dict[str, Family] = {
    "qwen2": Family(_config("Qwen2Config", intermediate_size=128, num_key_value_heads=1), (NORMS,)),
}

#: An architecture the vLLM integration does not build (not in its ``ARCHITECTURES``).
UNCOVERED: dict[str, Family] = {
    "phi3": Family(
        _config("Phi3Config", intermediate_size=128, num_key_value_heads=1, pad_token_id=0),
        (NORMS,),
    ),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's model in fp32 (the trainer's master weights), seeded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family(name).config(), dtype=fp32)


def family(name: str) -> Family:
    """The family of that name, whichever table lists it."""
    return FAMILIES.get(name) or POOLING.get(name) or UNCOVERED[name]


def train_and_export(
    name: str, out: str, rules: tuple[fp.Glob, ...] | None = None, seed: int = 0
) -> dict[str, str]:
    """Rank 0 of ``launch``: the family wrapped with FSDP2 from its plan, one AdamW step (so
    the kept values are trained ones, not bf16-representable inits), exported; returns what the
    record keeps (name -> dtype)."""
    model = build(name, seed)
    rules = family(name).rules if rules is None else rules
    plan = fp.compile_param_dtype_maps(
        model, fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=rules, advice="off")
    )
    plan.apply()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    from fsdp_precision.checkpoint import export_safetensors, read_export_record

    export_safetensors(model, out, dtype=bf16)
    return {k.name: str(k.dtype) for k in read_export_record(out).kept}


def export_family(
    name: str, out: Path, rules: tuple[fp.Glob, ...] | None = None, seed: int = 0
) -> dict[str, str]:
    """:func:`train_and_export` in a process of its own."""
    from fsdp_precision.testing import launch

    args = (name, str(out), rules, seed)
    return launch(train_and_export, args, nproc=1, start_method="spawn")


def declare_base(name: str, base: str, declaration: str, seed: int = 0) -> dict[str, str]:
    """Rank 0 of ``launch``: what an RL run starts from. The family's base checkpoint as
    released (``save_pretrained`` in bf16: no record, its routers bf16 on disk), and the
    trainer's declaration of what it keeps (the model loaded in fp32, wrapped with FSDP2 from
    its plan, ``declare_kept``); returns the declaration's kept tensors (name -> dtype)."""
    from transformers import AutoModelForCausalLM

    from fsdp_precision.integrations import declare_kept

    build(name, seed).to(bf16).save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=fp32)
    plan = fp.compile_param_dtype_maps(
        model,
        fp.PrecisionRules(
            param_dtype=bf16, reduce_dtype=fp32, rules=family(name).rules, advice="off"
        ),
    )
    plan.apply()
    import json

    path = declare_kept(model, declaration)
    return {n: e["dtype"] for n, e in json.loads(path.read_text())["kept"].items()}


def declare_family(name: str, base: Path, declaration: Path) -> dict[str, str]:
    """:func:`declare_base` in a process of its own."""
    from fsdp_precision.testing import launch

    return launch(declare_base, (name, str(base), str(declaration)), nproc=1, start_method="spawn")
