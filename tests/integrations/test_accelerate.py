"""accelerate's FSDP2 plugin and the HF Trainer, with the real packages, on 2 CPU ranks (gloo).

accelerate makes the ``fully_shard`` calls (each decoder layer, the input embedding, a grouped
``[norm, lm_head]`` call, the root) with the one policy object it was given. With
``model_policy`` that object keeps DeepSeek-V3's ``_keep_in_fp32_modules_strict`` router gates
in fp32; accelerate's plain policy gathers them in bf16 (the negative control), with the same
collectives. On CPU accelerate would fall back to DDP: ``accelerate_fsdp2_on_cpu`` turns FSDP2
back on, and every case asserts that the parameters really are DTensors.

Parity: through accelerate (one step) and the Trainer (2 ``train()`` steps), ``model_policy`` is
bitwise equal to the separate-units reference, each gate its own fp32 unit made before the
framework's calls with the plain policy; the plain policy alone is not (the Trainer case checks).

The run's edges: ``examples/accelerate_qwen3_moe.py`` saves with accelerate's ``save_state``
(the policy in the plugin), resumes with ``load_state`` in a fresh launch bitwise equal to the
uninterrupted run, and exports with accelerate's API and the library's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import (
    accelerate_fsdp2_on_cpu,
    cpu_fsdp2_trainer,
    trainer_fsdp_policy,
)
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support import ROOT
from tests.support.harness import (
    collect_cases,
    distributed_suite,
    fresh_accelerate_state,
    launch_example,
    run_example,
)
from tests.support.hf_models import deepseek_v3
from tests.support.hostile import crafted_metadata

accelerate = pytest.importorskip(
    "accelerate", reason="accelerate is not installed (pip install '.[accelerate]')"
)
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32)  # + the model's declarations


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    return {"input_ids": ids, "labels": ids}


def separate_gate_units(model: nn.Module) -> None:
    """The separate-units reference: each router gate its own fp32 unit (param_dtype=None, the
    gates are stored in fp32), made before the framework's ``fully_shard`` calls."""
    from torch.distributed.fsdp import fully_shard

    for name in gates(model):
        gate = model.get_submodule(name.rsplit(".", 1)[0])
        fully_shard(gate, mp_policy=MixedPrecisionPolicy(reduce_dtype=fp32))


def prepared(
    policy_for: str, compiled: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """A tiny DeepSeek-V3 prepared by accelerate with ``policy_for``: 'model' (model_policy),
    'plain' (accelerate's plain policy) or 'separate' (each gate its own param_dtype=None unit,
    wrapped before prepare, then the plain policy: the separate-units reference); ``compiled``:
    accelerate's ``dynamo_plugin`` compiles the decoder layers (regional compilation, aot_eager).
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import TorchDynamoPlugin

    fresh_accelerate_state()
    torch.manual_seed(0)
    model = deepseek_v3()
    policy = (
        fp.model_policy(model, RULES)
        if policy_for == "model"
        else MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    )
    if policy_for == "separate":
        separate_gate_units(model)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=policy, auto_wrap_policy="transformer_based_wrap"
    )
    dynamo = (
        TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True) if compiled else None
    )
    accelerator = Accelerator(
        cpu=True, mixed_precision="bf16", fsdp_plugin=plugin, dynamo_plugin=dynamo
    )
    accelerate_fsdp2_on_cpu(accelerator, plugin)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optim = accelerator.prepare(model, optim)
    assert accelerator.is_fsdp2
    assert plugin.mixed_precision_policy is policy  # accelerate kept the object
    return model, optim, accelerator


def train_step(model: nn.Module, optim: torch.optim.Optimizer, accelerator: object):  # type: ignore[no-untyped-def]
    with CollectiveRecorder() as recorder, GatherProbe(model) as probe:
        loss = model(**batch()).loss
        accelerator.backward(loss)  # type: ignore[attr-defined]
    optim.step()
    optim.zero_grad()
    assert torch.isfinite(loss)
    kinds = [c.kind for c in recorder.calls]
    return {k: v.dtype for k, v in probe.seen.items()}, (
        kinds.count("all_gather"),
        kinds.count("reduce_scatter"),
    )


def case_accelerate_fsdp2_keeps_the_router_gates_in_fp32() -> None:
    model, optim, accelerator = prepared("model")
    names = [n for n, _ in model.named_parameters()]
    not_sharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not not_sharded, not_sharded  # FSDP2 wrapped it, not DDP
    seen, counts = train_step(model, optim, accelerator)
    assert len(seen) == len(names)
    kept = gates(model)
    assert kept and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    seen, _ = train_step(model, optim, accelerator)  # a second step runs the same way
    # Negative control: accelerate's plain policy gathers the gates in bf16, with exactly the
    # same collectives (the kept gates cost no unit).
    plain, plain_optim, plain_accelerator = prepared("plain")
    plain_seen, plain_counts = train_step(plain, plain_optim, plain_accelerator)
    assert all(plain_seen[n] == bf16 for n in kept)
    assert counts == plain_counts, (counts, plain_counts)
    assert counts[0] > 0 and counts[1] > 0


def case_accelerate_dynamo_plugin_compiles_kept_gates_without_graph_breaks() -> None:
    """accelerate's ``dynamo_plugin`` (regional compilation of the decoder layers, aot_eager):
    the kept gates add no graph break to the plain policy's, the separate-units reference adds
    one per layer; the gates are still gathered in fp32."""
    from torch._dynamo.utils import counters

    breaks, seen = {}, {}
    for variant in ("plain", "model", "separate"):
        torch._dynamo.reset()
        counters.clear()
        model, optim, accelerator = prepared(variant, compiled=True)
        seen[variant], _ = train_step(model, optim, accelerator)
        breaks[variant] = sum(counters["graph_break"].values())
    kept = [n for n in seen["model"] if n.endswith("mlp.gate.weight")]
    assert kept and all(seen["model"][n] == fp32 for n in kept)
    assert breaks["model"] == breaks["plain"], breaks
    assert breaks["separate"] > breaks["plain"], breaks


def case_accelerate_units_are_the_calls_accelerate_makes() -> None:
    """``--units accelerate`` (``accelerate_units``) plans the calls accelerate really makes:
    the same modules become units, grouped the same way."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_precision._plan.units import accelerate_units

    planned_model = deepseek_v3()
    names = {id(m): n for n, m in planned_model.named_modules()}
    planned = [
        [names[id(m)] for m in (u if isinstance(u, list) else [u])]
        for u in accelerate_units(planned_model)
    ]
    model, _, _ = prepared("plain")
    states: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            states.setdefault(id(module._get_fsdp_state()), []).append(name)
    assert sorted(map(sorted, states.values())) == sorted(map(sorted, planned))
    assert any(len(call) > 1 for call in planned)  # the grouped [norm, lm_head] call


def case_accelerate_model_policy_is_bitwise_equal_to_separate_fp32_units() -> None:
    """Parity: the same step through accelerate, the gates inside their layers' units (one
    policy) or as separate fp32 units (more collectives), gives bitwise the same loss and
    gradients."""
    results = {}
    for variant in ("model", "separate"):
        model, _, accelerator = prepared(variant)
        loss = model(**batch()).loss
        accelerator.backward(loss)  # type: ignore[attr-defined]
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results[variant] = (loss.detach(), grads)
    (loss, grads), (ref_loss, ref_grads) = results["model"], results["separate"]
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype and torch.equal(grad, ref_grads[name]), name


TRAINER_RECORDS = ("loss", "grad_norm", "learning_rate", "epoch")  # logged every step


def trainer_train(policy_for: str) -> tuple[Any, Any, MixedPrecisionPolicy]:
    """2 HF Trainer steps of a tiny DeepSeek-V3 under FSDP2 with the policy ``policy_for`` (as in
    :func:`prepared`), the policy given through ``trainer_fsdp_policy``; returns
    (trainer, the ``train()`` result, the policy)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    fresh_accelerate_state()

    CpuFsdp2Trainer = cpu_fsdp2_trainer(Trainer)  # accelerate drops FSDP on CPU

    torch.manual_seed(0)
    model = deepseek_v3()
    policy = (
        fp.model_policy(model, RULES)
        if policy_for == "model"
        else MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    )
    if policy_for == "separate":
        separate_gate_units(model)  # before the Trainer: accelerate wraps around them
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, bf16=True, fsdp=True, max_steps=2,
            per_device_train_batch_size=2, report_to=[], save_strategy="no", logging_steps=1,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["DeepseekV3DecoderLayer"]},
        )  # fmt: skip
        trainer_fsdp_policy(args, policy)
        data = [{k: v[0] for k, v in batch().items()} for _ in range(4)]
        trainer = CpuFsdp2Trainer(model=model, args=args, train_dataset=data)
        assert trainer.accelerator.state.fsdp_plugin.mixed_precision_policy is policy
        result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    wrapped = trainer.model_wrapped
    assert all(isinstance(p, DTensor) for p in wrapped.parameters())
    return trainer, result, policy


def trained_state(
    trainer: Any, result: Any
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The per-step log records (loss, grad norm, ...) with the final training loss, and every
    parameter gathered, after training."""
    history = [{k: r[k] for k in TRAINER_RECORDS} for r in trainer.state.log_history if "loss" in r]
    history.append({"training_loss": result.training_loss})
    wrapped = trainer.model_wrapped
    return history, {n: p.detach().full_tensor() for n, p in wrapped.named_parameters()}


def case_trainer_takes_the_policy_through_fsdp_plugin_args() -> None:
    trainer, _, _ = trainer_train("model")
    wrapped = trainer.model_wrapped
    with GatherProbe(wrapped) as probe, torch.no_grad():
        wrapped(**batch())
    assert all(probe.seen[n].dtype == fp32 for n in gates(wrapped))


def case_trainer_model_policy_trains_bitwise_like_separate_fp32_units() -> None:
    """Parity: 2 Trainer steps, the gates inside their layers' units (``model_policy``) or as
    separate fp32 units made before the Trainer (accelerate wraps around them, plain policy),
    log the same losses and gradient norms (the norm that gradient clipping, on by default with
    ``max_grad_norm=1.0``, divides by) and end with the same parameters, bitwise."""
    runs = {v: trained_state(*trainer_train(v)[:2]) for v in ("model", "separate", "plain")}
    (history, params), (ref_history, ref_params) = runs["model"], runs["separate"]
    assert len(history) == 3 and history == ref_history, (history, ref_history)
    assert params.keys() == ref_params.keys()
    for name, param in params.items():
        assert param.dtype == ref_params[name].dtype and torch.equal(param, ref_params[name]), name
    # Negative control: the plain policy (gates gathered in bf16) trains differently, so the
    # equality above would fail if model_policy gathered the gates in bf16.
    plain_history, plain_params = runs["plain"]
    assert plain_history != ref_history, plain_history
    kept = [n for n in params if n.endswith("mlp.gate.weight")]
    assert kept and not any(torch.equal(plain_params[n], ref_params[n]) for n in kept), kept


def test_trainer_fsdp_policy_refuses_args_without_fsdp2() -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"TrainingArguments does not enable FSDP2"):
        trainer_fsdp_policy(args, MixedPrecisionPolicy())
    with pytest.raises(TypeError, match=r"policy must be a MixedPrecisionPolicy"):
        trainer_fsdp_policy(args, {"param_dtype": bf16})  # type: ignore[arg-type]


def test_integration_helpers_refuse_what_they_cannot_take() -> None:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    from fsdp_precision.integrations import cpu_fsdp2_trainer, transformers_native_fsdp

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True)  # one process: no multi-process CPU state
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        with pytest.raises(RuntimeError, match=r"accelerate_fsdp2_on_cpu needs a multi-process"):
            accelerate_fsdp2_on_cpu(accelerator, plugin)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(TypeError, match=r"object has no create_accelerator_and_postprocess"):
        cpu_fsdp2_trainer(object)
    with pytest.raises(TypeError, match=r"rules must be a PrecisionRules, got str"):
        with transformers_native_fsdp("bf16"):  # type: ignore[arg-type]
            pass


def accelerate_example(*args: object) -> str:
    return run_example(ROOT / "examples" / "accelerate_qwen3_moe.py", *args)


def test_save_state_resumes_bitwise_in_a_fresh_launch(tmp_path: Path) -> None:
    """accelerate's ``save_state`` every 2 steps, the policy in the plugin; a fresh launch given
    only the step-2 checkpoint (what a run preempted after it leaves) resumes with
    ``load_state`` and ``skip_first_batches``, trains steps 3-4 and ends with every parameter and
    every optimizer state bitwise equal to the uninterrupted run's. Both exports are checked in
    the example (accelerate's fp32, ours bf16 with the kept gates and norms restored)."""
    first = tmp_path / "uninterrupted"
    stdout = accelerate_example("--output-dir", str(first), "--out", str(first / "out.pt"))
    assert "steps 1-4" in stdout and "resumed" not in stdout, stdout
    assert "equal the trained fp32 values" in stdout, stdout
    assert "gates and norms gathered in fp32" in stdout, stdout
    saved = sorted(p.name for p in (first / "checkpoints").iterdir())
    assert saved == ["step_2", "step_4"], saved  # no temporary directory left
    step2 = sorted(p.name for p in (first / "checkpoints" / "step_2").iterdir())
    assert step2 == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl",
                     "random_states_1.pkl"], step2  # fmt: skip

    second = tmp_path / "resumed"
    shutil.copytree(first / "checkpoints" / "step_2", second / "checkpoints" / "step_2")
    stdout = accelerate_example("--output-dir", str(second), "--out", str(second / "out.pt"))
    assert "resumed from step_2: step 2" in stdout and "steps 3-4" in stdout, stdout

    a = torch.load(first / "out.pt", weights_only=False)
    b = torch.load(second / "out.pt", weights_only=False)
    # The resumed launch trained 2 steps from the checkpoint, not 4 from scratch (which would
    # match as well): the equality below needs the loaded parameters, the optimizer's moments
    # and step count, and the skipped batches.
    assert (a["start"], a["trained"], b["start"], b["trained"]) == (0, 4, 2, 2)
    assert a["params"].keys() == b["params"].keys() and a["params"]
    for name, tensor in a["params"].items():
        other = b["params"][name]
        assert tensor.dtype == other.dtype == fp32 and torch.equal(tensor, other), name
    states = a["optim"]["state"], b["optim"]["state"]
    assert states[0].keys() == states[1].keys() and states[0]
    for name, state in states[0].items():
        assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}, state.keys()
        for key, value in state.items():
            assert torch.equal(value, states[1][name][key]), (name, key)

    # A crafted file in the step a relaunch resumes from: the example checks it before
    # accelerate's load_state reads it (DCP's default reader would run it: tests/trust).
    third = tmp_path / "crafted"
    shutil.copytree(first / "checkpoints" / "step_2", third / "checkpoints" / "step_2")
    sentinel = tmp_path / "ran"
    crafted_metadata(third / "checkpoints" / "step_2" / "pytorch_model_fsdp_0", sentinel)
    out = launch_example(ROOT / "examples" / "accelerate_qwen3_moe.py", "--output-dir", third)
    assert out.returncode != 0 and "UnsafeCheckpointError" in out.stderr, out.stderr[-3000:]
    assert "asks to construct posix.system, which is not DCP" in out.stderr
    assert not sentinel.exists(), "the payload ran"


CASES = collect_cases(globals())

results, test_accelerate = distributed_suite(2, __name__, CASES)
