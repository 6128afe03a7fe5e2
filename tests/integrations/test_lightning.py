"""Lightning's ModelParallelStrategy, with the real package, on 2 CPU ranks (gloo).

Lightning builds the device mesh (``data_parallel_size`` x ``tensor_parallel_size``) and hands
it to the user's code: Fabric's ``parallelize_fn(model, device_mesh)`` or the LightningModule's
``configure_model``. The recipe makes the ``fully_shard`` calls there (each decoder layer, then
the root) on ``device_mesh["data_parallel"]`` with one ``model_policy`` object, which keeps
DeepSeek-V3's ``_keep_in_fp32_modules_strict`` router gates in fp32. A plain
``MixedPrecisionPolicy`` gathers them in bf16 (the negative control), with the same
collectives.

Lightning launches its own processes unless the environment says they exist: the harness's
ranks set torchrun's variables, and Lightning attaches to the process group already there.

The run's edges: the Trainer's default ``ModelCheckpoint`` saves a LightningModule whose
hyperparameters hold the rules and a ``model_policy`` (they pickle; the policy as the plain
``ParamDtypeMixedPrecisionPolicy`` it reads as), and a fresh Trainer resumes from it bitwise;
``export_safetensors`` after a no-grad forward writes the root unit's tensors in the bulk dtype;
and the Fabric example saves with ``fabric.save``, resumes in fresh launches bitwise and
exports (torchrun, three launches).
"""

from __future__ import annotations

import io
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision._policy.scope import ModelScopedPolicy
from fsdp_precision.checkpoint import SAFE_GLOBALS
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support import ROOT
from tests.support.harness import (
    collect_cases,
    distributed_suite,
    run_example,
    torchrun_environment,
)
from tests.support.hf_models import deepseek_v3

lightning = pytest.importorskip(
    "lightning", reason="lightning is not installed (pip install '.[lightning]')"
)
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32)  # + the model's declarations


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    return {"input_ids": ids, "labels": ids}


def parallelize_with(policy_for: str) -> Callable[[nn.Module, DeviceMesh], nn.Module]:
    """The recipe: a ``parallelize_fn`` sharding each decoder layer, then the root, with
    ``policy_for``: 'model' (model_policy), 'plain' (a plain policy) or 'separate' (each gate
    its own fp32 unit first, then the plain policy: the separate-units reference)."""

    def parallelize(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        policy = (
            fp.model_policy(model, RULES)
            if policy_for == "model"
            else MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        )
        mesh = device_mesh["data_parallel"]
        if policy_for == "separate":
            for name in gates(model):
                gate = model.get_submodule(name.rsplit(".", 1)[0])
                fully_shard(gate, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=fp32))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    return parallelize


def fabric_setup(policy_for: str, sizes: str = "explicit"):  # type: ignore[no-untyped-def]
    """A tiny DeepSeek-V3 set up by Fabric's ModelParallelStrategy with ``policy_for``."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    torchrun_environment()
    world = dist.get_world_size()
    explicit = {"data_parallel_size": world, "tensor_parallel_size": 1}
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize_with(policy_for), **(explicit if sizes == "explicit" else {})
    )
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()  # the processes exist: this only sets the strategy up
    assert strategy.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
    torch.manual_seed(0)
    model = fabric.setup(deepseek_v3())
    dp = strategy.device_mesh["data_parallel"].size()
    assert dp == (world if sizes == "explicit" else 1), dp
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return fabric, model, optim


def fabric_step(fabric, model, optim):  # type: ignore[no-untyped-def]
    inner = model.module  # the user's module under Fabric's wrapper: its names
    with CollectiveRecorder() as recorder, GatherProbe(inner) as probe:
        loss = model(**batch()).loss
        fabric.backward(loss)
    optim.step()
    optim.zero_grad()
    assert torch.isfinite(loss), loss
    kinds = [c.kind for c in recorder.calls]
    return {k: v.dtype for k, v in probe.seen.items()}, (
        kinds.count("all_gather"),
        kinds.count("reduce_scatter"),
    )


def case_fabric_parallelize_fn_keeps_the_router_gates_in_fp32() -> None:
    fabric, model, optim = fabric_setup("model")
    inner = model.module
    names = [n for n, _ in inner.named_parameters()]
    not_sharded = [n for n, p in inner.named_parameters() if not isinstance(p, DTensor)]
    assert not not_sharded, not_sharded
    assert any(p.to_local().shape != p.shape for p in inner.parameters())  # really sharded
    seen, counts = fabric_step(fabric, model, optim)
    assert len(seen) == len(names)
    kept = gates(inner)
    assert kept and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    second, second_counts = fabric_step(fabric, model, optim)
    assert (second, second_counts) == (seen, counts)  # the second step runs the same way
    # Negative control: a plain policy gathers the gates in bf16, with the same collectives.
    plain_fabric, plain, plain_optim = fabric_setup("plain")
    plain_seen, plain_counts = fabric_step(plain_fabric, plain, plain_optim)
    assert all(plain_seen[n] == bf16 for n in kept)
    assert counts == plain_counts, (counts, plain_counts)
    # One all-gather per unit in forward, one more per layer in backward (the root is not
    # resharded after forward), one reduce-scatter per unit: no unit was added.
    layers = len(inner.model.layers)
    assert counts == (2 * layers + 1, layers + 1), counts


def assert_bitwise_equal(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, tensor in got.items():
        assert tensor.dtype == ref[name].dtype and torch.equal(tensor, ref[name]), name


def case_fabric_model_policy_is_bitwise_equal_to_separate_fp32_units() -> None:
    """Parity: the same Fabric step, the gates inside their layers' units (one policy) or as
    separate fp32 units made first in ``parallelize_fn`` (the reference, more collectives),
    gives bitwise the same loss and gradients, and after an optimizer step the same loss."""
    results = {}
    for variant in ("model", "separate"):
        fabric, model, optim = fabric_setup(variant)
        with CollectiveRecorder() as recorder:
            loss = model(**batch()).loss
            fabric.backward(loss)
        kinds = [c.kind for c in recorder.calls]
        grads = {n: p.grad.full_tensor() for n, p in model.module.named_parameters()}
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            second = model(**batch()).loss
        losses = {"first": loss.detach(), "second": second}
        counts = (kinds.count("all_gather"), kinds.count("reduce_scatter"))
        results[variant] = (losses, grads, counts)
    (losses, grads, counts), (ref_losses, ref_grads, ref_counts) = results.values()
    assert_bitwise_equal(losses, ref_losses)
    assert_bitwise_equal(grads, ref_grads)
    # The reference pays for it: each gate unit adds an all-gather in forward and in backward
    # and a reduce-scatter.
    n = len(gates(model.module))
    assert ref_counts == (counts[0] + 2 * n, counts[1] + n), (ref_counts, counts)


def case_data_parallel_size_auto_shards_nothing_on_one_node() -> None:
    """Why the recipe sets ``data_parallel_size``: Lightning's "auto" is the number of nodes."""
    _, model, _ = fabric_setup("model", sizes="auto")
    params = list(model.module.parameters())
    assert all(isinstance(p, DTensor) and p.to_local().shape == p.shape for p in params)


def trainer_fit(policy_for: str):  # type: ignore[no-untyped-def]
    """Two training steps of the Trainer with ModelParallelStrategy; per step: dtypes, counts,
    loss; and each step's full gradients."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = deepseek_v3()

        def configure_model(self) -> None:  # the recipe: the same calls as parallelize_fn
            if isinstance(self.model.model.embed_tokens.weight, DTensor):
                return  # configure_model runs again for validate/test
            parallelize_with(policy_for)(self.model, self.device_mesh)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Observe(L.Callback):
        """What each training step gathered and which collectives it ran."""

        def __init__(self) -> None:
            self.steps: list[tuple[dict[str, torch.dtype], tuple[int, int], float]] = []
            self.grads: list[dict[str, torch.Tensor]] = []

        def on_train_batch_start(self, trainer, module, batch, index):  # type: ignore[no-untyped-def]
            assert all(isinstance(p, DTensor) for p in module.parameters())  # FSDP2, sharded
            self.recorder = CollectiveRecorder().__enter__()
            self.probe = GatherProbe(module.model).__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):  # type: ignore[no-untyped-def]
            self.probe.__exit__(None, None, None)
            self.recorder.__exit__(None, None, None)
            kinds = [c.kind for c in self.recorder.calls]
            counts = (kinds.count("all_gather"), kinds.count("reduce_scatter"))
            seen = {k: v.dtype for k, v in self.probe.seen.items()}
            self.steps.append((seen, counts, float(outputs["loss"])))

        def on_before_optimizer_step(self, trainer, module, optimizer):  # type: ignore[no-untyped-def]
            self.grads.append({n: p.grad.full_tensor() for n, p in module.model.named_parameters()})

    torchrun_environment()
    torch.manual_seed(0)
    module, observe = Module(), Observe()
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), max_steps=2, callbacks=[observe],
        strategy=ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    data = [{k: v[0] for k, v in batch().items()} for _ in range(8)]
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert trainer.global_step == 2 and len(observe.steps) == 2
    return module.model, observe.steps, observe.grads


def case_trainer_configure_model_keeps_the_router_gates_in_fp32() -> None:
    model, steps, _ = trainer_fit("model")
    kept = gates(model)
    for seen, _, loss in steps:
        assert len(seen) == len(list(model.parameters()))
        assert torch.isfinite(torch.tensor(loss)), loss
        assert kept and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
        assert all(d == bf16 for n, d in seen.items() if n not in kept)
    # Negative control: the same Trainer with a plain policy gathers the gates in bf16.
    _, plain_steps, _ = trainer_fit("plain")
    for (_, counts, _), (plain_seen, plain_counts, _) in zip(steps, plain_steps):
        assert all(plain_seen[n] == bf16 for n in kept)
        assert counts == plain_counts, (counts, plain_counts)
    layers = len(model.model.layers)
    assert all(counts == (2 * layers + 1, layers + 1) for _, counts, _ in steps), steps


def case_trainer_model_policy_is_bitwise_equal_to_separate_fp32_units() -> None:
    """Parity through ``configure_model``: two Trainer steps, the gates inside their layers'
    units or as separate fp32 units (the reference), give bitwise the same losses and
    gradients; the reference runs more collectives."""
    model, steps, grads = trainer_fit("model")
    _, ref_steps, ref_grads = trainer_fit("separate")
    assert [loss for *_, loss in steps] == [loss for *_, loss in ref_steps], (steps, ref_steps)
    assert len(grads) == len(ref_grads) == 2
    for got, ref in zip(grads, ref_grads):
        assert_bitwise_equal(got, ref)
    n = len(gates(model))
    for (_, counts, _), (_, ref_counts, _) in zip(steps, ref_steps):
        assert ref_counts == (counts[0] + 2 * n, counts[1] + n), (ref_counts, counts)


def shared_tmpdir() -> Path:
    """A temporary directory rank 0 made, the same path on every rank."""
    where = [tempfile.mkdtemp(prefix="lightning-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where)
    return Path(where[0])


def trainer_run(root: Path, epochs: int, ckpt_path: str | None = None):  # type: ignore[no-untyped-def]
    """The Trainer with its default checkpointing (``ModelCheckpoint``: the last epoch) and
    default logger, a LightningModule whose hyperparameters hold the rules and a model_policy;
    ``epochs`` epochs of two steps, resumed from ``ckpt_path`` if given. Returns the module."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self, model: nn.Module, rules: fp.PrecisionRules, policy: Any) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["model"])  # rules and policy: hyperparameters
            self.model = model

        def configure_model(self) -> None:
            if isinstance(self.model.model.embed_tokens.weight, DTensor):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=self.hparams.policy)
            fully_shard(self.model, mesh=mesh, mp_policy=self.hparams.policy)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torchrun_environment()
    torch.manual_seed(0)
    model = deepseek_v3()
    module = Module(model, RULES, fp.model_policy(model, RULES))
    world = dist.get_world_size()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_epochs=epochs, default_root_dir=root,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (8, 8), generator=gen)
    ]
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    assert trainer.global_step == 2 * epochs, trainer.global_step
    return module


def local_state(module: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and of the optimizer's state."""
    optimizer = module.trainer.optimizers[0]
    found = {n: p.detach().to_local().clone() for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        for key, value in optimizer.state[p].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            found[f"{n}/{key}"] = torch.as_tensor(local).clone()
    return found


def case_trainer_checkpoint_with_the_policy_in_hparams_saves_and_resumes_bitwise() -> None:
    """The Trainer's default ModelCheckpoint saves a module whose hparams hold a model_policy
    (Lightning torch.saves them into meta.pt); a fresh Trainer resumes from it bitwise equal to
    the uninterrupted run (every shard of the parameters and the optimizer state). Lightning
    reads meta.pt with torch's default ``weights_only=True``, which refuses the library's
    objects: resuming names them in ``torch.serialization.safe_globals``."""
    root = shared_tmpdir()
    uninterrupted = local_state(trainer_run(root / "uninterrupted", epochs=2))
    first = trainer_run(root / "first", epochs=1)  # the run that stops after its first epoch
    saved = Path(first.trainer.checkpoint_callback.best_model_path)
    assert saved.name == "epoch=0-step=2.ckpt" and saved.is_dir(), saved
    assert sorted(p.name for p in saved.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"
    ], sorted(saved.iterdir())  # fmt: skip
    meta = saved / "meta.pt"
    # What the hparams read back as: the rules, and the policy as the plain policy record.
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(meta)
    assert sorted(unsafe) == [
        "fsdp_precision._policy.scope._plain_policy",
        "fsdp_precision._rules.rules.PrecisionRules",
    ], unsafe
    with pytest.raises(pickle.UnpicklingError, match=r"Unsupported global: .*fsdp_precision"):
        torch.load(meta)  # Lightning's default: weights_only
    allowed = list(SAFE_GLOBALS)  # the library's public allow-list
    with torch.serialization.safe_globals(allowed):
        hparams = torch.load(meta)["hyper_parameters"]
    assert hparams["rules"] == RULES
    policy = hparams["policy"]
    assert type(policy) is fp.ParamDtypeMixedPrecisionPolicy, type(policy)
    assert (policy.param_dtype, policy.reduce_dtype) == (bf16, fp32)
    assert set(policy.param_dtype_map) == set(gates(deepseek_v3())), policy.param_dtype_map
    assert set(policy.param_dtype_map.values()) == {fp32}
    with torch.serialization.safe_globals(allowed):  # the resume, in a fresh Trainer
        resumed = local_state(trainer_run(root / "resumed", epochs=2, ckpt_path=str(saved)))
    assert resumed.keys() == uninterrupted.keys()
    differs = [n for n, t in resumed.items() if not torch.equal(t, uninterrupted[n])]
    assert not differs, differs
    assert any("exp_avg_sq" in n for n in resumed)  # the optimizer state was compared
    # Negative control: without the policy's pickling (its __reduce__ reverted), the save of
    # the same hparams fails as it did before (a weakref in the model-scoped policy).
    reduce = ModelScopedPolicy.__dict__["__reduce__"]
    del ModelScopedPolicy.__reduce__
    try:
        with pytest.raises(TypeError, match="pickle"):
            model = deepseek_v3()
            torch.save(
                {"hyper_parameters": {"policy": fp.model_policy(model, RULES)}}, io.BytesIO()
            )
    finally:
        ModelScopedPolicy.__reduce__ = reduce  # type: ignore[method-assign]
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root)


def case_export_after_a_no_grad_forward_writes_the_root_unit_in_bf16() -> None:
    """``export_safetensors(model.module, dir, dtype=bf16)`` after an evaluation forward (no
    grad: FSDP2 leaves the root unit unsharded) writes the root unit's tensors in bf16, the
    gates in fp32 and nothing else kept; the reloaded model gets its gates back in fp32. Fails
    if the export reads the root's unsharded parameters as "not in an FSDP unit" (fp32)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fsdp_precision.checkpoint import export_safetensors, read_export_record, restore_kept

    fabric, model, optim = fabric_setup("model")
    fabric_step(fabric, model, optim)
    with torch.no_grad():
        model(**batch())
    root_unit = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert not any(isinstance(model.module.get_parameter(n), DTensor) for n in root_unit)
    out = shared_tmpdir() / "export"
    export_safetensors(model.module, out, dtype=bf16)
    kept = gates(model.module)
    if dist.get_rank() == 0:
        record = read_export_record(out)
        params = {k.param for k in record.kept if k.param is not None}
        buffers = {k.name for k in record.kept if "a buffer" in k.reason}
        assert params - buffers == set(kept), sorted(params - buffers)
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
        assert all(dtypes[n] == "BF16" for n in root_unit), {n: dtypes[n] for n in root_unit}
        assert all(dtypes[n] == "F32" for n in kept), {n: dtypes[n] for n in kept}
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=bf16)
        assert set(kept) <= set(restore_kept(loaded, out))
        assert all(loaded.get_parameter(n).dtype == fp32 for n in kept)
        import shutil

        shutil.rmtree(out.parent)


CASES = collect_cases(globals())

results, test_lightning = distributed_suite(2, __name__, CASES)


# --------------------------------------------------------------- the example, in fresh launches

EXAMPLE = str(ROOT / "examples" / "lightning_fabric_qwen3_moe.py")


def launch(*args: object) -> str:
    return run_example(EXAMPLE, *args)


@pytest.mark.distributed
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_fabric_example_resumes_in_a_fresh_launch_bitwise_and_exports(tmp_path: Path) -> None:
    """The example, as a user runs it: four steps saved with ``fabric.save``; the same run
    stopped after step 2's checkpoint (a preemption), then launched again: it resumes after
    step 2 and ends bitwise equal to the uninterrupted run (parameters, optimizer state,
    losses), exports and reloads (the example checks the reloaded logits). A save cut off
    (a partial directory with a ``meta.pt``, which ``fabric.load`` would take) is not picked."""
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    whole = launch(
        "--dir", str(tmp_path / "uninterrupted"), "--out", str(tmp_path / "uninterrupted.pt")
    )
    assert "kept in fp32, reloaded with the trained logits" in whole, whole[-2000:]
    run = tmp_path / "preempted"
    stopped = launch("--dir", str(run), "--stop-after", "2")
    assert "stopped after step 2's checkpoint" in stopped, stopped
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001", "step-000002"]
    # A torn save of step 3: shards missing, meta.pt there. Lightning's own test for a
    # checkpoint accepts it; the example's newest complete step-* is still step 2.
    torn = checkpoints / ".step-000003.partial"
    torn.mkdir()
    (torn / "meta.pt").write_bytes((checkpoints / "step-000002" / "meta.pt").read_bytes())
    assert _is_sharded_checkpoint(torn)
    resumed = launch("--dir", str(run), "--out", str(tmp_path / "resumed.pt"))
    assert "(started after step 2)" in resumed and "reloaded with the trained logits" in resumed
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000003", "step-000004"]
    assert (run / "export" / "fsdp_precision_export.json").is_file()
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    ref = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    assert got["losses"] == ref["losses"] and len(ref["losses"]) == 4, (got, ref)
    assert got["params"].keys() == ref["params"].keys()
    for name, tensor in got["params"].items():
        assert tensor.dtype == ref["params"][name].dtype == fp32, name
        assert torch.equal(tensor, ref["params"][name]), name
    states = got["optim"]["state"], ref["optim"]["state"]
    assert states[0].keys() == states[1].keys() and states[0]
    for name, state in states[0].items():
        assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}, (name, state.keys())
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(states[1][name][key]))
