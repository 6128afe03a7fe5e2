"""torchtitan at scale, with the real package, on 4 CPU ranks (gloo): expert parallelism (EP 2),
tensor parallelism (TP 2), and both, with the router gates kept in fp32.

Each mesh comes from torchtitan's own ``ConfigManager`` and ``ParallelDims`` (its degrees, its
``fsdp``/``efsdp``/``ep``/``tp`` meshes); the model is its Qwen3 MoE built small with
``update_from_config`` (which sets its EP token dispatch), and ``parallelize_qwen3`` applies
its own TP and EP. Three builds per mesh:

- the recipe (``examples/torchtitan_qwen3_moe.py``): its ``parallelize_fn`` with one
  ``model_policy``; under EP each MoE block is one unit of two parameter groups (the experts on
  ``efsdp`` through a ``ShardPlacementResult``, the rest on ``fsdp``), the gates kept in-unit;
- the reference: each gate its own fp32 unit, then torchtitan's own ``apply_fsdp_to_decoder``
  with the same ``ep_degree`` and ``edp_mesh`` (its EP branch);
- the negative control: torchtitan's own ``parallelize_qwen3`` (gates in bf16).

The recipe is bitwise the reference (loss, every gradient, the loss after an AdamW step), gathers
the gates in fp32 and the rest in bf16, hands only the gates an fp32 input (no activation leaks
into a bf16 sibling, NeMo Automodel #3657), and makes the plain layout's collectives. Under TP every
gradient all-reduce FSDP issues over the TP mesh in backward runs in fp32 (the reduce dtype);
torch's own, unpatched, runs them in bf16 (pytorch #190626) unless its release fixes it. CPU
stand-ins as in ``test_torchtitan.py``: SDPA for flex attention, a pre-hook for the router's CUDA
autocast where torchtitan's units run, SUM reductions for gloo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._releases import release_module
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.integrations.test_torchtitan import (
    SEQ,
    VOCAB,
    assert_same_final_state,
    cast_router_inputs,
    gates,
    recipe,
    separate_fp32_gate_units,
    sum_reductions_for_gloo,
    torchtitan_on_cpu,
)
from tests.support.harness import collect_cases, distributed_suite, run_example, unpatched

bf16, fp32 = torch.bfloat16, torch.float32

EP = ("--parallelism.expert_parallel_degree", "2")
TP = ("--parallelism.tensor_parallel_degree", "2")
MESHES: dict[str, tuple[str, ...]] = {"ep": EP, "tp": TP, "tp_ep": (*TP, *EP)}


def job_config(*degrees: str) -> Any:
    from torchtitan.config.manager import ConfigManager

    args = ["--module", "qwen3", "--config", "qwen3_moe_debug", "--training.seq_len", str(SEQ),
            "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs",
            *degrees]  # fmt: skip
    return ConfigManager().parse_args(args)


def build(config: Any, parallel_dims: Any, how: str) -> nn.Module:
    """torchtitan's tiny Qwen3 MoE (seed 0, real CPU weights), parallelized ``how``."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.qwen3 import parallelize_qwen3

    torch.manual_seed(0)
    model_config = recipe.tiny_qwen3_moe_config()
    model_config.update_from_config(config=config)  # TP checks, EP token dispatch
    model = model_config.build()
    model.init_states()
    kwargs = dict(parallel_dims=parallel_dims, training=config.training,
                  parallelism=config.parallelism, compile_config=config.compile,
                  ac_config=None, dump_folder="unused")  # fmt: skip
    if how == "recipe":
        recipe.parallelize_qwen3_with_model_policy(model, **kwargs)
    elif how == "plain":
        parallelize_qwen3(cast_router_inputs(model), **kwargs)
    else:  # separate fp32 gate units, then torchtitan's own apply_fsdp_to_decoder
        parallelize_qwen3(cast_router_inputs(model), skip_dp=True, **kwargs)
        dp_mesh, edp_mesh = recipe.titan_meshes(parallel_dims)
        separate_fp32_gate_units(model, dp_mesh)
        apply_fsdp_to_decoder(model, dp_mesh, param_dtype=bf16, reduce_dtype=fp32,
                              pp_enabled=False, ep_degree=parallel_dims.ep,
                              edp_mesh=edp_mesh)  # fmt: skip
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return sum_reductions_for_gloo(model)


def loss_of(model: nn.Module, tp: int, step: int = 0) -> torch.Tensor:
    """Next-token loss; the ranks of a TP group share their batch; the logits (sharded on the
    vocabulary under TP) whole."""
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank() // tp)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    logits = model(tokens[:, :-1])
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def train(model: nn.Module, tp: int) -> dict[str, Any]:
    """One AdamW step: losses, whole gradients, gathered dtypes, collectives in backward."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GatherProbe(model) as probe, input_dtypes(model) as inputs:
        loss = loss_of(model, tp)
        with CollectiveRecorder() as recorder:
            loss.backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    optim.step()
    with torch.no_grad():
        second = loss_of(model, tp, step=1)
    return {
        "losses": (loss.detach(), second),
        "grads": grads,
        "seen": {n: t.dtype for n, t in probe.seen.items()},
        "counts": (len(recorder.of("all_gather")), len(recorder.of("reduce_scatter"))),
        "tp_reduces": [c.dtype for c in recorder.of("all_reduce", functional=True)],
        "scatters": [(c.dtype, c.group_size) for c in recorder.of("reduce_scatter")],
        "inputs": inputs,
    }


@contextlib.contextmanager
def input_dtypes(model: nn.Module) -> Iterator[dict[str, set[torch.dtype]]]:
    """The dtypes of the floating inputs each module holding parameters receives."""
    seen: dict[str, set[torch.dtype]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    seen.setdefault(name, set()).add(value.dtype)

        return hook

    owners = [
        (n, m)
        for n, m in model.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    ]
    handles = [m.register_forward_pre_hook(record(n), with_kwargs=True) for n, m in owners]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def check_mesh(flags: tuple[str, ...]) -> None:
    config = job_config(*flags)
    with torchtitan_on_cpu(config.parallelism.spmd_backend):
        from torchtitan.distributed import ParallelDims

        dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
        assert (dims.ep, dims.tp) == (2 if EP[0] in flags else 1, 2 if TP[0] in flags else 1)
        model = build(config, dims, "recipe")
        ours = train(model, dims.tp)
        ref = train(build(config, dims, "reference"), dims.tp)
        with unpatched():  # torch's own FSDP2, torchtitan's own units
            plain = train(build(config, dims, "plain"), dims.tp)
    kept = gates(model)
    assert len(kept) == 2, kept
    # no dtype leaks across units (NeMo Automodel #3657): only the kept gates see fp32 inputs;
    # every other module (attention, norms, the experts on their own mesh, the head) bf16
    gate_modules = {n.rsplit(".", 1)[0] for n in kept}
    want = {n: {fp32 if n in gate_modules else bf16} for n in ours["inputs"]}
    assert ours["inputs"] == want == ref["inputs"], ours["inputs"]
    owners = {n.rsplit(".", 1)[0] for n in ours["seen"]}
    assert owners - set(want) == {"tok_embeddings"}, want  # its input: token ids
    assert all(plain["inputs"][n] == {bf16} for n in gate_modules), plain["inputs"]
    for layer in model.layers.values():  # under EP: one unit, two parameter groups
        meshes = {p.device_mesh.mesh_dim_names for p in layer.parameters()}
        assert len(meshes) == (2 if dims.ep > 1 else 1), meshes
    # bitwise the separate-units layout made by torchtitan's own apply_fsdp_to_decoder
    for got, want in zip((*ours["losses"], *ours["grads"].values()),
                         (*ref["losses"], *ref["grads"].values())):  # fmt: skip
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert list(ours["grads"]) == list(ref["grads"])
    # the gates gathered in fp32, the rest in bf16; the negative control gathers them in bf16
    assert all(ours["seen"][n] == fp32 for n in kept), ours["seen"]
    assert all(d == bf16 for n, d in ours["seen"].items() if n not in kept)
    assert all(plain["seen"][n] == bf16 for n in kept), plain["seen"]
    # keeping the gates in-unit costs no collective; the separate units cost three each
    assert ours["counts"] == plain["counts"], (ours["counts"], plain["counts"])
    n = len(kept)
    assert ref["counts"][1] == ours["counts"][1] + n, (ref["counts"], ours["counts"])
    # every gradient reduce-scatter in fp32, the experts' on their own (efsdp) group under EP
    # (VeOmni #1199: expert gradients stay fp32 through the EP layout's reduction)
    assert {dtype for dtype, _ in ours["scatters"]} == {fp32}, ours["scatters"]
    sizes = {size for _, size in ours["scatters"]}
    assert len(sizes) == (2 if dims.ep > 1 and dims.tp == 1 else 1), sizes
    if dims.tp > 1:  # every gradient all-reduce over the TP mesh in the reduce dtype
        assert ours["tp_reduces"] and set(ours["tp_reduces"]) == {fp32}, ours["tp_reduces"]
        assert set(ref["tp_reduces"]) == {fp32}, ref["tp_reduces"]
        fixed = release_module().TRAITS.reduces_partial_grads
        assert (bf16 in plain["tp_reduces"]) != fixed, plain["tp_reduces"]


def _mesh_case(flags: tuple[str, ...]) -> Any:
    def case() -> None:
        check_mesh(flags)

    return case


for _name, _flags in MESHES.items():
    globals()[f"case_{_name}_recipe_is_bitwise_torchtitans_own_units_with_kept_gates"] = _mesh_case(
        _flags
    )

CASES = collect_cases(globals())
assert len(CASES) == len(MESHES)

results, test_torchtitan_meshes = distributed_suite(4, __name__, CASES)


@pytest.mark.distributed
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_example_at_tp2_ep2_resumes_bitwise_in_a_fresh_launch(tmp_path: Path) -> None:
    """The example on 4 ranks with ``--tp 2 --ep 2`` (torchtitan's TP, its EP token dispatch,
    the experts' unit groups on ``efsdp``): stopped after step 2's checkpoint and launched
    again, it ends bitwise equal to the uninterrupted run (parameters, AdamW state, losses)
    with the gates in fp32, and exports and reloads."""
    degrees = ("--tp", 2, "--ep", 2)
    run_example(recipe.__file__, "--dir", tmp_path / "whole", "--out", tmp_path / "whole.pt",
                *degrees, nproc=4)  # fmt: skip
    stopped = run_example(recipe.__file__, "--dir", tmp_path / "cut", "--stop-after", 2,
                          *degrees, nproc=4)  # fmt: skip
    assert "stopped after step 2's checkpoint" in stopped
    resumed = run_example(recipe.__file__, "--dir", tmp_path / "cut", "--out",
                          tmp_path / "resumed.pt", *degrees, nproc=4)  # fmt: skip
    assert "(started after step 2)" in resumed and "reloaded with the trained logits" in resumed
    got = assert_same_final_state(tmp_path / "resumed.pt", tmp_path / "whole.pt")
    assert got["params"]["layers.0.moe.router.gate.weight"].dtype == fp32
    assert got["params"]["layers.0.moe.routed_experts.inner_experts.w1_EFD"].dtype == fp32
