"""torchtitan, with the real package, on 2 CPU ranks (gloo), without its training loop.

torchtitan's ``apply_fsdp_to_decoder`` builds its own ``MixedPrecisionPolicy(param_dtype,
reduce_dtype)``, so the recipe is a ``parallelize_fn`` of the same unit structure that passes ONE
``fsdp_precision.model_policy`` to every call: the input embedding, the grouped
``[norm, lm_head]`` tail, each transformer block, then the root. The model is torchtitan's own
Qwen3 MoE built small from its config classes; its router gates (``*moe.router.gate.weight``)
are kept in fp32. torchtitan's own ``apply_fsdp_to_decoder`` gathers them in bf16 with the same
collectives (the negative control). The recipe is bitwise equal (loss, gradients, the loss after
an AdamW step) to the separate-units reference: each gate its own fp32 unit, then torchtitan's
``apply_fsdp_to_decoder``. And the wiring: the same units in a ``ModelSpec.parallelize_fn`` with
torchtitan's signature, in a job config from its own ``ConfigManager``, called on its own
``ParallelDims`` the way its ``Trainer`` calls it (meta model, then ``to_empty``/``init_weights``).

CPU stand-ins, both outside the units: torchtitan's language models use flex (or varlen)
attention, which has no CPU backward, so the blocks use its ``ScaledDotProductAttention``; and
its router computes the gate under ``torch.autocast(dtype=float32)``, which casts the gate's
input on CUDA but is disabled on CPU: the recipe's boundary cast (the rule's ``boundary="auto"``)
casts it on any device, and a forward pre-hook stands in for the CUDA autocast where torchtitan's
own units run (the negative controls and the separate-units reference). And gloo has no
PREMUL_SUM for torchtitan's gradient divide factor of 1, so the units reduce with SUM. For the
wiring: ``ParallelDims`` builds its mesh on ``torchtitan.tools.utils.device_type``, "cuda" on a
machine without a GPU, so it is set to "cpu"; and the job config sets
``spmd_backend="partial_dtensor"``, because under the default "spmd_types" torchtitan's own
``parallelize_qwen3`` fails with this torch (a case pins the error).

The run's edges: ``export_safetensors`` of the recipe's model writes torchtitan's names (its
fused QKV split by its own state-dict hook into ``wq``/``wk``/``wv``, in the bulk dtype) with
the gates in fp32, which torchtitan's ``Qwen3StateDictAdapter.to_hf`` renames for Hugging Face;
and the example, in fresh launches: torchtitan's ``CheckpointManager`` saves every step, a run
stopped after step 2 resumes bitwise equal to the uninterrupted one, then exports and reloads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_precision import ModuleCast
from fsdp_precision._policy.casts import installed_cast
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite, run_example

pytest.importorskip(
    "torchtitan.models.qwen3",
    reason="torchtitan (and triton, which its models import) is not installed: "
    "pip install torchtitan triton (docs/integrations.md, 'torchtitan')",
)

bf16, fp32 = torch.bfloat16, torch.float32

# The recipe, from the example users copy (one source): examples/torchtitan_qwen3_moe.py.
_PATH = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_qwen3_moe.py"
_spec = importlib.util.spec_from_file_location("torchtitan_qwen3_moe", _PATH)
assert _spec is not None and _spec.loader is not None
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)
RULES, VOCAB, SEQ = recipe.RULES, recipe.VOCAB, recipe.SEQ
parallelize_with_model_policy = recipe.parallelize_with_model_policy
parallelize_qwen3_with_model_policy = recipe.parallelize_qwen3_with_model_policy
tiny_qwen3_moe_config = recipe.tiny_qwen3_moe_config


def separate_fp32_gate_units(model: nn.Module, dp_mesh: Any) -> nn.Module:
    """The separate-units reference: each router gate its own fp32 unit, made first."""
    for name in gates(model):
        gate = model.get_submodule(name.rsplit(".", 1)[0])
        fully_shard(gate, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=fp32))
    return model


def tiny_qwen3_moe(autocast_stand_in: bool = True) -> Any:
    """torchtitan's Qwen3 MoE built small on CPU; with the stand-in for the router's CUDA
    autocast(float32) unless the recipe's boundary cast does it."""
    torch.manual_seed(0)
    model = tiny_qwen3_moe_config().build()
    model.init_states()
    return cast_router_inputs(model) if autocast_stand_in else model


def cast_router_inputs(model: Any) -> Any:
    """What the router's autocast(float32) does on CUDA: the gate's input in its weight's dtype."""
    for layer in model.layers.values():
        layer.moe.router.gate.register_forward_pre_hook(
            lambda gate, args: (args[0].to(gate.weight.dtype), *args[1:])
        )
    return model


def sum_reductions_for_gloo(model: nn.Module) -> nn.Module:
    """torchtitan sets a gradient divide factor of 1 (a PREMUL_SUM, which gloo lacks): use SUM."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("moe.router.gate.weight")]


def next_token_loss(model: nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    logits = model(tokens[:, :-1], torch.arange(SEQ).repeat(2, 1))
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def step(model: nn.Module) -> tuple[dict[str, torch.dtype], tuple[int, int]]:
    """One forward+backward (next-token loss); gathered dtypes and collective counts."""
    with CollectiveRecorder() as recorder, GatherProbe(model) as probe:
        loss = next_token_loss(model)
        loss.backward()  # type: ignore[no-untyped-call]
    assert torch.isfinite(loss), loss
    assert all(p.grad is not None for p in model.parameters())
    kinds = [c.kind for c in recorder.calls]
    seen = {n: t.dtype for n, t in probe.seen.items()}
    return seen, (kinds.count("all_gather"), kinds.count("reduce_scatter"))


def case_recipe_keeps_the_router_gates_in_fp32_with_torchtitans_units() -> None:
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    recipe = tiny_qwen3_moe(autocast_stand_in=False)
    model = sum_reductions_for_gloo(parallelize_with_model_policy(recipe, mesh, RULES))
    casts = [n for n, m in model.named_modules() if installed_cast(m) is not None]
    # Kept whole: the router casts its inputs and outputs; its gate, inside it, its inputs only
    # (a no-op here: the router's cast already made them fp32).
    assert casts == [
        "layers.0.moe.router",
        "layers.0.moe.router.gate",
        "layers.1.moe.router",
        "layers.1.moe.router.gate",
    ], casts
    gate = model.get_submodule("layers.0.moe.router.gate")
    assert installed_cast(gate) == ModuleCast(torch.float32)
    names = [n for n, _ in model.named_parameters()]
    not_sharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not not_sharded, not_sharded
    kept = gates(model)
    assert len(kept) == 2, kept
    seen, counts = step(model)
    assert sorted(seen) == sorted(names)
    assert all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    # Negative control: torchtitan's own apply_fsdp_to_decoder (its policy, bf16/fp32) gathers
    # the gates in bf16, with exactly the same collectives: keeping them costs no unit.
    plain = tiny_qwen3_moe()
    apply_fsdp_to_decoder(plain, mesh, param_dtype=bf16, reduce_dtype=fp32, pp_enabled=False)
    sum_reductions_for_gloo(plain)
    assert all(isinstance(p, DTensor) for p in plain.parameters())
    plain_seen, plain_counts = step(plain)
    assert all(plain_seen[n] == bf16 for n in kept), {n: plain_seen[n] for n in kept}
    assert counts == plain_counts, (counts, plain_counts)
    assert counts[0] >= 4 and counts[1] >= 4, counts  # 2 blocks, embedding, tail, root


def case_recipe_is_bitwise_equal_to_separate_fp32_units() -> None:
    """Parity: the recipe (the gates inside their blocks' units, one policy) against separate
    fp32 gate units made first, then torchtitan's own apply_fsdp_to_decoder (the reference):
    bitwise the same loss and gradients, and after an AdamW step the same loss."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model = parallelize_with_model_policy(tiny_qwen3_moe(autocast_stand_in=False), mesh, RULES)
    ref = separate_fp32_gate_units(tiny_qwen3_moe(), mesh)
    apply_fsdp_to_decoder(ref, mesh, param_dtype=bf16, reduce_dtype=fp32, pp_enabled=False)
    results = []
    for m in (model, ref):
        sum_reductions_for_gloo(m)
        optim = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with CollectiveRecorder() as recorder:
            loss = next_token_loss(m)
            loss.backward()  # type: ignore[no-untyped-call]
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        optim.step()
        with torch.no_grad():
            second = next_token_loss(m)
        kinds = [c.kind for c in recorder.calls]
        counts = (kinds.count("all_gather"), kinds.count("reduce_scatter"))
        results.append(({"first": loss.detach(), "second": second}, grads, counts))
    (losses, grads, counts), (ref_losses, ref_grads, ref_counts) = results
    for got, want in ((losses, ref_losses), (grads, ref_grads)):
        assert got.keys() == want.keys()
        for name, tensor in got.items():
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    n = len(gates(model))  # each gate unit: an all-gather in forward and backward, a reduce
    assert n == 2 and ref_counts == (counts[0] + 2 * n, counts[1] + n), (ref_counts, counts)


@contextlib.contextmanager
def torchtitan_on_cpu(spmd_backend: str) -> Iterator[None]:
    """What torchtitan's Trainer sets before parallelizing, on CPU: its ParallelDims build the
    mesh on ``torchtitan.tools.utils.device_type``, "cuda" on a machine without a GPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils

    saved = parallel_dims.device_type, dist_utils.get_spmd_backend()
    parallel_dims.device_type = "cpu"
    dist_utils.set_spmd_backend(spmd_backend)
    try:
        yield
    finally:
        parallel_dims.device_type = saved[0]
        dist_utils.set_spmd_backend(saved[1])


def build_as_the_trainer_does(config: Any, autocast_stand_in: bool) -> Any:
    """Trainer.__init__'s model steps without its loop: ParallelDims from the config, the model
    on meta, ``model_spec.parallelize_fn`` called as the Trainer calls it, then to_empty and
    init_weights."""
    from torchtitan.distributed import ParallelDims

    spec = config.model_spec
    parallel_dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
    assert (parallel_dims.dp_shard, parallel_dims.fsdp_enabled) == (2, True)
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return sum_reductions_for_gloo(cast_router_inputs(model) if autocast_stand_in else model)


def case_model_spec_parallelize_fn_called_as_torchtitans_trainer_calls_it() -> None:
    """The wiring: torchtitan's config manager builds the job config (qwen3's MoE debug recipe)
    and the spec's parallelize_fn is replaced; its ParallelDims (dp_shard=2) and the Trainer's
    call. Negative control: the spec's own parallelize_qwen3 on the same config."""
    from torchtitan.config.manager import ConfigManager

    args = ["--module", "qwen3", "--config", "qwen3_moe_debug", "--training.seq_len", str(SEQ),
            "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.spmd_backend", "partial_dtensor"]  # fmt: skip
    config = ConfigManager().parse_args(args)
    assert config.training.mixed_precision_param == "bfloat16"
    own = config.model_spec.parallelize_fn
    assert own.__name__ == "parallelize_qwen3", own
    runs = {}
    for fn in (parallelize_qwen3_with_model_policy, own):
        # the tiny CPU model in place of the debug flavour; the spec's parallelize_fn replaced
        config.model_spec = dataclasses.replace(
            config.model_spec, model=tiny_qwen3_moe_config(), parallelize_fn=fn
        )
        with torchtitan_on_cpu(config.parallelism.spmd_backend):
            torch.manual_seed(0)
            model = build_as_the_trainer_does(config, autocast_stand_in=fn is own)
            meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
            assert all(isinstance(p, DTensor) for p in model.parameters())
            assert meshes == {("fsdp",)}, meshes
            runs[fn] = step(model)
            kept = gates(model)
    (seen, counts), (own_seen, own_counts) = runs.values()
    assert len(kept) == 2 and "_checkpoint_wrapped_module" in kept[0], kept  # torchtitan's AC
    assert all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    assert all(own_seen[n] == bf16 for n in kept), {n: own_seen[n] for n in kept}
    assert sorted(seen) == sorted(own_seen) and counts == own_counts, (counts, own_counts)


def _trainer_config(*extra: str) -> Any:
    from torchtitan.config.manager import ConfigManager

    args = ["--module", "qwen3", "--config", "qwen3_moe_debug", "--training.seq_len", str(SEQ),
            "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.spmd_backend", "partial_dtensor", *extra]  # fmt: skip
    return ConfigManager().parse_args(args)


def case_torchtitans_compile_step_adds_no_graph_break_for_kept_gates() -> None:
    """torchtitan's own compile step (``--compile.enable``, aot_eager: its ``apply_compile``
    compiles each block in ``parallelize_qwen3``, before the recipe's FSDP calls): the recipe's
    kept gates add no graph break to its own parallelize_qwen3 run (the plain policy), and are
    gathered in fp32 under compile."""
    from torch._dynamo.utils import counters

    config = _trainer_config("--compile.enable", "--compile.backend", "aot_eager",
                             "--compile.components", "model")  # fmt: skip
    assert config.compile.enable and config.compile.backend == "aot_eager"
    own = config.model_spec.parallelize_fn
    runs = {}
    for fn in (parallelize_qwen3_with_model_policy, own):
        config.model_spec = dataclasses.replace(
            config.model_spec, model=tiny_qwen3_moe_config(), parallelize_fn=fn
        )
        torch._dynamo.reset()
        counters.clear()
        with torchtitan_on_cpu(config.parallelism.spmd_backend):
            torch.manual_seed(0)
            model = build_as_the_trainer_does(config, autocast_stand_in=fn is own)
            seen, counts = step(model)
        compiled = [n for n, m in model.named_modules() if hasattr(m, "_compiled_call_impl")
                    and m._compiled_call_impl is not None]  # fmt: skip
        runs[fn] = (seen, counts, sum(counters["graph_break"].values()), compiled)
    (seen, counts, breaks, compiled), (own_seen, own_counts, own_breaks, _) = runs.values()
    assert len(compiled) == 2, compiled  # torchtitan compiled its two blocks
    kept = [n for n in seen if n.endswith("moe.router.gate.weight")]
    assert len(kept) == 2 and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(own_seen[n] == bf16 for n in kept)
    assert breaks == own_breaks and counts == own_counts, (breaks, own_breaks)


def case_torchtitans_float8_converter_with_kept_gates() -> None:
    """torchtitan's own ``Float8LinearConverter`` (emulated, as on a CPU; the gates filtered out,
    as its ``filter_fqns`` does): its Float8Linear layers train inside the recipe's units with
    the gates in fp32 and torchtitan's own collectives."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from torchtitan.components.quantization import Float8Linear, Float8LinearConverter

    converter = Float8LinearConverter(
        Float8LinearConverter.Config(emulate=True, filter_fqns=["router.gate"])
    )
    config = _trainer_config()
    own = config.model_spec.parallelize_fn
    runs = {}
    for fn in (parallelize_qwen3_with_model_policy, own):
        model_config = converter.convert(tiny_qwen3_moe_config())
        config.model_spec = dataclasses.replace(
            config.model_spec, model=model_config, parallelize_fn=fn
        )
        with torchtitan_on_cpu(config.parallelism.spmd_backend):
            torch.manual_seed(0)
            model = build_as_the_trainer_does(config, autocast_stand_in=fn is own)
            runs[fn] = step(model)
        float8_layers = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        assert len(float8_layers) >= 2 and not any("router" in n for n in float8_layers)
    (seen, counts), (own_seen, own_counts) = runs.values()
    kept = [n for n in seen if n.endswith("moe.router.gate.weight")]
    assert len(kept) == 2 and all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(own_seen[n] == bf16 for n in kept)
    assert counts == own_counts, (counts, own_counts)


def case_torchtitans_default_spmd_backend_cannot_run_here() -> None:
    """Why the wiring case sets partial_dtensor: under torchtitan 0.3.0's default
    "spmd_types", its own parallelize_qwen3 leaves plain tensors that this torch's
    fully_shard(dp_mesh_dims=...) refuses. If it starts working, drop the setting."""
    from torchtitan.config.manager import ConfigManager

    args = ["--module", "qwen3", "--config", "qwen3_moe_debug", "--training.seq_len", str(SEQ),
            "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    config = ConfigManager().parse_args(args)
    assert config.parallelism.spmd_backend == "spmd_types"
    config.model_spec = dataclasses.replace(config.model_spec, model=tiny_qwen3_moe_config())
    with torchtitan_on_cpu(config.parallelism.spmd_backend):
        with pytest.raises(ValueError, match=r"must be DTensors on the full SPMD mesh"):
            build_as_the_trainer_does(config, autocast_stand_in=True)
        # The recipe refuses it up front, naming the setting.
        config.model_spec = dataclasses.replace(
            config.model_spec, parallelize_fn=parallelize_qwen3_with_model_policy
        )
        with pytest.raises(
            ValueError, match=r"covers spmd_backend='partial_dtensor', got 'spmd_types'"
        ):
            build_as_the_trainer_does(config, autocast_stand_in=True)


def case_export_writes_torchtitans_names_with_the_gates_in_fp32() -> None:
    """``export_safetensors(model, dir, dtype=bf16)`` of the recipe's model: torchtitan's names
    (its state-dict hook splits the fused ``wqkv`` into ``wq``/``wk``/``wv``, new tensors no
    module holds: they leave in the bulk's bf16, as the fused parameter computed), the gates
    fp32, nothing else kept but the fp32 load-balancing buffers; a fresh model loads it and
    ``restore_kept`` installs the gates' boundary casts; torchtitan's adapter renames it for
    Hugging Face with the dtypes kept. Fails if the split tensors are taken for fp32 buffers."""
    from safetensors.torch import load_file
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from fsdp_precision.checkpoint import export_safetensors, read_export_record, restore_kept

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    model = tiny_qwen3_moe(autocast_stand_in=False)
    sum_reductions_for_gloo(parallelize_with_model_policy(model, mesh, RULES))
    step(model)
    where = [tempfile.mkdtemp(prefix="titan-export-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where)
    out = Path(where[0]) / "export"
    export_safetensors(model, out, dtype=bf16)
    kept = gates(model)
    if dist.get_rank() == 0:
        record = read_export_record(out)
        assert record.layout == "plain" and record.bulk == bf16, record
        reasons = {k.name: k.reason for k in record.kept}
        buffers = {n for n, why in reasons.items() if why.startswith("a buffer")}
        assert set(reasons) - buffers == set(kept), reasons
        assert all(n.endswith("moe.expert_bias_E") for n in buffers), buffers
        weights = load_file(out / "model.safetensors")
        split = [n for n in weights if ".qkv_linear.w" in n]
        assert len(split) == 6 and all(weights[n].dtype == bf16 for n in split), split
        assert all(weights[n].dtype == fp32 for n in kept)
        fresh = tiny_qwen3_moe_config().build()
        fresh.load_state_dict(weights, strict=False, assign=True)
        assert sorted(restore_kept(fresh, out)) == sorted(kept + list(buffers))
        casts = [n for n, m in fresh.named_modules() if installed_cast(m) is not None]
        assert casts == [
            "layers.0.moe.router",
            "layers.0.moe.router.gate",
            "layers.1.moe.router",
            "layers.1.moe.router.gate",
        ], casts
        hf = Qwen3StateDictAdapter(tiny_qwen3_moe_config(), None).to_hf(weights)
        assert hf["model.layers.0.mlp.gate.weight"].dtype == fp32
        assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == bf16
        assert hf["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == bf16
        shutil.rmtree(out.parent)


CASES = collect_cases(globals())

results, test_torchtitan = distributed_suite(2, __name__, CASES)


# --------------------------------------------------------------- the example, in fresh launches


def launch(*args: object) -> str:
    return run_example(_PATH, *args)


@pytest.mark.distributed
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_example_resumes_with_torchtitans_checkpointer_in_a_fresh_launch_bitwise(
    tmp_path: Path,
) -> None:
    """The example, as a user runs it: torchtitan's CheckpointManager saves every step; the
    same run stopped after step 2's checkpoint (a preemption), then launched again, resumes
    after step 2 and ends bitwise equal to the uninterrupted run: parameters, optimizer and LR
    scheduler state, losses; it exports and reloads (the example checks the logits). A save
    cut off before its ``.metadata`` (torchtitan's mark of a complete step) is skipped."""
    launch("--dir", str(tmp_path / "uninterrupted"), "--out", str(tmp_path / "uninterrupted.pt"))
    run = tmp_path / "preempted"
    assert "stopped after step 2's checkpoint" in launch("--dir", str(run), "--stop-after", "2")
    checkpoints = run / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2"]
    torn = checkpoints / "step-3"  # step 3's shards written, its .metadata not
    torn.mkdir()
    shutil.copy(checkpoints / "step-2" / "__0_0.distcp", torn / "__0_0.distcp")
    resumed = launch("--dir", str(run), "--out", str(tmp_path / "resumed.pt"))
    assert "(started after step 2)" in resumed and "reloaded with the trained logits" in resumed
    assert all((checkpoints / f"step-{n}" / ".metadata").is_file() for n in (3, 4))
    got = assert_same_final_state(tmp_path / "resumed.pt", tmp_path / "uninterrupted.pt")
    assert got["lr"] == {"last_epoch": 4}, got["lr"]
    assert any(n.endswith(".exp_avg_sq") for n in got["optim"])
    assert got["params"]["layers.0.moe.router.gate.weight"].dtype == fp32


def assert_same_final_state(path: Path, reference: Path) -> dict[str, Any]:
    """The example's ``--out`` files equal: losses (4 steps), LR scheduler state, parameters
    and optimizer state, bitwise. Returns the first."""
    got = torch.load(path, weights_only=True)
    ref = torch.load(reference, weights_only=True)
    assert got["losses"] == ref["losses"] and len(ref["losses"]) == 4, (got, ref)
    assert got["lr"] == ref["lr"], (got["lr"], ref["lr"])
    for key in ("params", "optim"):
        assert got[key].keys() == ref[key].keys() and got[key], key
        for name, value in got[key].items():
            other = ref[key][name]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, (key, name)
    return got
