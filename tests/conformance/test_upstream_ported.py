"""PyTorch's own FSDP2 mixed-precision tests, ported to gloo/CPU and run under the patch.

Ported from ``test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py``
(``_test_compute_dtype``, ``_test_reduce_dtype_fp32_reduce``, ``_test_reduce_dtype_bf16_reduce``,
``_test_grad_acc_with_reduce_dtype``, ``test_reduce_dtype_after_frozen_first_forward``). Each
runs twice: with upstream's ``MixedPrecisionPolicy`` and with a ``ParamDtypeMixedPrecisionPolicy``
that maps every parameter to ``param_dtype`` (the patched code path, same semantics), in every
way of ``tests.conformance.kinds``. Like upstream, the references emulate FSDP with a replicated
model and explicit collectives, and the comparison uses ``assert_close``'s default tolerances; on
top, every kind's losses, sharded parameters, gradients and collectives are bitwise those of
torch alone, on spawned gloo ranks and on threads (``conformance_suites``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision import ParamDtypeMapError
from fsdp_precision._releases import torch_release
from fsdp_precision.testing import CollectiveRecorder

from tests.conformance.kinds import kinds, policy, state_digest
from tests.support.harness import collect_cases, conformance_suites, seeded
from tests.support.models import bf16, fp32, local

# The references' own collectives: torch 2.13 added the *_single names (FSDP moved to them);
# 2.11 and 2.12 have only the older ones, which 2.13+ keep.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class MLP(nn.Module):  # torch.testing._internal.common_fsdp.MLP
    def __init__(self, dim: int, dim_multiplier: int = 4, bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def init_models(kind: str, reshard_after_forward, param_dtype, reduce_dtype):
    with seeded(42):
        model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in (*model, model):
        fully_shard(
            module,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy(kind, module, model, param_dtype, reduce_dtype),
        )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    return ref_model, ref_optim, model, optim


def check_sharded_parity(ref_model: nn.Module, model: nn.Module) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for (name, ref), (_, sharded) in zip(ref_model.named_parameters(), model.named_parameters()):
        chunk = torch.chunk(ref.detach(), world)[rank] if rank < ref.size(0) else None
        torch.testing.assert_close(local(sharded), chunk, msg=name)
        if ref.grad is not None:
            torch.testing.assert_close(
                local(sharded.grad), torch.chunk(ref.grad, world)[rank], msg=name
            )


def _compute_dtype(kind: str, reshard_after_forward: bool) -> str:
    if torch_release() == "2.15":
        # torch 2.15 changed reduce_dtype=None: gradients follow the parameters' grad_dtype
        # (fp32 here) instead of param_dtype, so this test's upstream expectation (a bf16
        # reduce-scatter) no longer holds; the fp32-reduce reference is the 2.15 behaviour.
        return _reduce_dtype_fp32(kind, reshard_after_forward, policy_reduce_dtype=None)
    param_dtype = bf16
    ref_model, ref_optim, model, optim = init_models(kind, reshard_after_forward, param_dtype, None)
    ref_model_bf16 = copy.deepcopy(ref_model).to(param_dtype)
    world = dist.get_world_size()
    with seeded(42 + dist.get_rank() + 1):
        inp = torch.randn((4, 16), dtype=param_dtype)
    losses: list[torch.Tensor] = []
    for it in range(4):
        optim.zero_grad(set_to_none=(it % 2 == 0))
        with CollectiveRecorder() as rec:
            fsdp_loss = model(inp).sum()
            fsdp_loss.backward()
        losses.append(fsdp_loss)
        assert {c.dtype for c in rec.of("reduce_scatter")} == {param_dtype}
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        ref_loss = ref_model_bf16(inp).sum()
        ref_loss.backward()
        for param in ref_model_bf16.parameters():
            param.grad.div_(world)  # gloo: bf16 AVG emulated as pre-divide + SUM
            output = torch.zeros_like(torch.chunk(param.grad, world)[0])
            reduce_scatter(output, param.grad)
            all_gather(param.grad, output)
        for p32, p16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
            p32.grad = p16.grad.to(p32.dtype)
            p16.grad = None
        ref_optim.step()
        for p32, p16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
            p16.detach().copy_(p32)
        torch.testing.assert_close(fsdp_loss, ref_loss)
        check_sharded_parity(ref_model, model)
    return state_digest(model, losses)


def _reduce_dtype_fp32(
    kind: str, reshard_after_forward: bool, policy_reduce_dtype: torch.dtype | None = fp32
) -> str:
    param_dtype, reduce_dtype = bf16, fp32
    ref_model, ref_optim, model, optim = init_models(
        kind, reshard_after_forward, param_dtype, policy_reduce_dtype
    )
    ref_model_bf16 = copy.deepcopy(ref_model).to(param_dtype)
    with seeded(42 + dist.get_rank() + 1):
        inp = torch.randn((4, 16), dtype=param_dtype)
    losses: list[torch.Tensor] = []
    for it in range(4):
        optim.zero_grad(set_to_none=(it % 2 == 0))
        with CollectiveRecorder() as rec:
            fsdp_loss = model(inp).sum()
            fsdp_loss.backward()
        losses.append(fsdp_loss)
        assert {c.dtype for c in rec.of("reduce_scatter")} == {reduce_dtype}
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        ref_loss = ref_model_bf16(inp).sum()
        ref_loss.backward()
        for param in ref_model_bf16.parameters():
            param.grad.data = param.grad.to(fp32)
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())
        for p32, p16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
            p32.grad = p16.grad
            p16.grad = None
        ref_optim.step()
        for p32, p16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
            p16.detach().copy_(p32)
        torch.testing.assert_close(fsdp_loss, ref_loss)
        check_sharded_parity(ref_model, model)
    return state_digest(model, losses)


def _reduce_dtype_bf16(kind: str, reshard_after_forward: bool) -> str:
    param_dtype, reduce_dtype = fp32, bf16
    ref_model, ref_optim, model, optim = init_models(
        kind, reshard_after_forward, param_dtype, reduce_dtype
    )
    world = dist.get_world_size()
    with seeded(42 + dist.get_rank() + 1):
        inp = torch.randn((4, 16), dtype=param_dtype)
    losses: list[torch.Tensor] = []
    for it in range(4):
        optim.zero_grad(set_to_none=(it % 2 == 0))
        with CollectiveRecorder() as rec:
            fsdp_loss = model(inp).sum()
            fsdp_loss.backward()
        losses.append(fsdp_loss)
        assert {c.dtype for c in rec.of("reduce_scatter")} == {reduce_dtype}
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        for param in ref_model.parameters():
            grad = param.grad.to(reduce_dtype)
            output = torch.zeros_like(torch.chunk(grad, world)[0])
            reduce_scatter(output, grad, op=dist.ReduceOp.AVG)
            gathered = torch.empty_like(grad)
            all_gather(gathered, output)
            param.grad = gathered.to(param.dtype)
        ref_optim.step()
        torch.testing.assert_close(fsdp_loss, ref_loss)
        check_sharded_parity(ref_model, model)
    return state_digest(model, losses)


def _grad_acc_with_reduce_dtype(kind: str, reshard_after_forward: bool) -> str:
    """Accumulating without reduce-scatter keeps the unsharded gradients in fp32."""
    param_dtype, reduce_dtype = bf16, fp32
    ref_model, ref_optim, model, optim = init_models(
        kind, reshard_after_forward, param_dtype, reduce_dtype
    )
    ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
    num_microbatches = 3
    with seeded(42 + dist.get_rank() + 1):
        inps = [torch.randn((4, 16), dtype=param_dtype) for _ in range(num_microbatches)]
    losses: list[torch.Tensor] = []
    for _ in range(2):
        for micro, inp in enumerate(inps):
            last = micro == num_microbatches - 1
            model.set_requires_gradient_sync(last)
            with CollectiveRecorder() as rec:
                loss = model(inp).sum()
                loss.backward()
            losses.append(loss)
            assert rec.count("reduce_scatter") == (3 if last else 0)  # one per MLP unit
            ref_model_compute(inp).sum().backward()
            for p32, pc in zip(ref_model.parameters(), ref_model_compute.parameters()):
                acc = pc.grad.to(fp32)
                p32.grad = acc if p32.grad is None else p32.grad + acc
                pc.grad = None
        for param in ref_model.parameters():
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())
        optim.step()
        ref_optim.step()
        check_sharded_parity(ref_model, model)
        optim.zero_grad()
        ref_optim.zero_grad()
        for p32, pc in zip(ref_model.parameters(), ref_model_compute.parameters()):
            pc.detach().copy_(p32)
    return state_digest(model, losses)


def _reduce_dtype_after_frozen_first_forward(kind: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
            self.non_float = nn.Parameter(torch.ones(16, dtype=torch.int64), requires_grad=False)

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return self.layers(inp)

    model = Model()
    mp_policy = policy(kind, model, model, bf16, fp32)
    if torch_release() == "2.11":
        # torch 2.11's FSDP2 makes every sharded parameter trainable, so it cannot manage the
        # frozen int64 parameter at all (2.12 keeps requires_grad); the mapped path says so first.
        expected = (
            (RuntimeError, "floating point dtype can require gradients")
            if kind == "upstream"
            else (ParamDtypeMapError, r"cannot manage non-floating parameters \('non_float'")
        )
        with pytest.raises(expected[0], match=expected[1]):
            fully_shard(model, mp_policy=mp_policy)
        return
    fully_shard(model, mp_policy=mp_policy)
    model.requires_grad_(False)
    with torch.no_grad():
        model(torch.randn((4, 16)))
    model.layers.requires_grad_(True)
    if kind in ("upstream", "empty") and torch_release() in ("2.12", "2.13"):
        # Upstream bug on 2.12 and 2.13, fixed in 2.14 (the test comes from that fix): the unit
        # was frozen at lazy init, so FSDP recorded no dtypes; the bf16 gradients are reduced in
        # bf16 and assigning them to the fp32 parameters fails. With an empty map the patch
        # keeps torch's path exactly, bug included; mapped units follow 2.14 on these releases.
        with pytest.raises(RuntimeError, match="grad_dtype"):
            model(torch.randn((4, 16))).sum().backward()
        return
    with CollectiveRecorder() as rec:
        model(torch.randn((4, 16))).sum().backward()
    reduced = {c.dtype for c in rec.of("reduce_scatter")}
    assert reduced == {fp32}, (kind, reduced)
    for param in model.parameters():
        if param.grad is not None:
            assert param.grad.dtype == fp32


def _subtests(fn) -> dict[str, str]:
    """``fn`` for every kind and ``reshard_after_forward``; each kind's digests together."""
    return {kind: "".join(fn(kind, reshard) for reshard in (False, True)) for kind in kinds()}


def case_compute_dtype() -> dict[str, str]:
    return _subtests(_compute_dtype)


def case_reduce_dtype_fp32_reduce() -> dict[str, str]:
    return _subtests(_reduce_dtype_fp32)


def case_reduce_dtype_bf16_reduce() -> dict[str, str]:
    return _subtests(_reduce_dtype_bf16)


def case_grad_acc_with_reduce_dtype() -> dict[str, str]:
    return _subtests(_grad_acc_with_reduce_dtype)


def case_reduce_dtype_after_frozen_first_forward() -> None:
    # Nothing to compare bitwise: on 2.12 and 2.13 torch's own path (upstream, empty maps)
    # fails where mapped units follow 2.14's fix; on torch alone the suite checks the failure.
    for kind in kinds():
        _reduce_dtype_after_frozen_first_forward(kind)


CASES = collect_cases(globals())

#: The grid case whose threaded runs are in the opt-in tier (``-m slow``): it runs on spawned
#: ranks by default, and the other cases run on threads there too.
SLOW_THREADS = ["case_compute_dtype"]

globals().update(conformance_suites(2, __name__, CASES, slow_threads=SLOW_THREADS))
