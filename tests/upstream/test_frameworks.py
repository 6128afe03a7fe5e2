"""The field's reports through the frameworks that trigger them, with the real packages, on 2
gloo ranks (docs/known-issues.md).

- pytorch #196996 through accelerate's ``accumulate()`` and the HF Trainer's
  ``gradient_accumulation_steps`` (both call ``set_requires_gradient_sync(False)`` on the
  window's first microbatches): an MoE whose experts are separate modules, an expert first
  reached on each window's last microbatch, an unused head; two optimizer steps match the same
  run reduced every microbatch (``sync_each_batch=True``, which cannot hit the bug).
- accelerate 1.16.0 applies ``fully_shard`` to the activation-checkpoint wrapper (names gain
  ``_checkpoint_wrapped_module``): the gates stay fp32, and the loss equals the run without
  checkpointing.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import (
    accelerate_fsdp2_on_cpu,
    cpu_fsdp2_trainer,
    trainer_fsdp_policy,
)
from fsdp_precision.testing import GatherProbe

from tests.support.harness import collect_cases, distributed_suite, fresh_accelerate_state
from tests.support.moe import RULES, bf16, fp32, hash_moe, microbatches

accelerate = pytest.importorskip(
    "accelerate", reason="accelerate is not installed (pip install '.[accelerate]')"
)
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

LATE = 2
UNITS = ["Experts", "Block"]  # the experts' unit keeps nothing; the block's keeps its gate
LATE_EXPERT = f"blocks.0.moe.experts.{LATE}.up.weight"


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.replace("_checkpoint_wrapped_module.", ""): (
            p.full_tensor() if isinstance(p, DTensor) else p.detach()
        ).float()
        for n, p in model.named_parameters()
    }


def accelerate_run(sync_each_batch: bool) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """Two optimizer steps of 3 microbatches through ``accelerator.accumulate``."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import GradientAccumulationPlugin

    fresh_accelerate_state()
    model = hash_moe(fp32)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        mixed_precision_policy=fp.model_policy(model, RULES),
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=UNITS,
    )
    accumulation = GradientAccumulationPlugin(num_steps=3, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(
        cpu=True, fsdp_plugin=plugin, gradient_accumulation_plugin=accumulation
    )
    accelerate_fsdp2_on_cpu(accelerator, plugin)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optim = accelerator.prepare(model, optim)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    for ids in microbatches(LATE, steps=2, seed=1 + dist.get_rank()):
        with accelerator.accumulate(model):
            accelerator.backward(model(ids, labels=ids.roll(1))["loss"])
            optim.step()
            optim.zero_grad()
    return full(model), model


def case_196996_accelerate_accumulate() -> None:
    before = full(hash_moe(fp32))
    ours, model = accelerate_run(sync_each_batch=False)
    reference, _ = accelerate_run(sync_each_batch=True)
    assert not torch.equal(ours[LATE_EXPERT], before[LATE_EXPERT])  # it trained
    assert torch.equal(ours["aux_head.weight"], before["aux_head.weight"])  # unused
    for name, value in ours.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def trainer_run(sync_each_batch: bool) -> dict[str, torch.Tensor]:
    """Two optimizer steps of 3 microbatches through ``Trainer(gradient_accumulation_steps=3)``:
    microbatch ``m`` of rank ``r`` is ``microbatches(seed=1 + r)[m]``, in order."""
    from transformers import Trainer, TrainingArguments

    fresh_accelerate_state()
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = [microbatches(LATE, steps=2, seed=1 + r) for r in range(world)]
    rows = [
        {"input_ids": row, "labels": row.roll(1)}
        for m in range(len(shards[0]))
        for r in range(world)
        for row in shards[r][m]
    ]  # accelerate hands batch i to rank i % world
    model = hash_moe(fp32)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, fsdp=True, max_steps=2, report_to=[],
            per_device_train_batch_size=2, gradient_accumulation_steps=3, save_strategy="no",
            optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
            train_sampling_strategy="sequential", logging_steps=1,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": UNITS},
            accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}},
        )  # fmt: skip
        trainer_fsdp_policy(args, fp.model_policy(model, RULES))
        trainer = cpu_fsdp2_trainer(Trainer)(model=model, args=args, train_dataset=rows)
        result = trainer.train()
    assert result.global_step == 2, result
    assert rows[rank * 2]["input_ids"].equal(shards[rank][0][0])
    return full(trainer.model_wrapped)


def case_196996_trainer_gradient_accumulation_steps() -> None:
    before = full(hash_moe(fp32))
    ours = trainer_run(sync_each_batch=False)
    reference = trainer_run(sync_each_batch=True)
    assert not torch.equal(ours[LATE_EXPERT], before[LATE_EXPERT])
    assert torch.equal(ours["aux_head.weight"], before["aux_head.weight"])
    for name, value in ours.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def checkpointed_run(checkpointing: bool) -> tuple[float, dict[str, torch.dtype], list[str]]:
    """One accelerate step of a tiny Qwen3-MoE, with accelerate's activation checkpointing."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from tests.support.hf_models import tiny_qwen3_moe

    fresh_accelerate_state()
    model = tiny_qwen3_moe(bf16)
    rules = fp.PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*.mlp.gate.weight"),)
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        mixed_precision_policy=fp.model_policy(model, rules),
        auto_wrap_policy="transformer_based_wrap",
        activation_checkpointing=checkpointing,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerate_fsdp2_on_cpu(accelerator, plugin)
    model = accelerator.prepare(model)
    names = [n for n, _ in model.named_parameters()]
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    with GatherProbe(model) as probe:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
    return loss.item(), {n: g.dtype for n, g in probe.seen.items()}, names


def case_accelerate_activation_checkpointing_wraps_the_checkpoint_wrapper() -> None:
    loss, seen, names = checkpointed_run(True)
    wrapped = [n for n in names if "_checkpoint_wrapped_module" in n]
    assert wrapped, names[:4]  # accelerate checkpointed the decoder layers
    gates = [n for n in seen if n.endswith("mlp.gate.weight")]
    assert gates and all(seen[n] == fp32 for n in gates), {n: seen[n] for n in gates}
    assert all(d == bf16 for n, d in seen.items() if n not in gates)
    plain_loss, plain_seen, _ = checkpointed_run(False)
    assert loss == plain_loss, (loss, plain_loss)
    assert {n.replace("_checkpoint_wrapped_module.", ""): d for n, d in seen.items()} == plain_seen


CASES = collect_cases(globals())

results, test_frameworks = distributed_suite(2, __name__, CASES)
