"""pytorch's FSDP2 precision reports, reproduced on 2 gloo ranks (docs/known-issues.md).

#172074: before 2.15 ``fully_shard`` drops a parameter's ``Tensor.grad_dtype`` (fp32 gradients
asked of a bf16 parameter come out bf16); the construction wrap refuses it, naming the fix, where
the release's ``keeps_grad_dtype`` trait says torch drops it.

#198668: a block applied twice per forward (several gradient contributions per backward) under
accumulation without sync: the in-unit map is bitwise the separate-units layout.

#196996: with ``reduce_dtype=fp32`` and accumulation without sync, a parameter first reached on
the last microbatch of the window (an expert no earlier token reached) brings a fresh bf16
gradient beside the fp32 accumulated ones of its unit, and torch's reduce-scatter asserts
("reduce-scatter expects uniform gradient dtype") on 2.11-2.14. Every unit the library's
policy or plan reaches takes them: each layout below survives, in bf16 and in fp32 storage, and
matches the same run reduced every microbatch (fp32 storage: to summation order; bf16 storage:
bitwise the fp32 run's gradients rounded to bf16). Torch alone asserts where the release's
``mixed_dtype_reduce`` trait says it does (the negative control, and the trait that notices
the fix: 2.15 reduces mixed gradient dtypes itself).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision._releases import release_module

from tests.patch.test_parity import wrap_children, wrap_mapped
from tests.support.harness import collect_cases, distributed_suite, unpatched
from tests.support.models import Net, assert_same_grads, clones, inputs, local, loss_of
from tests.support.moe import EXPERTS, RULES, bf16, fp32, hash_moe, microbatches

LATE = 3  # the expert first reached on the window's last microbatch


def by_policy(model: nn.Module) -> None:
    """One model_policy for every call (as accelerate, the Trainer and TRL make them): the
    experts' unit keeps nothing, the block's keeps its gate."""
    policy = fp.model_policy(model, RULES)
    for block in model.blocks:
        fully_shard(block.moe, mp_policy=policy)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def units(model: nn.Module) -> list[nn.Module]:
    return [m for b in model.blocks for m in (b.moe, b)] + [model]


def by_plan(model: nn.Module) -> None:
    fp.compile_param_dtype_maps(model, RULES, units(model)).apply()


def by_separate_units(model: nn.Module) -> None:
    """The public-API layout the library plans: each gate its own fp32 unit; no unit is mapped."""
    plan = fp.compile_param_dtype_maps(model, RULES, units(model), layout="separate_units")
    assert not any(u.param_dtype_map for u in plan.units)
    plan.apply()


def by_wrap(model: nn.Module) -> None:
    config = fp.DistributedConfig(
        fsdp_mixed_precision=RULES,
        fsdp_auto_wrap_policy="transformer_block",
        fsdp_transformer_block_classes=("Experts", "Block"),
    )
    fp.wrap_model_for_training(model, config)


LAYOUTS: dict[str, Callable[[nn.Module], None]] = {
    "model_policy": by_policy,
    "plan": by_plan,
    "separate_units": by_separate_units,
    "wrap_model_for_training": by_wrap,
}


def window_grads(
    wrap: Callable[[nn.Module], None], dtype: torch.dtype, *, sync_every: bool
) -> dict[str, torch.Tensor]:
    """The full gradients after one accumulation window of 3 microbatches."""
    model = hash_moe(dtype)
    wrap(model)
    batches = microbatches(LATE, seed=1 + dist.get_rank())
    for i, ids in enumerate(batches):
        model.set_requires_gradient_sync(sync_every or i == len(batches) - 1)
        model(ids, labels=ids.roll(1))["loss"].backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.full_tensor()
    return grads


def check_layout(name: str) -> None:
    wrap = LAYOUTS[name]
    ours32 = window_grads(wrap, fp32, sync_every=False)
    late = f"blocks.0.moe.experts.{LATE}.up.weight"
    assert late in ours32 and ours32[late].abs().sum() > 0, sorted(ours32)
    assert "aux_head.weight" not in ours32  # unused: no gradient, no zeros
    reference = window_grads(wrap, fp32, sync_every=True)
    assert ours32.keys() == reference.keys(), sorted(ours32.keys() ^ reference.keys())
    for key, grad in ours32.items():
        assert grad.dtype == fp32, key
        torch.testing.assert_close(grad, reference[key], rtol=1e-5, atol=1e-7, msg=key)
    ours16 = window_grads(wrap, bf16, sync_every=False)
    for key, grad in ours16.items():
        kept = key.endswith("gate.weight")
        # the gates are kept wider than stored: upcast, fp32 everywhere; the rest bf16
        assert grad.dtype == (fp32 if kept else bf16), (key, grad.dtype)
        assert torch.equal(grad, ours32[key].to(grad.dtype)), key


def case_196996_model_policy() -> None:
    check_layout("model_policy")


def case_196996_plan() -> None:
    check_layout("plan")


def case_196996_separate_units() -> None:
    """No unit of this plan is mapped; applying it installs the patch for the reduce alone."""
    with unpatched():
        check_layout("separate_units")
        assert fp.is_param_dtype_map_patch_applied()


def case_196996_wrap_model_for_training() -> None:
    check_layout("wrap_model_for_training")


def by_hand(model: nn.Module) -> None:
    """The public-API workaround built by hand, plain torch policies: each gate its own
    ``param_dtype=None`` unit. With the patch installed (no map needed) its units take the
    window too."""
    plain = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    for block in model.blocks:
        fully_shard(block.gate, mp_policy=MixedPrecisionPolicy(reduce_dtype=fp32))
        fully_shard(block.moe, mp_policy=plain)
        fully_shard(block, mp_policy=plain)
    fully_shard(model, mp_policy=plain)


def case_196996_hand_built_separate_units() -> None:
    ours = window_grads(by_hand, fp32, sync_every=False)
    reference = window_grads(by_hand, fp32, sync_every=True)
    assert ours[f"blocks.1.moe.experts.{LATE}.down.weight"].abs().sum() > 0
    for key, grad in ours.items():
        torch.testing.assert_close(grad, reference[key], rtol=1e-5, atol=1e-7, msg=key)


def case_196996_reduce_scatter_unused_params() -> None:
    """The report's second trigger: unused parameters reduce-scattered as zeros (in their
    compute dtype) beside accumulated fp32 gradients; the unused head gets zeros."""
    model = hash_moe(bf16)
    by_policy(model)
    model.set_reduce_scatter_unused_params(True)
    for i, ids in enumerate(microbatches(LATE, seed=1 + dist.get_rank())):
        model.set_requires_gradient_sync(i == 2)
        model(ids, labels=ids)["loss"].backward()
    aux = model.aux_head.weight.grad
    assert aux is not None and aux.dtype == bf16 and not local(aux).any()
    assert model.blocks[1].moe.experts[LATE].up.weight.grad is not None


def case_196996_torch_alone_per_release_trait() -> None:
    """Negative control: torch's own FSDP2 asserts on the same window where the installed
    release lacks ``mixed_dtype_reduce`` (2.11-2.14), and takes it where it has it (2.15).
    A release that fixes it without the trait (or loses it) fails here: update its traits."""
    fixed = release_module().TRAITS.mixed_dtype_reduce
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)

    def plain(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block.moe, mp_policy=policy)
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    with unpatched():
        if fixed:
            window_grads(plain, fp32, sync_every=False)
        else:
            with pytest.raises(AssertionError, match="uniform gradient dtype"):
                window_grads(plain, fp32, sync_every=False)
    dist.barrier()


def case_196996_every_expert_reached_is_uniform() -> None:
    """The trigger needs the late expert: with every expert reached from the first microbatch,
    torch alone takes the window (so the cases above test the late parameter, nothing else)."""
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    model = hash_moe(fp32)
    for block in model.blocks:
        fully_shard(block.moe, mp_policy=policy)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    g = torch.Generator().manual_seed(dist.get_rank())
    with unpatched():
        for i in range(3):
            ids = torch.randint(0, 32, (2, 6), generator=g)
            ids[0, :EXPERTS] = torch.arange(EXPERTS)
            model.set_requires_gradient_sync(i == 2)
            model(ids, labels=ids)["loss"].backward()


def grad_dtype_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(bf16)
    for p in model.parameters():
        p.grad_dtype = fp32
    return model


def case_172074_grad_dtype_is_kept_or_refused() -> None:
    keeps = release_module().TRAITS.keeps_grad_dtype
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    with unpatched():  # the negative control, and the trait that notices the fix
        plain = grad_dtype_model()
        fully_shard(plain, mp_policy=policy)
        assert (next(plain.parameters()).grad_dtype == fp32) == keeps
    model = grad_dtype_model()
    if keeps:
        fully_shard(model, mp_policy=policy)
        model(torch.randn(4, 8, dtype=bf16)).float().sum().backward()
        assert all(p.grad.dtype == fp32 for p in model.parameters())
        return
    with pytest.raises(
        fp.ParamDtypeMapError, match=r"drops Tensor.grad_dtype.*#172074.*'0.weight'"
    ):
        fully_shard(model, mp_policy=policy)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # untouched
    plan = fp.compile_param_dtype_maps(model, fp.PrecisionRules(param_dtype=bf16), [model])
    with pytest.raises(fp.ParamDtypeMapError, match=r"#172074"):
        plan.apply()  # the plan's own checks say it before the first call
    for p in model.parameters():
        p.grad_dtype = None  # the fix the message names; the call can be retried
    fully_shard(model, mp_policy=policy)
    assert all(isinstance(p, DTensor) for p in model.parameters())


class TwiceNet(Net):
    """Each block applied twice per forward: two gradient contributions per backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(block(x))
        return self.head(self.norm(x))


def case_198668_block_applied_twice_under_accumulation() -> None:
    torch.manual_seed(0)
    ref, ours = clones(TwiceNet(), 2)
    wrap_children(ref)
    wrap_mapped(ours)
    for micro in range(3):
        for model in (ref, ours):
            model.set_requires_gradient_sync(micro == 2)
            loss_of(model(inputs(micro))).backward()
    assert_same_grads(ref, ours)
    assert all(p.grad.dtype == fp32 for p in ours.parameters())


CASES = collect_cases(globals())

results, test_pytorch = distributed_suite(2, __name__, CASES)
