"""DistributedConfig, size-based units and wrap_model_for_training on CPU (gloo)."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision import (
    DistributedConfig,
    Glob,
    ModuleClass,
    PrecisionPlan,
    PrecisionRules,
    auto_wrap_units,
    compile_param_dtype_maps,
    make_grad_scaler,
    plan_model_for_training,
    wrap_model_for_training,
)
from fsdp_precision.checkpoint import load_checkpoint, save_checkpoint

from tests.support.harness import collect_cases, distributed_suite
from tests.support.models import (
    Net,
    assert_same_params,
    bf16,
    clones,
    fp16,
    fp32,
    inputs,
    local,
    loss_of,
    net,
    train_in_lockstep,
)

# No boundary casts: the comparison is the hand-written mapped wrap of tests/patch/test_parity,
# whose per-call maps cast no activations (boundary casts: tests/policy/test_casts.py).
KEEP = (
    Glob("*norm.weight", boundary="none"),
    Glob("*norm.bias", boundary="none"),
    Glob("*gate.weight", boundary="none"),
)

# ---------------------------------------------------------------------- config


BAD_CONFIGS = [
    (
        {"parallel_strategy": "zero3"},
        r"parallel_strategy is 'zero3'; use 'none', 'ddp', 'fsdp' or 'hsdp'",
    ),
    (
        {"fsdp_mixed_precision": "int8"},
        r"fsdp_mixed_precision is 'int8'; use 'fp32', 'bf16', 'fp16' or a PrecisionRules\(...\)",
    ),
    (
        {"fsdp_auto_wrap_min_params": -1},
        r"fsdp_auto_wrap_min_params is -1; use a non-negative integer",
    ),
    ({"fsdp_auto_wrap_min_params": 1.5}, r"fsdp_auto_wrap_min_params is 1.5; use a non-negative"),
    ({"fsdp_cpu_offload": "yes"}, r"fsdp_cpu_offload is 'yes'; use True or False"),
    (
        {"parallel_strategy": "hsdp"},
        r"hsdp_replicate_size is None; 'hsdp' needs a positive replica count",
    ),
    (
        {"hsdp_replicate_size": 2},
        r"hsdp_replicate_size is 2; it applies to parallel_strategy='hsdp' only",
    ),
    ({"fsdp_layout": "split"}, r"fsdp_layout is 'split'; use 'in_unit' or 'separate_units'"),
    (
        {"fsdp_auto_wrap_policy": "blocks"},
        r"fsdp_auto_wrap_policy is 'blocks'; use 'size' or 'transformer_block'",
    ),
    (
        {"fsdp_auto_wrap_policy": "transformer_block", "fsdp_transformer_block_classes": "Block"},
        r"fsdp_transformer_block_classes is 'Block'; use a tuple of class names",
    ),
    (
        {"fsdp_transformer_block_classes": ("Block",)},
        r"fsdp_transformer_block_classes is \('Block',\); it applies to "
        r"fsdp_auto_wrap_policy='transformer_block' only",
    ),
    ({"compile_units": "max"}, r"compile_units is 'max'; use 'off', 'inductor' or 'aot_eager'"),
    (
        {"compile_units": "inductor", "parallel_strategy": "ddp"},
        r"compile_units is 'inductor'; it compiles FSDP units, and parallel_strategy='ddp' makes "
        r"none; compile the model yourself",
    ),
    (
        {"compile_fullgraph": True},
        r"compile_fullgraph is True; it applies with compile_units='inductor' or 'aot_eager'",
    ),
    ({"compile_fullgraph": 1}, r"compile_fullgraph is 1; use True or False"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_CONFIGS)
def test_config_rejects_bad_values(kwargs, message) -> None:
    with pytest.raises(ValueError, match=r"DistributedConfig\." + message):
        DistributedConfig(**kwargs)


def test_config_is_keyword_only_and_presets_expand() -> None:
    with pytest.raises(TypeError):
        DistributedConfig("fsdp")  # type: ignore[misc]
    assert DistributedConfig().fsdp_auto_wrap_min_params == 10_000_000
    for preset, (param, reduce) in {
        "bf16": (bf16, fp32),
        "fp16": (fp16, fp32),
        "fp32": (None, None),
    }.items():
        rules = DistributedConfig(fsdp_mixed_precision=preset).precision()
        assert (rules.param_dtype, rules.reduce_dtype) == (param, reduce)
    rules = PrecisionRules(rules=(ModuleClass(nn.LayerNorm),))
    assert DistributedConfig(fsdp_mixed_precision=rules).precision() is rules
    assert rules.describe() == (
        "default bfloat16, reduce float32; rules: class LayerNorm -> float32, "
        "then model keep-in-fp32 declarations"
    )


DEPRECATED_CONFIGS = [
    # (0.1 spelling, what it means now, the new spelling the warning names)
    (
        {"precision_rules": (ModuleClass(nn.LayerNorm),)},
        {"fsdp_mixed_precision": PrecisionRules(rules=(ModuleClass(nn.LayerNorm),))},
        r"fsdp_mixed_precision=PrecisionRules\(rules=\(...\)\)",
    ),
    (
        {"fsdp_mixed_precision": "fp16", "hf_keep_in_fp32": False},
        {"fsdp_mixed_precision": PrecisionRules(param_dtype=fp16, hf_keep_in_fp32=False)},
        r"fsdp_mixed_precision=PrecisionRules\(hf_keep_in_fp32=...\)",
    ),
    (
        {"precision_strategy": "split"},
        {"fsdp_layout": "separate_units"},
        r"fsdp_layout='in_unit' or 'separate_units'",
    ),
]


@pytest.mark.parametrize(("old", "new", "message"), DEPRECATED_CONFIGS)
def test_deprecated_config_fields_still_work_and_name_the_new_spelling(old, new, message) -> None:
    with pytest.warns(DeprecationWarning, match=r"is deprecated: use " + message):
        config = DistributedConfig(**old)
    expected = DistributedConfig(**new)
    assert config.precision() == expected.precision()
    assert config.fsdp_layout == expected.fsdp_layout


def test_deprecated_config_fields_are_still_validated() -> None:
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            ValueError, match=r"precision_rules\[0\] is '\*norm'; use Glob\(...\) or ModuleClass"
        ),
    ):
        DistributedConfig(precision_rules=("*norm",))  # type: ignore[arg-type]
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            ValueError, match=r"cannot be combined with fsdp_mixed_precision=PrecisionRules"
        ),
    ):
        DistributedConfig(fsdp_mixed_precision=PrecisionRules(), hf_keep_in_fp32=False)


# ---------------------------------------------------------------------- units


def names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    lookup = {id(m): n or "<root>" for n, m in model.named_modules()}
    return [lookup[id(u)] for u in units]


@pytest.mark.parametrize(
    ("min_params", "expected"),
    [
        (2_000_000, ["<root>"]),
        (905, ["<root>"]),  # blocks are 904 each; the ModuleList is never a unit
        (904, ["blocks.0", "blocks.1", "<root>"]),
        (401, ["blocks.0.up", "blocks.0", "blocks.1.up", "blocks.1", "<root>"]),
        (
            0,
            [
                "blocks.0.norm",
                "blocks.0.up",
                "blocks.0.down",
                "blocks.0.gate",
                "blocks.1.norm",
                "blocks.1.up",
                "blocks.1.down",
                "blocks.1.gate",
                "norm",
                "head",
                "<root>",
            ],
        ),
    ],
)
def test_size_based_units(min_params: int, expected: list[str]) -> None:
    model = Net()
    assert names(model, auto_wrap_units(model, min_params)) == expected


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def test_no_split_blocks_and_ties_are_respected() -> None:
    pytest.importorskip("transformers")
    model = tiny_llama()
    units = names(model, auto_wrap_units(model, 0))
    assert units == ["model.layers.0", "model.layers.1", "model.norm", "<root>"]
    # embed_tokens and lm_head share one parameter: neither may be a unit of its own.
    assert "model.embed_tokens" not in units and "lm_head" not in units


class Stem(nn.Module):
    """An fp32-kept norm fed an fp32 tensor computed inside the forward (like Wan's timestep
    features reaching its fp32 time_embedder), after the root cast its inputs to bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.cos(x.float())  # fp32 by construction
        return self.lin(self.pre(features).to(self.lin.weight.dtype))


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("force_cast", [False, True], ids=["planned", "negative_control"])
def test_all_kept_unit_computes_in_its_kept_dtype(force_cast: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = DistributedConfig(
        fsdp_auto_wrap_min_params=0,
        fsdp_mixed_precision=PrecisionRules(rules=(ModuleClass(nn.LayerNorm),)),
    )
    model = Stem()
    plan = plan_model_for_training(model, config)
    pre_unit = plan.units[0]
    # a unit of fp32: its inputs cast to fp32 (not to the root's bf16), its output back to bf16
    assert pre_unit.name == "pre" and pre_unit.policy.param_dtype == fp32
    assert (pre_unit.policy.cast_forward_inputs, pre_unit.policy.output_dtype) == (True, bf16)
    assert plan.units[-1].policy.cast_forward_inputs is True
    if force_cast:  # what a unit policy with cast_forward_inputs=True would do
        forced = replace(pre_unit, policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
        plan = replace(plan, units=(forced, *plan.units[1:]))
    seen: list[torch.dtype] = []
    model.pre.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    plan.apply()
    model(torch.randn(2, 8)).float().sum().backward()
    assert seen == [bf16 if force_cast else fp32]


def test_outside_a_process_group_says_what_to_do() -> None:
    code = (
        "from fsdp_precision import DistributedConfig, wrap_model_for_training\n"
        "import torch\n"
        "wrap_model_for_training(torch.nn.Linear(2, 2), DistributedConfig())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "parallel_strategy='fsdp' needs a process group, and none is initialized" in out.stderr
    assert "torchrun --nproc_per_node N" in out.stderr


@pytest.mark.usefixtures("world1")
def test_fsdp_on_one_rank_trains() -> None:
    model = wrap_model_for_training(
        net(),
        DistributedConfig(
            fsdp_auto_wrap_min_params=900, fsdp_mixed_precision=PrecisionRules(rules=KEEP)
        ),
    )
    assert isinstance(model.blocks[0].up.weight, DTensor)
    loss_of(model(inputs(0))).backward()
    assert model.blocks[0].gate.weight.grad.dtype == fp32


def test_none_strategy_returns_the_model_untouched() -> None:
    model = Net()
    assert wrap_model_for_training(model, DistributedConfig(parallel_strategy="none")) is model


def test_meta_model_without_state_dict_is_refused(world1: None) -> None:
    with torch.device("meta"):
        model = Net()
    with pytest.raises(ValueError, match=r"meta device but no full_state_dict was given"):
        wrap_model_for_training(model, DistributedConfig(fsdp_auto_wrap_min_params=500))


# ---------------------------------------------------------------------- distributed cases


def case_fsdp_matches_manual_mapped_wrap() -> None:
    from tests.patch.test_parity import wrap_mapped

    ours, manual = clones(net(), 2)
    config = DistributedConfig(
        fsdp_auto_wrap_min_params=900, fsdp_mixed_precision=PrecisionRules(rules=KEEP)
    )
    wrap_model_for_training(ours, config)
    wrap_mapped(manual)
    train_in_lockstep([ours, manual], steps=2)
    assert isinstance(ours.blocks[0].up.weight, DTensor)
    assert ours.blocks[0].up.weight.device_mesh.shape == (dist.get_world_size(),)


def recorded_step(model: nn.Module) -> tuple[int, int, int]:
    """(all-gathers, reduce-scatters, all-reduces) of one forward+backward, after a first one
    (which also lazily initialises FSDP)."""
    from fsdp_precision.testing import CollectiveRecorder

    loss_of(model(inputs(0))).backward()
    with CollectiveRecorder() as rec:
        loss_of(model(inputs(1))).backward()
    return rec.count("all_gather"), rec.count("reduce_scatter"), rec.count("all_reduce")


def planned_step(totals: dict[str, int]) -> tuple[int, int, int]:
    return (
        totals["all_gathers_per_step"],
        totals["reduce_scatters_per_step"],
        totals["all_reduces_per_step"],
    )


#: reshard_after_forward as fully_shard takes it: None (every unit but the root), True (the root
#: too), False (none); on 2 ranks the integer 1 means False and 2 means True.
RESHARD = [None, True, False, 1, 2]


def compiled(model: nn.Module, reshard: bool | int | None) -> PrecisionPlan:
    return compile_param_dtype_maps(
        model,
        PrecisionRules(rules=KEEP),
        auto_wrap_units(model, 900),
        world_size=dist.get_world_size(),
        reshard_after_forward=reshard,
    )


def case_collectives_follow_reshard_after_forward() -> None:
    gathers = []
    for reshard in RESHARD:
        model = net()
        plan = compiled(model, reshard)
        planned = planned_step(plan.totals())
        plan.apply()
        assert recorded_step(model) == planned, (reshard, planned)
        gathers.append(planned[0])
    # The knob changes the counts (the root's backward all-gather, then every unit's).
    units = len(plan.units)
    assert gathers == [2 * units - 1, 2 * units, units, units, 2 * units]


def case_wrap_logs_the_collectives_it_makes() -> None:
    for reshard in (True, False):
        model = net()
        config = DistributedConfig(
            fsdp_auto_wrap_min_params=900,
            fsdp_mixed_precision=PrecisionRules(rules=KEEP),
            fsdp_reshard_after_forward=reshard,
        )
        plan = plan_model_for_training(model, config)
        assert plan.reshard_after_forward is (None if reshard else False)
        wrap_model_for_training(model, config)
        assert recorded_step(model) == planned_step(plan.totals()), reshard


def case_alternatives_count_the_separate_units_step() -> None:
    from fsdp_precision.testing import wrap_separate_units

    for reshard in RESHARD:
        model = net()
        plan = compiled(model, reshard)
        separate = plan.alternatives()["separate_units"]
        reference = wrap_separate_units(copy.deepcopy(model), plan)
        assert recorded_step(reference) == planned_step(separate), (reshard, separate)
        assert separate["units"] == plan.totals()["units"] + 5  # norm and gate per block, norm


def case_apply_refuses_knobs_the_plan_does_not_count() -> None:
    model = net()
    plan = compiled(model, None)
    with pytest.raises(
        ValueError,
        match=r"reshard_after_forward=False contradicts the plan's reshard_after_forward=None",
    ):
        plan.apply(reshard_after_forward=False)
    assert not isinstance(model.head.weight, DTensor)  # nothing was wrapped


def offloaded_units(model: torch.nn.Module) -> list[bool]:
    """Per unit, whether FSDP offloads its parameters (torch's state: the unit's params)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[attr-defined]
                found += [p.offload_to_cpu for p in group.fsdp_params]
    return found


def case_cpu_offload_is_applied_and_its_checkpoint_round_trips() -> None:
    """``fsdp_cpu_offload=True`` reaches every unit (asserted from FSDP's state, not inferred
    from the numbers, which match on a CPU machine either way), its sharded parameters live on
    the CPU, and a sharded checkpoint of the offloaded model loads back bitwise into another."""
    config = DistributedConfig(
        fsdp_auto_wrap_min_params=900,
        fsdp_mixed_precision=PrecisionRules(rules=KEEP),
        fsdp_cpu_offload=True,
    )
    plain = wrap_model_for_training(net(), replace(config, fsdp_cpu_offload=False))
    assert offloaded_units(plain) and not any(offloaded_units(plain))  # the negative control
    model = wrap_model_for_training(net(), config)
    flags = offloaded_units(model)
    assert len(flags) == len(list(model.parameters())) and all(flags), flags
    assert all(local(p).device.type == "cpu" for p in model.parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model(inputs(0))).backward()
    optim.step()
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    try:
        save_checkpoint(Path(where[0]) / "ckpt", model, optim)
        other = wrap_model_for_training(net(seed=7), config)
        other_optim = torch.optim.AdamW(other.parameters(), lr=1e-2)
        load_checkpoint(Path(where[0]) / "ckpt", other, other_optim)
        assert_same_params(model, other)
        assert all(offloaded_units(other))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)


def case_cpu_offload_trains_like_no_offload() -> None:
    a, b = clones(net(), 2)
    wrap_model_for_training(
        a,
        DistributedConfig(
            fsdp_auto_wrap_min_params=900, fsdp_mixed_precision=PrecisionRules(rules=KEEP)
        ),
    )
    wrap_model_for_training(
        b,
        DistributedConfig(
            fsdp_auto_wrap_min_params=900,
            fsdp_mixed_precision=PrecisionRules(rules=KEEP),
            fsdp_cpu_offload=True,
        ),
    )
    train_in_lockstep([a, b], steps=2)


def case_ddp_wraps_and_averages() -> None:
    model = wrap_model_for_training(net(), DistributedConfig(parallel_strategy="ddp"))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    loss_of(model(inputs(0))).backward()
    grad = model.module.head.weight.grad
    gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grad)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def case_meta_init_from_rank0_full_state_dict() -> None:
    torch.manual_seed(dist.get_rank())  # ranks would disagree if anything were re-initialized
    reference = net(seed=123)
    full = reference.state_dict() if dist.get_rank() == 0 else {}
    with torch.device("meta"):
        model = Net()
    wrap_model_for_training(
        model, DistributedConfig(fsdp_auto_wrap_min_params=900), full_state_dict=full
    )
    expected = net(seed=123).state_dict()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and not param.is_meta, name
        assert torch.equal(param.full_tensor(), expected[name]), name
        assert local(param).numel() <= -(-expected[name].shape[0] // dist.get_world_size()) * max(
            1, expected[name][0].numel()
        )
    loss_of(model(inputs(0))).backward()


def case_fp16_scaler_skips_on_every_rank_after_one_overflows() -> None:
    config = DistributedConfig(
        fsdp_mixed_precision=PrecisionRules(param_dtype=fp16, rules=KEEP),
        fsdp_auto_wrap_min_params=900,
    )
    model = wrap_model_for_training(net(), config)
    scaler = make_grad_scaler(config, init_scale=2.0**8)
    assert make_grad_scaler(DistributedConfig()) is None
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [local(p).clone() for p in model.parameters()]
    scaler.scale(loss_of(model(inputs(0)))).backward()
    if dist.get_rank() == 1:
        local(model.head.weight.grad)[0, 0] = float("inf")  # overflow on one rank only
    scaler.step(optim)
    scaler.update()
    assert all(torch.equal(b, local(p)) for b, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7
    optim.zero_grad()
    scaler.scale(loss_of(model(inputs(1)))).backward()  # a clean step applies
    scaler.step(optim)
    scaler.update()
    assert not all(torch.equal(b, local(p)) for b, p in zip(before, model.parameters()))


CASES = collect_cases(globals())

results, test_two_ranks = distributed_suite(2, __name__, CASES)
