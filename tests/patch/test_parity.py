"""Bitwise parity and observed collectives on 2 ranks (gloo, CPU).

Every case runs on every rank of one spawned process group; see ``_harness``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from fsdp_precision import ParamDtypeMixedPrecisionPolicy
from fsdp_precision.testing import CollectiveRecorder, GatherProbe

from tests.support.harness import collect_cases, distributed_suite, unpatched
from tests.support.models import (
    FP32_CHILD,
    KEEP_IN_BLOCK,
    STD,
    assert_same_grads,
    bf16,
    clones,
    fp32,
    inputs,
    local,
    loss_of,
    mixed_storage_net,
    net,
    train_in_lockstep,
)


def mapped(keys: tuple[str, ...], param_dtype=bf16, reduce_dtype=fp32, dtype=fp32):
    return ParamDtypeMixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        param_dtype_map={k: dtype for k in keys},
    )


def wrap_children(model: nn.Module, policy=STD, child=FP32_CHILD, **kw) -> nn.Module:
    """Reference: every kept module is its own fp32 unit (the public-API workaround)."""
    for block in model.blocks:
        fully_shard(block.norm, mp_policy=child, **kw)
        fully_shard(block.gate, mp_policy=child, **kw)
        fully_shard(block, mp_policy=policy, **kw)
    fully_shard(model.norm, mp_policy=child, **kw)
    fully_shard(model, mp_policy=policy, **kw)
    return model


def wrap_mapped(model: nn.Module, param_dtype=bf16, **kw) -> nn.Module:
    """One unit per block and the root; kept parameters mapped to fp32 by exact FQN."""
    for block in model.blocks:
        fully_shard(block, mp_policy=mapped(KEEP_IN_BLOCK, param_dtype), **kw)
    fully_shard(model, mp_policy=mapped(("norm.weight", "norm.bias"), param_dtype), **kw)
    return model


def trace(model: nn.Module, steps: int = 2) -> tuple[list[torch.Tensor], list[tuple]]:
    """Outputs, grads and params of a short run, plus the collectives it issued."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record: list[torch.Tensor] = []
    with CollectiveRecorder() as rec:
        for step in range(steps):
            out = model(inputs(step))
            loss_of(out).backward()
            record.append(out.detach().clone())
            record += [local(p.grad).clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            record += [local(p).detach().clone() for p in model.parameters()]
    return record, [(c.kind, c.dtype, c.input_bytes) for c in rec.calls]


def assert_same_trace(a, b) -> None:
    (ta, ca), (tb, cb) = a, b
    assert ca == cb, f"collectives differ:\n{ca}\n{cb}"
    assert len(ta) == len(tb)
    for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"tensor {i} differs"


# --------------------------------------------------------------------------- cases


def case_upstream_paths_bitwise_identical() -> None:
    """Unpatched, patched+standard policy, patched+all-param_dtype map, patched+empty map."""
    base = net()
    a, b, c, d = clones(base, 4)
    with unpatched():
        for block in a.blocks:
            fully_shard(block, mp_policy=STD)
        fully_shard(a, mp_policy=STD)
        reference = trace(a)
    for block in b.blocks:
        fully_shard(block, mp_policy=STD)
    fully_shard(b, mp_policy=STD)
    assert_same_trace(reference, trace(b))
    for block in c.blocks:
        names = tuple(n for n, _ in block.named_parameters())
        fully_shard(block, mp_policy=mapped(names, dtype=bf16))
    root_names = tuple(n for n, _ in c.named_parameters() if not n.startswith("blocks."))
    fully_shard(c, mp_policy=mapped(root_names, dtype=bf16))
    assert_same_trace(reference, trace(c))
    empty = ParamDtypeMixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    for block in d.blocks:
        fully_shard(block, mp_policy=empty)
    fully_shard(d, mp_policy=empty)
    assert_same_trace(reference, trace(d))


def case_map_matches_fp32_child_units() -> None:
    """One bf16 unit with fp32-mapped FQNs == explicit fp32 child units, over optimizer steps."""
    ref, ours = clones(net(), 2)
    wrap_children(ref)
    wrap_mapped(ours)
    with GatherProbe(ours) as probe:
        train_in_lockstep([ref, ours], steps=3)
    for name, seen in probe.seen.items():
        kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
        assert seen.dtype == (fp32 if kept else bf16), (name, seen.dtype)
        assert not seen.sharded, name
    # Fewer collectives: the kept modules do not need units of their own.
    with CollectiveRecorder() as rec_ref:
        loss_of(ref(inputs(9))).backward()
    with CollectiveRecorder() as rec_ours:
        loss_of(ours(inputs(9))).backward()
    assert rec_ours.count("all_gather") == 5, rec_ours.calls  # 2 blocks x 2 + root
    assert rec_ours.count("reduce_scatter") == 3, rec_ours.calls
    # + norm and gate units per block (fwd and bwd each) + the root's norm unit (fwd and bwd)
    assert rec_ref.count("all_gather") == 5 + 2 * 2 * 2 + 2, rec_ref.calls
    assert rec_ref.count("reduce_scatter") == 3 + 2 * 2 + 1, rec_ref.calls


def case_mixed_storage_in_one_unit() -> None:
    """A bf16-stored model whose kept parameters are stored in fp32: no extra unit needed."""
    base = mixed_storage_net()
    ref, ours = clones(base, 2)
    wrap_children(ref, policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=fp32))
    wrap_mapped(ours, param_dtype=None)
    train_in_lockstep([ref, ours], steps=3, make_input=lambda s: inputs(s).to(bf16))
    loss_of(ours(inputs(7).to(bf16))).backward()
    for name, param in ours.named_parameters():
        kept = name.endswith(KEEP_IN_BLOCK) or name.startswith("norm.")
        assert param.dtype == (fp32 if kept else bf16), (name, param.dtype)
        assert param.grad.dtype == param.dtype, name


def grouped_layernorms(**mesh: Any) -> None:
    """fully_shard([block0.norm, block1.norm]) with key "weight" reaching both LayerNorms,
    trained 3 steps in lockstep with a unit per norm: bitwise. ``mesh``: ``mesh=`` for every
    call (4 ranks: ``tests/patch/test_dtype_matrix.py``)."""
    ref, ours = clones(net(), 2)
    for block in ref.blocks:
        fully_shard(block.norm, mp_policy=FP32_CHILD, **mesh)
    norms = [block.norm for block in ours.blocks]
    fully_shard(norms, mp_policy=mapped(("weight", "bias")), **mesh)
    for model in (ref, ours):
        for block in model.blocks:
            fully_shard(block, mp_policy=STD, **mesh)
        fully_shard(model, mp_policy=STD, **mesh)
    with GatherProbe(ours) as probe:
        train_in_lockstep([ref, ours], steps=3)
    for i in range(2):
        for leaf in ("weight", "bias"):
            assert probe.seen[f"blocks.{i}.norm.{leaf}"].dtype == fp32
    assert probe.seen["blocks.0.up.weight"].dtype == bf16


def case_grouped_layernorms() -> None:
    grouped_layernorms()


class Primes(nn.Module):
    """Prime dim-0 sizes (uneven sharding, FSDP pads dim 0) and scale vectors of several dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(7, 97)
        self.norm = nn.LayerNorm(97)
        self.lin2 = nn.Linear(97, 101)
        self.lin3 = nn.Linear(101, 103)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 103))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin3(self.lin2(self.norm(self.lin1(x))))
        return y * self.scale.to(y.dtype)


PRIME_MAP = {
    "norm.weight": fp32,
    "norm.bias": fp32,
    "scale": torch.float64,
    "lin3.bias": bf16,  # equal to param_dtype: a no-op entry
}


def case_prehooks_see_exact_fqn_dtype_shape_numel_and_padded_bytes() -> None:
    torch.manual_seed(0)
    model = Primes()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    prime_map = PRIME_MAP
    policy = ParamDtypeMixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=fp32, param_dtype_map=prime_map
    )
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)
    x = torch.randn(3, 7)
    with GatherProbe(model) as probe, CollectiveRecorder() as rec:
        loss_of(model(x)).backward()
    assert set(probe.seen) == set(shapes)
    for name, seen in probe.seen.items():
        assert seen.dtype == prime_map.get(name, bf16), (name, seen.dtype)
        assert seen.shape == shapes[name] and seen.numel == torch.Size(shapes[name]).numel()
        assert not seen.sharded
    world = torch.distributed.get_world_size()
    expected = 0
    for name, shape in shapes.items():
        dim0 = -(-shape[0] // world) * world  # FSDP's dim-0 padding, nothing more
        numel = dim0 * torch.Size(shape[1:]).numel()
        expected += numel * prime_map.get(name, bf16).itemsize
    gathers = rec.of("all_gather")
    assert len(gathers) == 2, gathers  # forward, and backward after resharding
    for gather in gathers:
        assert gather.dtype == torch.uint8  # mixed dtypes travel as bytes
        assert gather.output_bytes == expected, (gather.output_bytes, expected)
    (rs,) = rec.of("reduce_scatter")
    assert rs.dtype == fp32


def case_reshard_after_forward_on_and_off() -> None:
    for reshard, gathers in ((True, 6), (False, 3)):  # the root too, when set explicitly
        ref, ours = clones(net(), 2)
        wrap_children(ref, reshard_after_forward=reshard)
        wrap_mapped(ours, reshard_after_forward=reshard)
        train_in_lockstep([ref, ours], steps=2)
        with CollectiveRecorder() as rec:
            loss_of(ours(inputs(5))).backward()
        assert rec.count("all_gather") == gathers, (reshard, rec.calls)


def case_mixed_inference_and_training_passes() -> None:
    """no_grad forwards interleaved with training steps: same dtypes, same results."""
    ref, ours = clones(net(), 2)
    wrap_children(ref)
    wrap_mapped(ours)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        with torch.no_grad():
            evals = [m(inputs(100 + step)) for m in (ref, ours)]
        assert torch.equal(evals[0], evals[1]), step
        outs = [m(inputs(step)) for m in (ref, ours)]
        with torch.no_grad():  # a forward between forward and backward
            again = [m(inputs(200 + step)) for m in (ref, ours)]
        assert torch.equal(again[0], again[1]), step
        for out in outs:
            loss_of(out).backward()
        assert_same_grads(ref, ours)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    with GatherProbe(ours) as probe, torch.no_grad():
        ours(inputs(9))
    assert probe.seen["blocks.0.gate.weight"].dtype == fp32
    assert probe.seen["blocks.0.up.weight"].dtype == bf16


def case_gradient_accumulation_without_sync() -> None:
    ref, ours = clones(net(), 2)
    wrap_children(ref)
    wrap_mapped(ours)
    for micro in range(3):
        sync = micro == 2
        for model in (ref, ours):
            model.set_requires_gradient_sync(sync)
            loss_of(model(inputs(micro))).backward()
    assert_same_grads(ref, ours)
    for name, param in ours.named_parameters():
        assert param.grad.dtype == fp32, name


def prefetching(model: nn.Module) -> nn.Module:
    """Explicit prefetch (verl's seed): each block's unit gathers the next in its forward and
    the previous in its backward."""
    blocks = list(model.blocks)
    for current, following in zip(blocks, blocks[1:], strict=False):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])
    assert blocks[0]._get_fsdp_state()._states_to_forward_prefetch  # it took
    return model


def case_forward_prefetch_on_and_off() -> None:
    """The in-unit map is bitwise the separate-units reference with explicit forward and
    backward prefetch and without, and prefetching changes no number."""
    ref, ours, ref_prefetch, ours_prefetch = clones(net(depth=3), 4)
    wrap_children(ref)
    wrap_mapped(ours)
    prefetching(wrap_children(ref_prefetch))
    prefetching(wrap_mapped(ours_prefetch))
    train_in_lockstep([ref, ours, ref_prefetch, ours_prefetch], steps=2)


def case_cpu_offload_policy() -> None:
    ref, ours = clones(net(), 2)
    offload = CPUOffloadPolicy(pin_memory=False)
    wrap_children(ref, offload_policy=offload)
    wrap_mapped(ours, offload_policy=offload)
    train_in_lockstep([ref, ours], steps=2)


class SkipGate(nn.Module):
    """A block whose router may be skipped, and a model whose first block may be detached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.gate = nn.Linear(16, 16, bias=False)
        self.use_gate = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x).detach()  # "first" never receives a gradient
        h = self.norm(x)
        if self.use_gate:
            h = h + self.gate(h.to(self.gate.weight.dtype)).to(h.dtype)
        return h


def case_empty_gradients() -> None:
    ref, ours = SkipGate(), SkipGate()
    ours.load_state_dict(ref.state_dict())
    fully_shard(ref.first, mp_policy=STD)
    fully_shard(ref.norm, mp_policy=FP32_CHILD)
    fully_shard(ref.gate, mp_policy=FP32_CHILD)
    fully_shard(ref, mp_policy=STD)
    fully_shard(ours.first, mp_policy=STD)
    fully_shard(ours, mp_policy=mapped(("norm.weight", "norm.bias", "gate.weight")))
    for use_gate in (False, True):
        for model in (ref, ours):
            model.use_gate = use_gate
            model.zero_grad()
            loss_of(model(inputs(0))).backward()
        assert_same_grads(ref, ours)
        assert (ours.gate.weight.grad is None) == (not use_gate)
        assert ours.first.weight.grad is None


def case_negative_control_unpatched() -> None:
    """Without the patch: mixed storage fails as upstream does; a map is silently ignored."""
    base = net()
    base.blocks[0].to(bf16)
    base.blocks[0].norm.float()
    with unpatched():
        fully_shard(base.blocks[0], mp_policy=mapped(KEEP_IN_BLOCK, param_dtype=None))
        with pytest.raises(AssertionError, match="uniform original parameter dtype"):
            base.blocks[0](inputs(0).to(bf16))
    model = net()
    with unpatched():
        fully_shard(model, mp_policy=mapped(("norm.weight",)))
        with GatherProbe(model) as probe:
            model(inputs(0))
    # What the probe would report as a failure: the fp32 request was dropped.
    assert probe.seen["norm.weight"].dtype == bf16


def case_negative_control_first_dtype_gather() -> None:
    """torch's own all-gather copy-in put back: a third dtype (fp16 in a bf16 unit) is gathered
    in the first parameter's dtype, as upstream's foreach-copy fast path does on every release."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    from fsdp_precision._patch import registry as _install

    upstream = _install.original(coll, "_get_param_all_gather_inputs")
    patched = coll._get_param_all_gather_inputs
    for swapped in (False, True):
        model = net()
        fully_shard(model, mp_policy=mapped(("blocks.0.gate.weight",), dtype=torch.float16))
        coll._get_param_all_gather_inputs = upstream if swapped else patched
        try:
            with GatherProbe(model) as probe:
                model(inputs(0))
        finally:
            coll._get_param_all_gather_inputs = patched
        seen = probe.seen["blocks.0.gate.weight"].dtype
        assert seen == (bf16 if swapped else torch.float16), (swapped, seen)


CASES = collect_cases(globals())

results, test_two_ranks = distributed_suite(2, __name__, CASES)
