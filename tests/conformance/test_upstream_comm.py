"""PyTorch's own FSDP2 collective tests, ported to gloo/CPU, with kept parameters in every unit.

Ported from ``test/distributed/_composable/fsdp/test_fully_shard_comm.py``
(``_test_communication_count``, ``test_manual_reshard_with_reshard_after_forward_false``,
``_test_set_reshard_after_forward_by_communication_count``,
``_test_set_reduce_scatter_divide_factor_mixed_prevision``,
``_test_set_reduce_scatter_max_input_buffers``), and the seed's adversarial grouped call: a
tied parameter shared by two modules of one ``fully_shard([...])`` call under HSDP 2x2.

Upstream's counts are the contract: a unit whose kept norms and router gather in fp32 beside
bf16 weights still issues exactly one all-gather and one reduce-scatter, in every
``reshard_after_forward`` mode. Each count is checked on the plain ``MixedPrecisionPolicy``
layout too (``kind="upstream"``), so a count that changed with the release fails both. Every
case runs on spawned gloo ranks and on threads, with the patch and on torch alone
(``conformance_suites``); on torch alone only the upstream layout, and the cases that exist for
what only the library does say so and skip.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_precision as fp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe, wrap_separate_units

from tests.conformance.kinds import kinds as policy_kinds
from tests.conformance.kinds import policy
from tests.conformance.test_upstream_ported import MLP, check_sharded_parity
from tests.patch.test_parity import STD, wrap_children, wrap_mapped
from tests.support.harness import collect_cases, conformance_suites, seeded
from tests.support.models import (
    bf16,
    clones,
    fp32,
    inputs,
    local,
    net,
    train_in_lockstep,
)

DEPTH = 3
UNITS = DEPTH + 1  # the blocks and the root


def wrap(kind: str, **kw: object) -> nn.Module:
    """``net(depth=3)`` with one unit per block and the root: upstream's uniform policy, or
    the kept norms and routers mapped to fp32 inside the same units."""
    model = net(depth=DEPTH)
    if kind == "kept":
        return wrap_mapped(model, **kw)
    for block in model.blocks:
        fully_shard(block, mp_policy=STD, **kw)  # type: ignore[arg-type]
    fully_shard(model, mp_policy=STD, **kw)  # type: ignore[arg-type]
    return model


def step_counts(
    model: nn.Module, dtype: torch.dtype = fp32
) -> tuple[CollectiveRecorder, CollectiveRecorder]:
    x = inputs(0).to(dtype)
    with CollectiveRecorder() as fwd:
        loss = model(x).float().pow(2).mean()
    with CollectiveRecorder() as bwd:
        loss.backward()
    return fwd, bwd


def kinds(rec: CollectiveRecorder) -> set[str]:
    return {c.kind for c in rec.calls}


def layouts() -> tuple[str, ...]:
    """Upstream's uniform layout; under the patch also the kept one."""
    return ("upstream", "kept") if fp.is_param_dtype_map_patch_applied() else ("upstream",)


def needs_the_patch() -> None:
    if not fp.is_param_dtype_map_patch_applied():
        pytest.skip("kept parameters inside a unit: the library's own behaviour, not torch's")


def case_communication_count() -> None:
    """``_test_communication_count``: ``units`` all-gathers forward; backward re-gathers
    every resharded unit (the root is not resharded with ``None``, none is with ``False``);
    one reduce-scatter per unit; nothing else."""
    for raf in (True, False, 2, None):
        for kind in layouts():
            kw = {} if raf is None else {"reshard_after_forward": raf}
            fwd, bwd = step_counts(wrap(kind, **kw))
            where = f"{kind}, reshard_after_forward={raf}"
            assert kinds(fwd) == {"all_gather"} and fwd.count("all_gather") == UNITS, where
            regathered = {None: DEPTH, True: UNITS, 2: UNITS, False: 0}[raf]
            assert bwd.count("all_gather") == regathered, where
            assert bwd.count("reduce_scatter") == UNITS, where
            assert kinds(bwd) <= {"all_gather", "reduce_scatter"}, where
    # Negative control: the public-API workaround (each kept module its own unit) issues more.
    if not fp.is_param_dtype_map_patch_applied():
        return
    fwd, bwd = step_counts(wrap_children(net(depth=DEPTH)))
    extra = 2 * DEPTH + 1  # every block's norm and gate, the final norm
    assert fwd.count("all_gather") == bwd.count("reduce_scatter") == UNITS + extra


def case_communication_count_with_mixed_storage() -> None:
    """A bf16-stored model whose kept parameters are stored in fp32 (``param_dtype=None``):
    each unit's gradients are fp32 and bf16 at once and still take one reduce-scatter (the
    mixed reduce packs them), as many as the uniform layout."""
    needs_the_patch()
    model = net(depth=DEPTH).to(bf16)
    for module in (*[m for b in model.blocks for m in (b.norm, b.gate)], model.norm):
        module.float()
    wrap_mapped(model, param_dtype=None)
    fwd, bwd = step_counts(model, dtype=bf16)
    assert fwd.count("all_gather") == UNITS
    assert bwd.count("reduce_scatter") == UNITS and kinds(bwd) <= {"all_gather", "reduce_scatter"}
    grads = {n: p.grad.dtype for n, p in model.named_parameters()}  # type: ignore[union-attr]
    assert grads["blocks.0.gate.weight"] == fp32 and grads["blocks.0.up.weight"] == bf16


def case_manual_reshard_with_reshard_after_forward_false() -> None:
    """Units built with ``reshard_after_forward=False``, resharded by hand after forward,
    gather again in backward: ``units`` all-gathers each way, ``units`` reduce-scatters."""
    for kind in layouts():
        model = wrap(kind, reshard_after_forward=False)
        x = inputs(0)
        with CollectiveRecorder() as fwd:
            loss = model(x).float().pow(2).mean()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        with CollectiveRecorder() as bwd:
            loss.backward()
        assert fwd.count("all_gather") == UNITS, kind
        assert bwd.count("all_gather") == UNITS and bwd.count("reduce_scatter") == UNITS, kind


def case_set_reshard_after_forward() -> None:
    """``_test_set_reshard_after_forward_by_communication_count``: ``set_reshard_after_forward``
    on the root, recursively or not, gives the counts the constructor argument gives."""
    for setting in (True, False):
        for recurse in (True, False):
            for kind in layouts():
                model = wrap(kind, reshard_after_forward=not setting)
                model.set_reshard_after_forward(setting, recurse=recurse)  # type: ignore[operator]
                fwd, bwd = step_counts(model)
                where = f"{kind}, set {setting}, recurse={recurse}"
                assert fwd.count("all_gather") == UNITS, where
                if setting:
                    assert bwd.count("all_gather") == (UNITS if recurse else 1), where
                else:
                    assert bwd.count("all_gather") == (0 if recurse else DEPTH), where
                assert bwd.count("reduce_scatter") == UNITS, where


def case_set_gradient_divide_factor_mixed_precision() -> None:
    """``_test_set_reduce_scatter_divide_factor_mixed_prevision``: bf16 compute, fp32 reduce,
    a divide factor of the world size, against a replicated bf16 model reduced by hand; with
    upstream's policy and with the patched one mapping every parameter (the same semantics)."""
    world = dist.get_world_size()
    for kind in policy_kinds():
        with seeded(42):
            model = nn.Sequential(*[MLP(16) for _ in range(3)])
        ref_model = copy.deepcopy(model)
        ref_model_bf16 = copy.deepcopy(ref_model).to(bf16)
        ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        for module in (*model, model):
            fully_shard(module, mp_policy=policy(kind, module, model, bf16, fp32))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.set_gradient_divide_factor(float(world))  # type: ignore[operator]
        with seeded(42 + dist.get_rank()):
            inp = torch.randn((4, 16), dtype=bf16)
        for _ in range(4):
            loss = model(inp).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            ref_loss = ref_model_bf16(inp).sum()
            ref_loss.backward()
            for param in ref_model_bf16.parameters():
                param.grad.data = param.grad.to(fp32)  # type: ignore[union-attr]
                param.grad.mul_(1.0 / world)  # type: ignore[union-attr]
                dist.all_reduce(param.grad)  # type: ignore[arg-type]
            for p32, p16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
                p32.grad, p16.grad = p16.grad, None
            ref_optim.step()
            for p32, p16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
                p16.detach().copy_(p32)
            ref_optim.zero_grad()
            torch.testing.assert_close(loss, ref_loss)
            check_sharded_parity(ref_model, model)


def divide(model: nn.Module, factor: float, force_sum: bool = False) -> nn.Module:
    """The factor on every unit (``set_gradient_divide_factor`` sets the called unit's only)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(force_sum)
    return model


def case_set_gradient_divide_factor_with_kept_parameters() -> None:
    """A factor on kept units and on the separate-units reference: bitwise; and the factor
    took (twice the world size halves every gradient, exactly in fp32; gloo has no
    ``PREMUL_SUM``, so that one reduces by sum with FSDP's own pre- and post-division)."""
    needs_the_patch()
    world = dist.get_world_size()
    ref, ours, whole, halved = clones(net(depth=DEPTH), 4)
    divide(wrap_children(ref), world)
    divide(wrap_mapped(ours), world)
    train_in_lockstep([ref, ours], steps=2)
    divide(wrap_mapped(whole), world)
    divide(wrap_mapped(halved), 2 * world, force_sum=True)
    for model in (whole, halved):
        model(inputs(5)).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(whole.named_parameters(), halved.named_parameters()):
        assert torch.equal(local(a.grad) / 2, local(b.grad)), name


def case_set_reduce_scatter_max_input_buffers() -> None:
    """``_test_set_reduce_scatter_max_input_buffers``: more reduce-scatter input buffers in
    flight is a scheduling change only: kept units train bitwise like the default, under FSDP
    and HSDP, resharding after forward or not."""
    needs_the_patch()
    if not hasattr(FSDPModule, "set_reduce_scatter_max_input_buffers"):
        return  # added in torch 2.13; the releases before have one buffer
    world = dist.get_world_size()
    for shape in ((world,), (world // 2, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        for raf in (True, False):
            for buffers in (1, 2):
                default, ours = clones(net(depth=DEPTH), 2)
                kw = {"mesh": mesh, "reshard_after_forward": raf}
                wrap_mapped(default, **kw)
                wrap_mapped(ours, **kw).set_reduce_scatter_max_input_buffers(buffers)  # type: ignore[operator]
                train_in_lockstep([default, ours], steps=2)


class SharedGroup(nn.Module):
    """An embedding tied to the output head, and a bf16 projection, grouped in one call."""

    def __init__(self) -> None:
        super().__init__()
        with seeded(0):
            self.emb = nn.Embedding(32, 16)
            self.proj = nn.Linear(16, 16)
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.emb(ids).to(self.proj.weight.dtype))
        h = self.body(h.to(self.body.weight.dtype))
        return self.head(h.to(self.head.weight.dtype)).float()


def case_tied_parameter_in_a_grouped_call_under_hsdp() -> None:
    """The adversarial case: ``fully_shard([emb, proj, head])`` over HSDP 2x2 where ``emb`` and
    ``head`` share one weight, kept in fp32 beside bf16 ``proj`` in the same group. Both
    aliases gather the one fp32 weight, the group issues one all-gather, and two AdamW steps are
    bitwise the separate-units layout."""
    needs_the_patch()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours = SharedGroup()
    rules = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob("emb.weight"),))
    plan = fp.compile_param_dtype_maps(
        ours, rules, [[ours.emb, ours.proj, ours.head], ours.body, ours], world_size=2, hsdp=True
    )
    # The reference: the kept pair its own fp32 call, proj its own bf16 one (separate units
    # cannot put bf16 proj in the kept pair's call; under HSDP 2x2 the gradients still agree
    # bitwise: two shard ranks' sums do not depend on order).
    reference = copy.deepcopy(ours)
    separate = fp.compile_param_dtype_maps(
        reference,
        rules,
        [[reference.emb, reference.head], reference.proj, reference.body, reference],
        world_size=2,
        hsdp=True,
    )
    wrap_separate_units(reference, separate, mesh=mesh)
    plan.apply(mesh=mesh)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank() % 2))
    with GatherProbe(ours) as probe, CollectiveRecorder() as rec:
        ours(ids)
    assert probe.seen["emb.weight"].dtype == fp32 and probe.seen["head.weight"].dtype == fp32
    assert probe.seen["proj.weight"].dtype == bf16
    assert rec.count("all_gather") == 2  # the group and body; the root manages nothing
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, ours)]
    for _ in range(2):
        outs = [m(ids) for m in (reference, ours)]
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.pow(2).mean().backward()
        for (name, a), (_, b) in zip(reference.named_parameters(), ours.named_parameters()):
            assert torch.equal(local(a.grad), local(b.grad)), name
        for opt in optims:
            opt.step()
            opt.zero_grad()
    assert ours.head.weight is ours.emb.weight


CASES = collect_cases(globals())

#: The grid cases whose threaded runs are in the opt-in tier (``-m slow``): each runs on spawned
#: ranks by default, and the other cases run on threads there too.
SLOW_THREADS = [
    "case_communication_count",
    "case_set_gradient_divide_factor_mixed_precision",
    "case_set_reduce_scatter_max_input_buffers",
]

globals().update(conformance_suites(4, __name__, CASES, compare=False, slow_threads=SLOW_THREADS))
