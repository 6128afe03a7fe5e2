"""One training step of a tiny Qwen3-MoE with a ``model_policy`` (router gates kept in fp32)
through a framework, in the process it is started in: ``python -m tests.support.one_process
FRAMEWORK MIXED_PRECISION [unguarded]``, alone (no launcher: the framework skips FSDP) or under
``torchrun --nproc_per_node 1``. FRAMEWORK: accelerate, trainer or fabric. Prints one JSON line: what ran (``error``: the exception's type
and message; ``sharded``; the dtype each gate was computed in; whether the parameters changed).

``unguarded`` removes the library's guard first: the negative control, what the framework does
with the policy on its own (NeMo Automodel #3589, #3327).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import (
    accelerate_fsdp2_on_cpu,
    cpu_fsdp2_trainer,
    trainer_fsdp_policy,
)

from tests.support.hf_models import tiny_qwen3_moe

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(
    param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("*.mlp.gate.weight"),)
)


def gate_dtypes(model: nn.Module) -> dict[str, str]:
    """Record the dtype each router gate's output is computed in."""
    seen: dict[str, str] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            seen.setdefault(name, str((out[0] if isinstance(out, tuple) else out).dtype))

        return hook

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(record(name))
    return seen


def accelerate_step(model: nn.Module, policy: Any, mixed: str) -> dict[str, Any]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed, fsdp_plugin=plugin)
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerate_fsdp2_on_cpu(accelerator, plugin)  # a launcher: FSDP2 on CPU
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optim = accelerator.prepare(model, optim)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optim.step()
    return {"distributed_type": str(accelerator.distributed_type), "model": model}


def trainer_step(model: nn.Module, policy: Any, mixed: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, bf16=mixed == "bf16", fsdp=True, max_steps=1,
            per_device_train_batch_size=2, report_to=[], save_strategy="no",
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"]},
        )  # fmt: skip
        trainer_fsdp_policy(args, policy)
        launched = "LOCAL_RANK" in os.environ
        cls = cpu_fsdp2_trainer(Trainer) if launched else Trainer
        trainer = cls(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}] * 2)
        trainer.train()
    return {"model": trainer.model_wrapped}


def fabric_step(model: nn.Module, policy: Any, mixed: str) -> dict[str, Any]:
    """Lightning Fabric on one CPU device: ``ModelParallelStrategy`` with a ``parallelize_fn``
    making the ``fully_shard`` calls with the policy (``mixed="bf16-true"``), or the default
    single-device strategy, which makes none (``mixed="bf16-mixed"``)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = device_mesh["data_parallel"]
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    strategy: Any = "auto"
    if mixed == "bf16-true":
        strategy = ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=1, tensor_parallel_size=1
        )
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=mixed)  # type: ignore[arg-type]
    fabric.launch()
    model = fabric.setup(model)
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    fabric.backward(model(input_ids=ids, labels=ids).loss)
    optim.step()
    return {"strategy": type(fabric.strategy).__name__, "model": model}


STEPS = {"accelerate": accelerate_step, "trainer": trainer_step, "fabric": fabric_step}


def main() -> None:
    framework, mixed = sys.argv[1], sys.argv[2]
    model = tiny_qwen3_moe(bf16)
    policy = fp.model_policy(model, RULES)
    if "unguarded" in sys.argv[3:]:
        model._fsdp_precision_unapplied_guard.handle.remove()  # the negative control
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = gate_dtypes(model)
    result: dict[str, Any] = {"error": None}
    try:
        ran = STEPS[framework](model, policy, mixed)
        wrapped = ran.pop("model")
        result.update(ran, sharded=all(isinstance(p, DTensor) for p in wrapped.parameters()))
    except Exception as exc:  # noqa: BLE001 - reported
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["gates"] = seen
    result["changed"] = [
        n for n, p in model.named_parameters()
        if not isinstance(p, DTensor) and not torch.equal(p.detach(), before[n])
    ]  # fmt: skip
    print(json.dumps(result), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter shutdown: gloo's thread destructors can abort a finished rank


if __name__ == "__main__":
    main()
