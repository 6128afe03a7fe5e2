"""PyTorch's own FSDP2 frozen-parameter tests, ported to gloo/CPU and run under the patch (M26 in
``docs/seeds.md``).

Ported from ``test/distributed/_composable/fsdp/test_fully_shard_frozen.py``
(``test_train_mixed_requires_grad_per_group``, ``test_train_mixed_requires_grad_across_groups``,
``test_multi_forward_mixed_requires_grad``): frozen and trainable parameters in one unit (frozen
before or after ``fully_shard``, with and without activation checkpointing), across units
(unfrozen on the last step, a ``no_grad`` step between), and modules entered several times per
forward, some under ``no_grad``. Each runs in every way of ``tests.conformance.kinds`` (upstream's
policy, and the library's with empty, one-entry, full and model-scoped maps, each naming frozen
parameters too), for every ``reshard_after_forward`` upstream grids. As upstream: parity with a
replicated reference (DDP there; here the same gradients averaged by hand over gloo), the
reduce-scatters of a mixed unit carry only the trainable shards, and the post-backward runs in
autograd's backward, not the final callback. On top, every kind is bitwise torch alone.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction

from fsdp_precision.testing import CollectiveRecorder

from tests.conformance.kinds import kinds, policy, state_digest
from tests.conformance.test_upstream_ported import MLP, check_sharded_parity
from tests.support.harness import collect_cases, conformance_suites, seeded

Reshard = bool | int


def inputs(rank_seed: int, shape: tuple[int, ...], n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank_seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


def reference_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """DDP's step by hand: every gradient averaged over the ranks (unused ones have none)."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())
    optim.step()


def side_by_side(
    ref_model: nn.Module,
    ref_optim: torch.optim.Optimizer,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    *,
    sharded_parity: bool = False,
) -> list[torch.Tensor]:
    """Upstream's loop: each batch through the reference, then the sharded model (gradients
    set to ``None`` every other step), losses compared; the sharded model's losses."""
    losses = []
    for it, inp in enumerate(batches):
        pair = []
        for m, o in ((ref_model, ref_optim), (model, optim)):
            o.zero_grad(set_to_none=(it % 2 == 0))
            pair.append(m(inp).sum())
            pair[-1].backward()
            reference_step(m, o) if m is ref_model else o.step()
        torch.testing.assert_close(pair[1], pair[0])
        if sharded_parity:
            check_sharded_parity(ref_model, model)
        losses.append(pair[1])
    return losses


_counting = threading.Lock()
#: The counts of the blocks inside :func:`counting_post_backward` now, by thread.
_counts: dict[int, list[int]] = {}


@contextmanager
def counting_post_backward() -> Iterator[list[int]]:
    """How often FSDP's post-backward ran through autograd in this thread (upstream's
    ``patch_register_post_backward_hook_backward``).

    Ranks that are threads of one process share the class: the first to enter installs the
    counting ``backward`` and the last to leave restores torch's (each restoring on its own
    exit let a rank that finished first remove the count from under the other, which then
    failed its count, and left the class patched for later cases). CPU autograd runs a
    backward in the thread that called it; a call from any other thread counts for every
    block."""
    count = [0]
    with _counting:
        if not _counts:
            original = RegisterPostBackwardFunction.backward

            def backward(*args: Any, **kwargs: Any) -> Any:
                mine = _counts.get(threading.get_ident())
                for counted in [mine] if mine is not None else list(_counts.values()):
                    counted[0] += 1
                return original(*args, **kwargs)

            backward.original = original  # type: ignore[attr-defined]
            RegisterPostBackwardFunction.backward = staticmethod(backward)  # type: ignore[method-assign,assignment]
        _counts[threading.get_ident()] = count
    try:
        yield count
    finally:
        with _counting:
            del _counts[threading.get_ident()]
            if not _counts:
                patched = RegisterPostBackwardFunction.backward
                RegisterPostBackwardFunction.backward = patched.original  # type: ignore[attr-defined,method-assign]


def _per_group(kind: str, reshard: Reshard, checkpointed: bool, freeze_after_init: bool) -> str:
    num_mlps, dim = 3, 32
    with seeded(42):
        model = nn.Sequential(*[MLP(dim) for _ in range(num_mlps)])
    if not freeze_after_init:  # train the biases only (BitFit)
        for name, param in model.named_parameters():
            if "bias" not in name:
                param.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        if checkpointed:
            checkpoint(mlp)
        fully_shard(mlp, reshard_after_forward=reshard, mp_policy=policy(kind, mlp, model))
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy(kind, model, model))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if freeze_after_init:
        for name, param in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
            if "bias" not in name:
                param.requires_grad_(False)
    trainable = sum(p.to_local().numel() for n, p in model[0].named_parameters() if "bias" in n)
    with CollectiveRecorder() as recorder:
        batches = inputs(43 + dist.get_rank(), (8, dim), 2)
        losses = side_by_side(ref_model, ref_optim, model, optim, batches, sharded_parity=True)
    for call in recorder.of("reduce_scatter"):  # only the trainable shards are reduced
        assert call.input_bytes == trainable * call.group_size * 4, (call.input_bytes, trainable)
    return state_digest(model, losses, recorder)


def _across_groups(kind: str, reshard: Reshard, unfreeze: bool) -> str:
    num_linears, dim = 6, 32
    with seeded(42):
        model = nn.Sequential(
            *itertools.chain.from_iterable((nn.Linear(dim, dim), nn.ReLU()) for _ in range(6))
        )
    ref_model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(
                module, reshard_after_forward=reshard, mp_policy=policy(kind, module, model)
            )
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    def set_requires_grad(seq: nn.Module, requires_grad: bool) -> None:
        for i in range(num_linears):  # upstream's loop, as written: it toggles seq[0]
            if i % 2 == 0:
                for param in seq[i % 2].parameters():
                    param.requires_grad_(requires_grad)

    set_requires_grad(model, False)
    set_requires_grad(ref_model, False)
    num_iters, no_grad_iter = 3, 1
    (inp,) = inputs(42 + dist.get_rank(), (8, dim), 1)
    losses = []
    with counting_post_backward() as count:
        for it in range(num_iters):
            for m, o in ((ref_model, ref_optim), (model, optim)):
                if unfreeze and it == num_iters - 1:
                    set_requires_grad(m, True)
                if it == no_grad_iter:
                    with torch.no_grad():
                        losses.append(m(inp).sum())
                else:
                    losses.append(m(inp).sum())
                    losses[-1].backward()
                    reference_step(m, o) if m is ref_model else o.step()
                    o.zero_grad(set_to_none=(it % 2 == 0))
            torch.testing.assert_close(losses[-1], losses[-2])
    assert count[0] >= num_linears - 1, count  # in autograd's backward, not the final callback
    return state_digest(model, losses[1::2])


class MultiForwardModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # the same layer again, gradient disabled
                x += F.relu(self.layer_with_grad(x))
        return x


def _multi_forward(kind: str, reshard: Reshard) -> str:
    with seeded(42):
        model = MultiForwardModule()
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(
                module, reshard_after_forward=reshard, mp_policy=policy(kind, module, model)
            )
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy(kind, model, model))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = side_by_side(
        ref_model, ref_optim, model, optim, inputs(42 + dist.get_rank(), (8, 5), 2)
    )
    return state_digest(model, losses)


def _grid(fn: Callable[..., str], **axes: list[Any]) -> dict[str, str]:
    """``fn`` for every kind over the product of ``axes``; each kind's digests together."""
    names = list(axes)
    return {
        kind: "".join(
            fn(kind, **dict(zip(names, values, strict=True)))
            for values in itertools.product(*axes.values())
        )
        for kind in kinds()
    }


def case_train_mixed_requires_grad_per_group() -> dict[str, str]:
    return _grid(
        _per_group,
        reshard=[False, True, 2],
        checkpointed=[False, True],
        freeze_after_init=[False, True],
    )


def case_train_mixed_requires_grad_across_groups() -> dict[str, str]:
    return _grid(_across_groups, reshard=[False, True, 2], unfreeze=[False, True])


def case_multi_forward_mixed_requires_grad() -> dict[str, str]:
    return _grid(_multi_forward, reshard=[True, False, 2])


CASES = collect_cases(globals())

#: The grid case whose threaded runs are in the opt-in tier (``-m slow``): it runs on spawned
#: ranks by default, and the other cases run on threads there too.
SLOW_THREADS = ["case_train_mixed_requires_grad_per_group"]

globals().update(conformance_suites(2, __name__, CASES, slow_threads=SLOW_THREADS))


def test_counting_survives_another_rank_thread_leaving_first() -> None:
    """Negative control for the threaded ranks' race: a rank that entered first and leaves
    first must not remove the count from under the other, and the last to leave restores
    torch's backward (the old per-entry restore failed both)."""
    torchs = RegisterPostBackwardFunction.backward
    entered, leave = threading.Event(), threading.Event()

    def first_rank() -> None:
        with counting_post_backward():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=first_rank)
    thread.start()
    assert entered.wait(10)
    with counting_post_backward():
        leave.set()
        thread.join(10)
        assert RegisterPostBackwardFunction.backward is not torchs, "the count was removed"
    assert RegisterPostBackwardFunction.backward is torchs
