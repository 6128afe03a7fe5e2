"""Exactness on the meshes people train at scale with, on 4 gloo ranks (CPU).

The model is the suite's MoE-style ``Net`` (pre-norm blocks with a router gate), tensor-parallel
the way torchtitan lays out its decoders: the norms under sequence parallelism, the MLP column-
then row-wise, the router gate replicated on the TP dim taking the sequence-sharded input (as
torchtitan's MoE router does), the head column-wise. Under that layout every parameter
replicated on the TP dim gets a ``Partial`` gradient there, which FSDP all-reduces over the TP
dim before its reduce-scatter (``FSDPParam._get_grad_inner_tensor``).

Each layout keeps the norms and gates in fp32 inside the bf16 units (``param_dtype_map``) and is
compared bitwise (outputs, gradients, parameters over AdamW steps) with the separate-units
layout (each kept module its own fp32 unit), on FSDP x TP (2 x 2), HSDP x TP (2 x 1 x 2), with
gradient accumulation and mixed storage, and for a per-parameter mesh (torchtitan's EP layout:
the experts on their own FSDP mesh through ``ShardPlacementResult``, two parameter groups in one
unit; skipped on 2.11, whose units hold one group), for pipeline stages
(``torch.distributed.pipelining``, GPipe on a pp 2 x dp 2 mesh, each stage its own units), and
across meshes (a checkpoint saved on FSDP, loaded on FSDP x TP and back). Context parallelism
cannot run on the CPU (its SDPA kernel has no sharding strategy): a case pins that.
``reduce_dtype`` on the TP dim: every all-reduce of a gradient in backward is recorded
(DTensor issues it through the functional collectives) and runs in the reduce dtype, and the
reduced gradient is the fp32 sum of the bf16 partials; torch's own function (the patch removed)
is the negative control: its all-reduce runs in bf16 (pytorch #190626) on releases without the
``reduces_partial_grads`` trait.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_precision import (
    Glob,
    Meshes,
    ParamDtypeMixedPrecisionPolicy,
    PrecisionPlan,
    PrecisionRules,
    compile_param_dtype_maps,
)
from fsdp_precision._releases import release_module
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite, unpatched
from tests.support.models import (
    FP32_CHILD,
    KEEP_IN_BLOCK,
    STD,
    Net,
    assert_same_grads,
    bf16,
    clones,
    fp32,
    loss_of,
    mixed_storage_net,
    net,
    train_in_lockstep,
)

TOKENS, DIM = 8, 16  # a batch flattened to tokens, sharded on dim 0 (the sequence) under TP

#: torchtitan's decoder layout, per block and for the tail.
BLOCK_PLAN = {
    "norm": SequenceParallel(sequence_dim=0),
    "gate": SequenceParallel(sequence_dim=0, use_local_output=True),
    "up": ColwiseParallel(input_layouts=Shard(0)),
    "down": RowwiseParallel(output_layouts=Shard(0)),
}
TAIL_PLAN = {
    "norm": SequenceParallel(sequence_dim=0),
    "head": ColwiseParallel(input_layouts=Shard(0)),
}
#: Parameters replicated on the TP dim with a Partial gradient there, per block and tail.
PARTIAL_IN_BLOCK = ("norm.weight", "norm.bias", "gate.weight")


def tensor_parallel(model: nn.Module, tp: DeviceMesh) -> nn.Module:
    for block in model.blocks:
        parallelize_module(block, tp, BLOCK_PLAN)
    parallelize_module(model, tp, TAIL_PLAN)
    return model


#: The layouts above as a model declares them (transformers' ``tp_plan``/``pp_plan`` form),
#: for the plan's mesh costs.
DECLARED_TP_PLAN = {
    "blocks.*.norm": "sequence_parallel",
    "blocks.*.gate": "sequence_parallel",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "norm": "sequence_parallel",
    "head": "colwise",
}


def planned_on(*, dp: int, depth: int = 2) -> PrecisionPlan:
    """The in-unit plan of a fresh Net (blocks, then the root) at FSDP degree ``dp``, the
    model declaring the TP plan above and ``blocks`` as its pipeline's module list."""
    model = net(dim=DIM, depth=depth)
    model.tp_plan, model.pp_plan = DECLARED_TP_PLAN, {"blocks": None}
    model.ep_plan = {"blocks.*.up": "grouped_gemm", "blocks.*.down": "grouped_gemm"}
    rules = PrecisionRules(
        rules=(Glob("*norm.weight"), Glob("*norm.bias"), Glob("*gate.weight")), advice="off"
    )
    units = [*model.blocks, model]
    return compile_param_dtype_maps(model, rules, units, world_size=dp)


def mapped(keys: tuple[str, ...], param_dtype: torch.dtype | None = bf16) -> MixedPrecisionPolicy:
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=fp32, param_dtype_map=dict.fromkeys(keys, fp32)
    )


def wrap_separate(model: nn.Module, dp: DeviceMesh, policy=STD, child=FP32_CHILD) -> nn.Module:
    """The reference: every kept module its own fp32 unit."""
    for block in model.blocks:
        fully_shard(block.norm, mesh=dp, mp_policy=child)
        fully_shard(block.gate, mesh=dp, mp_policy=child)
        fully_shard(block, mesh=dp, mp_policy=policy)
    fully_shard(model.norm, mesh=dp, mp_policy=child)
    fully_shard(model, mesh=dp, mp_policy=policy)
    return model


def wrap_mapped(model: nn.Module, dp: DeviceMesh, param_dtype=bf16) -> nn.Module:
    """Kept parameters in-unit: one unit per block and the root."""
    for block in model.blocks:
        fully_shard(block, mesh=dp, mp_policy=mapped(KEEP_IN_BLOCK, param_dtype))
    fully_shard(model, mesh=dp, mp_policy=mapped(("norm.weight", "norm.bias"), param_dtype))
    return model


def wrap_plain(model: nn.Module, dp: DeviceMesh) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=dp, mp_policy=STD)
    fully_shard(model, mesh=dp, mp_policy=STD)
    return model


def fsdp_tp() -> tuple[DeviceMesh, DeviceMesh]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def hsdp_tp() -> tuple[DeviceMesh, DeviceMesh]:
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    return mesh["replicate", "shard"], mesh["tp"]


def tp_inputs(tp: DeviceMesh, dtype: torch.dtype = fp32):
    """Each data-parallel group its own batch; its TP ranks hold the batch's sequence shards."""

    def make(step: int) -> torch.Tensor:
        group = dist.get_rank() // tp.size()
        g = torch.Generator().manual_seed(1000 * step + group)
        x = torch.randn(TOKENS, DIM, generator=g)
        return x.chunk(tp.size(), dim=0)[tp.get_local_rank()].to(dtype)

    return make


@contextlib.contextmanager
def partial_grads() -> Iterator[dict[str, torch.Tensor]]:
    """Each parameter's TP-Partial gradient (this rank's local bf16 summand), as FSDP receives
    it before reducing it, by FQN; only reads."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    seen: dict[str, torch.Tensor] = {}
    installed = FSDPParam.__dict__["_get_grad_inner_tensor"]

    def spy(self: FSDPParam, grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            seen[self._param_fqn] = grad.to_local().detach().clone()
        return installed(self, grad)

    FSDPParam._get_grad_inner_tensor = spy
    try:
        yield seen
    finally:
        FSDPParam._get_grad_inner_tensor = installed


def reduced_error(model: nn.Module, dp: DeviceMesh, tp: DeviceMesh) -> tuple[float, list]:
    """One backward on FSDP x TP: the worst relative error of a TP-Partial parameter's reduced
    gradient against the float64 sum of every rank's bf16 summand, and the gradient all-reduces
    (functional, in backward) with their dtypes."""
    x = tp_inputs(tp)(0)
    out = model(x)
    with CollectiveRecorder() as rec, partial_grads() as summands:
        loss_of(out).backward()
    assert summands, "no parameter had a Partial gradient: the layout did not run as meant"
    worst = 0.0
    for fqn, mine in sorted(summands.items()):
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        exact = torch.stack([t.double() for t in everyone]).sum(0) / dp.size()
        grad = dict(model.named_parameters())[fqn].grad
        assert isinstance(grad, DTensor)
        got = grad.full_tensor().double()
        worst = max(worst, ((got - exact).abs().max() / exact.abs().max()).item())
    return worst, rec.of("all_reduce", functional=True)


# --------------------------------------------------------------------------- cases


def case_tp_gradient_all_reduce_runs_in_the_reduce_dtype() -> None:
    """A plain (unmapped) policy on FSDP x TP: every gradient all-reduce on the TP dim in fp32,
    the result the fp32 sum of the bf16 partials; torch's own function as negative control."""
    base = net(dim=DIM)
    patched, plain = clones(base, 2)
    dp, tp = fsdp_tp()
    worst, reduces = reduced_error(wrap_plain(tensor_parallel(patched, tp), dp), dp, tp)
    partial_params = 2 * len(PARTIAL_IN_BLOCK) + 2  # per block, and the tail's norm
    assert len(reduces) == partial_params, reduces
    assert all(c.dtype == fp32 and c.group_size == tp.size() for c in reduces), reduces
    assert worst < 1e-6, worst  # fp32 rounding of the sum and the data-parallel mean

    with unpatched():
        worst_torch, reduces_torch = reduced_error(
            wrap_plain(tensor_parallel(plain, tp), dp), dp, tp
        )
    assert len(reduces_torch) == partial_params, reduces_torch
    if release_module().TRAITS.reduces_partial_grads:  # torch reduces them in fp32 itself
        assert all(c.dtype == fp32 for c in reduces_torch), reduces_torch
    else:  # pytorch #190626: the all-reduce runs in the compute dtype, losing bits
        assert all(c.dtype == bf16 for c in reduces_torch), reduces_torch
        assert worst_torch > 100 * max(worst, 1e-9), (worst_torch, worst)


def case_fsdp_x_tp_kept_in_unit_bitwise_separate_units() -> None:
    """Norms and gates kept in fp32 in-unit == each its own fp32 unit, over 3 AdamW steps; the
    kept parameters gathered in fp32, every TP gradient all-reduce in fp32."""
    dp, tp = fsdp_tp()
    ref, ours = (tensor_parallel(m, tp) for m in clones(net(dim=DIM), 2))
    wrap_separate(ref, dp)
    wrap_mapped(ours, dp)
    with GatherProbe(ours) as probe, CollectiveRecorder() as rec:
        train_in_lockstep([ref, ours], steps=3, make_input=tp_inputs(tp))
    for name, seen in probe.seen.items():
        kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
        assert seen.dtype == (fp32 if kept else bf16), (name, seen.dtype)
    reduces = rec.of("all_reduce", functional=True)
    assert reduces and all(c.dtype == fp32 for c in reduces), reduces
    # The in-unit layout issues the plain layout's FSDP collectives: one per unit and pass.
    with CollectiveRecorder() as rec_ours:
        loss_of(ours(tp_inputs(tp)(9))).backward()
    assert rec_ours.count("all_gather") == 5 and rec_ours.count("reduce_scatter") == 3
    # The plan predicts them, from the model's declared TP plan: counts and bytes per rank.
    [stage] = planned_on(dp=dp.size()).mesh_totals(Meshes(tp=2))["stages"]
    gathers, reduces = rec_ours.of("all_gather"), rec_ours.of("all_reduce", functional=True)
    assert stage["all_gathers_per_step"] == len(gathers), stage
    assert stage["reduce_scatters_per_step"] == rec_ours.count("reduce_scatter"), stage
    assert stage["all_gather_bytes_per_step"] == sum(c.output_bytes for c in gathers), stage
    assert stage["tp_all_reduces_per_step"] == len(reduces), stage
    assert stage["tp_all_reduce_bytes_per_step"] == sum(c.input_bytes for c in reduces), stage


def case_hsdp_x_tp_kept_in_unit_bitwise_separate_units() -> None:
    dp, tp = hsdp_tp()
    ref, ours = (tensor_parallel(m, tp) for m in clones(net(dim=DIM), 2))
    wrap_separate(ref, dp)
    wrap_mapped(ours, dp)
    with CollectiveRecorder() as rec:
        train_in_lockstep([ref, ours], steps=3, make_input=tp_inputs(tp))
    reduces = rec.of("all_reduce", functional=True)
    assert reduces and all(c.dtype == fp32 for c in reduces), reduces
    # HSDP's all-reduce over the replicate dim (FSDP's own) in the reduce dtype too.
    assert rec.of("all_reduce") and all(c.dtype == fp32 for c in rec.of("all_reduce"))


def case_tp_accumulation_without_sync_with_mixed_storage() -> None:
    """bf16 storage, kept parameters stored in fp32, 3 microbatches without sync: bitwise."""
    base = mixed_storage_net(dim=DIM)
    dp, tp = fsdp_tp()
    ref, ours = (tensor_parallel(m, tp) for m in clones(base, 2))
    wrap_separate(ref, dp, policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=fp32))
    wrap_mapped(ours, dp, param_dtype=None)
    make = tp_inputs(tp, bf16)
    for micro in range(3):
        for model in (ref, ours):
            model.set_requires_gradient_sync(micro == 2)
            loss_of(model(make(micro))).backward()
    assert_same_grads(ref, ours)
    for name, param in ours.named_parameters():
        kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
        assert param.dtype == (fp32 if kept else bf16), (name, param.dtype)
        assert param.grad is not None and param.grad.dtype == param.dtype, name


def experts_on_their_own_mesh(model: nn.Module) -> dict[str, object]:
    """torchtitan's EP layout (``apply_fsdp_to_decoder`` with ``ep_degree > 1``): each block's
    experts (here its MLP) sharded on the ``efsdp`` dim of an (ep, efsdp) mesh through
    ``ShardPlacementResult``, everything else on the 4-rank ``fsdp`` mesh: two parameter groups
    per block unit."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    edp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    on_dp = FSDPMeshInfo(dp, shard_mesh_dim=0)
    on_edp = FSDPMeshInfo(edp, shard_mesh_dim=0)
    experts = {
        p for block in model.blocks for p in (*block.up.parameters(), *block.down.parameters())
    }

    def placement(param: nn.Parameter) -> ShardPlacementResult:
        info = on_edp if param in experts else on_dp
        return ShardPlacementResult(placement=Shard(0), mesh_info=info)

    return {"mesh": dp, "shard_placement_fn": placement}


def ep_layouts(
    ref: Net, ours: Net, policy: MixedPrecisionPolicy, param_dtype: torch.dtype | None
) -> tuple[Net, Net]:
    """``ref`` in separate fp32 units, ``ours`` with the kept parameters in-unit, both in the
    EP layout (two parameter groups per block unit)."""
    layout = experts_on_their_own_mesh(ref)
    for block in ref.blocks:
        fully_shard(block.norm, mesh=layout["mesh"], mp_policy=FP32_CHILD)
        fully_shard(block.gate, mesh=layout["mesh"], mp_policy=FP32_CHILD)
        fully_shard(block, mp_policy=policy, **layout)
    fully_shard(ref.norm, mesh=layout["mesh"], mp_policy=FP32_CHILD)
    fully_shard(ref, mesh=layout["mesh"], mp_policy=policy)
    layout = experts_on_their_own_mesh(ours)
    for block in ours.blocks:
        fully_shard(block, mp_policy=mapped(KEEP_IN_BLOCK, param_dtype), **layout)
        assert len(block._get_fsdp_state()._fsdp_param_groups) == 2  # fsdp and efsdp
    tail = mapped(("norm.weight", "norm.bias"), param_dtype)
    fully_shard(ours, mesh=layout["mesh"], mp_policy=tail)
    return ref, ours


def case_per_parameter_mesh_kept_in_unit_bitwise_separate_units() -> None:
    """torchtitan's EP layout: the block unit holds two parameter groups (experts on efsdp,
    the rest on fsdp); norms and gates kept in-unit == separate fp32 units, over 3 steps."""
    if not release_module().TRAITS.param_group_list:
        pytest.skip(
            "torch 2.11's FSDP holds one parameter group per unit (no ShardPlacementResult)"
        )
    ref, ours = ep_layouts(*clones(net(dim=DIM), 2), STD, bf16)
    with GatherProbe(ours) as probe:
        train_in_lockstep([ref, ours], steps=3, make_input=lambda s: tp_inputs_flat(s))
    for name, seen in probe.seen.items():
        kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
        assert seen.dtype == (fp32 if kept else bf16), (name, seen.dtype)
    experts = dict(ours.named_parameters())["blocks.0.up.weight"]
    assert isinstance(experts, DTensor) and experts.device_mesh.size() == 2
    # The plan predicts the two groups' collectives from the model's declared EP plan (the
    # experts here are whole on each EP rank, so their bytes are not the plan's 1/ep).
    with CollectiveRecorder() as rec:
        loss_of(ours(tp_inputs_flat(9))).backward()
    [stage] = planned_on(dp=4).mesh_totals(Meshes(ep=2))["stages"]
    assert stage["all_gathers_per_step"] == rec.count("all_gather") == 9, stage
    assert stage["reduce_scatters_per_step"] == rec.count("reduce_scatter") == 5, stage
    sizes = sorted(c.group_size for c in rec.of("reduce_scatter"))
    assert sizes == [2, 2, 4, 4, 4], sizes  # the experts' on efsdp (dp * tp / ep = 2)


def case_per_parameter_mesh_accumulation_without_sync_with_mixed_storage() -> None:
    """torchtitan's EP layout with bf16 storage, the kept norms and gates stored in fp32, and 3
    microbatches without sync: both parameter groups of each block reduce once, bitwise the
    separate units, every gradient in its parameter's dtype (VeOmni #1199, NeMo #3540)."""
    if not release_module().TRAITS.param_group_list:
        pytest.skip(
            "torch 2.11's FSDP holds one parameter group per unit (no ShardPlacementResult)"
        )
    base = mixed_storage_net(dim=DIM)
    storage = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=fp32)
    ref, ours = ep_layouts(*clones(base, 2), storage, None)
    with CollectiveRecorder() as rec:
        for micro in range(3):
            for model in (ref, ours):
                model.set_requires_gradient_sync(micro == 2)
                loss_of(model(tp_inputs_flat(micro).to(bf16))).backward()
    assert_same_grads(ref, ours)
    assert {c.dtype for c in rec.of("reduce_scatter")} == {fp32}, rec.of("reduce_scatter")
    for name, param in ours.named_parameters():
        kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
        assert param.dtype == (fp32 if kept else bf16), (name, param.dtype)
        assert param.grad is not None and param.grad.dtype == param.dtype, name


def tp_inputs_flat(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(TOKENS, DIM, generator=g)


def shared_dir() -> str:
    name = [tempfile.mkdtemp(prefix="meshes-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def whole(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment, whole (gathered over whatever mesh holds it)."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.detach().full_tensor()
        for key, value in optim.state[param].items():
            if isinstance(value, DTensor):
                out[f"{name}.{key}"] = value.full_tensor()
    return out


def case_checkpoint_saved_on_fsdp_loads_on_fsdp_x_tp() -> None:
    """Saved from the in-unit layout on a 4-rank FSDP mesh, loaded into the same layout on
    FSDP x TP (and back): every parameter and optimizer moment bitwise, kept ones in fp32."""
    from fsdp_precision.checkpoint import load_checkpoint, save_checkpoint

    source, dest, back = clones(net(dim=DIM), 3)
    wrap_mapped(source, init_device_mesh("cpu", (4,)))
    dp, tp = fsdp_tp()
    wrap_mapped(tensor_parallel(dest, tp), dp)
    wrap_mapped(back, init_device_mesh("cpu", (4,)))
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (source, dest, back)]
    loss_of(source(tp_inputs_flat(0))).backward()
    optims[0].step()
    for model, optim in ((dest, optims[1]), (back, optims[2])):  # the state exists to load into
        loss_of(model(tp_inputs(tp)(5) if model is dest else tp_inputs_flat(5))).backward()
        optim.step()
        optim.zero_grad()
    root = shared_dir()
    save_checkpoint(f"{root}/on-fsdp", source, optims[0])
    load_checkpoint(f"{root}/on-fsdp", dest, optims[1])
    expected = whole(source, optims[0])
    for name, tensor in whole(dest, optims[1]).items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    kept = dict(dest.named_parameters())["blocks.0.gate.weight"]
    assert kept.dtype == fp32 and kept.device_mesh.ndim == 2
    save_checkpoint(f"{root}/on-tp", dest, optims[1])
    load_checkpoint(f"{root}/on-tp", back, optims[2])
    for name, tensor in whole(back, optims[2]).items():
        assert torch.equal(tensor, expected[name]), name
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)


def pipeline_stage(model: Net, stage: int, stages: int) -> Net:
    """Stage ``stage`` of ``stages`` of a Net, as torchtitan splits a decoder: its share of the
    blocks, the tail (norm, head) on the last stage only."""
    per = len(model.blocks) // stages
    model.blocks = model.blocks[stage * per : (stage + 1) * per]
    if stage != stages - 1:
        model.norm, model.head = nn.Identity(), nn.Identity()  # type: ignore[assignment]
    return model


def wrap_stage(model: Net, dp: DeviceMesh, separate: bool) -> Net:
    """A stage's units: each block, the root (the tail's norm kept where the stage has it)."""
    tail_norm = isinstance(model.norm, nn.LayerNorm)
    for block in model.blocks:
        if separate:
            fully_shard(block.norm, mesh=dp, mp_policy=FP32_CHILD)
            fully_shard(block.gate, mesh=dp, mp_policy=FP32_CHILD)
        fully_shard(block, mesh=dp, mp_policy=STD if separate else mapped(KEEP_IN_BLOCK))
    if separate and tail_norm:
        fully_shard(model.norm, mesh=dp, mp_policy=FP32_CHILD)
    root = mapped(("norm.weight", "norm.bias") if tail_norm else ())
    fully_shard(model, mesh=dp, mp_policy=STD if separate else root)
    return model


def case_pipeline_stages_kept_in_unit_bitwise_separate_units() -> None:
    """Pipeline parallelism (``torch.distributed.pipelining``, GPipe, 2 microbatches) over a
    (pp 2, dp 2) mesh, each stage FSDP-sharded with its own units: kept in-unit == separate
    fp32 units, losses and gradients bitwise over 3 AdamW steps, the kept parameters gathered
    in fp32 on both stages."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    stage = pp.get_local_rank()
    last = stage == pp.size() - 1
    base = pipeline_stage(net(dim=DIM, depth=4), stage, pp.size())
    ref, ours = wrap_stage(clones(base, 2)[0], dp, True), wrap_stage(clones(base, 2)[1], dp, False)
    schedules = [
        ScheduleGPipe(
            PipelineStage(m, stage, pp.size(), torch.device("cpu"), group=pp.get_group()),
            n_microbatches=2,
            loss_fn=lambda y, target: loss_of(y),
        )
        for m in (ref, ours)
    ]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + dp.get_local_rank())
        x, target = torch.randn(TOKENS, DIM, generator=g), torch.zeros(TOKENS, DIM)
        losses: list[list[torch.Tensor]] = [[], []]
        with GatherProbe(ours) as probe:
            for schedule, out in zip(schedules, losses):
                if last:
                    schedule.step(target=target, losses=out)
                else:
                    schedule.step(x)
        for name, seen in probe.seen.items():
            kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
            assert seen.dtype == (fp32 if kept else bf16), (name, seen.dtype)
        assert any(n.endswith("gate.weight") for n in probe.seen), probe.seen
        if last:
            assert len(losses[0]) == 2 and all(
                torch.equal(a, b) for a, b in zip(*losses, strict=True)
            ), losses
        assert_same_grads(ref, ours)
        for opt in optims:
            opt.step()
            opt.zero_grad()


def case_context_parallel_cannot_run_on_cpu() -> None:
    """Why no CP case runs here: torch's ``context_parallel`` shards SDPA's sequence, and the
    CPU's SDPA kernel has no sharding strategy (CUDA's flash and efficient kernels have). If
    this starts working, add the CP case (docs/parallelisms.md)."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel

    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    x, qkv = torch.randn(1, 8, DIM), nn.Linear(DIM, 3 * DIM)
    with context_parallel(cp, buffers=[x], buffer_seq_dims=[1]):
        q, k, v = (t.unflatten(-1, (2, DIM // 2)).transpose(1, 2) for t in qkv(x).chunk(3, -1))
        with pytest.raises(NotImplementedError, match=r"flash_attention_for_cpu"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)


CASES = collect_cases(globals())

results, test_four_ranks = distributed_suite(4, __name__, CASES)
