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
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite, torchrun_environment
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


CASES = collect_cases(globals())

results, test_lightning = distributed_suite(2, __name__, CASES)
