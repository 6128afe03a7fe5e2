"""The architecture screen: real architectures x auto-wrap thresholds under wrap_model_for_training.

Every case, on 2 gloo ranks (each with its own batches): build the model (same seed on every
rank), plan it, wrap it with ``wrap_model_for_training`` (bf16 compute, fp32 reduce, the model's
precision rules), then two AdamW steps with a ``GatherProbe`` active. A case passes when

* every parameter but 0-dim ones is a DTensor after wrapping;
* both losses are finite, and the first is the unwrapped fp32 model's within bf16 tolerance;
* every planned parameter (each alias of a tied one) was gathered, unsharded, in its planned
  compute dtype: fp32 where a rule or the model's declaration keeps it, bf16 everywhere else;
* exactly the parameters that change when the unwrapped model trains on the same batches changed
  (dead ones, such as LLaVA's unused ``post_layernorm``, change in neither);
* parameters that stayed plain tensors are identical on every rank (their gradients were
  averaged across ranks).

Thresholds are relative to each model's size: 0 (every module that can be a unit), 3% and 25% of
its parameters (different unit layouts for every model of the table) and the default 10_000_000
(the root only, for these tiny models). Every architecture runs in the default tier at one of
0 and 25%, alternating along the table (so both layouts run by default), and at the other in the
opt-in tier (``-m slow``, its own process group); 3% and the default run in the opt-in tier too
(``tests/train/test_screen_more.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe

pytest.importorskip("transformers", reason="the screen's architectures need transformers")
pytest.importorskip("diffusers", reason="the screen's architectures need diffusers")

from tests.support.harness import collect_cases, distributed_suite
from tests.support.screen_models import (
    ARCHS,
    LR,
    STEPS,
    ScreenArch,
    batch_of,
    build,
    threshold,
    train_unwrapped,
)

#: Threshold label -> fraction of the model's parameter count (``None``: the config's default).
#: The default tier runs every architecture at one of 0 (every module that can be a unit) and
#: 25%, alternating along the table, the other with ``-m slow``;
#: ``tests/train/test_screen_more.py`` (``-m slow``) at 3% and the default.
THRESHOLDS: dict[str, float | None] = {"t0": 0.0, "t25pct": 0.25}
MORE_THRESHOLDS: dict[str, float | None] = {"t3pct": 0.03, "default": None}
LOSS_RTOL = 0.05  # bf16 compute against fp32, first step


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(g, tensor) for g in gathered)


def screen(arch: ScreenArch, fraction: float | None) -> None:
    """One case of the screen (see the module docstring for what it asserts)."""
    rank = dist.get_rank()
    ref_losses, ref_changed = train_unwrapped(arch, rank)

    model = build(arch)
    config = fp.DistributedConfig(
        parallel_strategy="fsdp",
        fsdp_mixed_precision=fp.PrecisionRules(rules=arch.rules),  # bf16, fp32 reduce
        fsdp_auto_wrap_min_params=threshold(model, fraction),
    )
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    plan = fp.plan_model_for_training(model, config)  # before wrapping: what will be kept
    expected: dict[str, tuple[torch.dtype, bool]] = {}
    for unit in plan.units:
        for planned in unit.params:
            for fqn in (planned.fqn, *planned.aliases):
                expected[fqn] = (planned.compute, planned.claimed)
    names = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    scalars = {k for k, p in model.named_parameters(remove_duplicate=False) if p.dim() == 0}
    missing = sorted(names - scalars - set(expected))
    assert not missing, f"parameters the plan does not cover: {missing}"

    model = fp.wrap_model_for_training(model, config)
    plain = [k for k, p in model.named_parameters() if p.dim() > 0 and not isinstance(p, DTensor)]
    assert not plain, f"not DTensors after wrapping: {plain}"

    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    with GatherProbe(model) as probe:
        for step in range(STEPS):
            loss = arch.loss(model, batch_of(arch, step, rank))
            loss.backward()  # type: ignore[no-untyped-call]
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), f"losses {losses}"
    assert abs(losses[0] - ref_losses[0]) <= LOSS_RTOL * max(1.0, abs(ref_losses[0])), (
        f"first loss {losses[0]} vs unwrapped fp32 {ref_losses[0]}"
    )

    wrong = []
    for fqn, (compute, kept) in sorted(expected.items()):
        want = compute if kept else torch.bfloat16
        seen = probe.seen.get(fqn)
        if seen is None:
            wrong.append(f"{fqn}: never gathered (planned {compute}, kept={kept})")
        elif seen.sharded or seen.dtype != want or compute != want:
            wrong.append(
                f"{fqn}: gathered {seen.dtype} sharded={seen.sharded} in unit {seen.unit!r}; "
                f"planned {compute}, kept={kept}, expected {want}"
            )
    assert not wrong, "gathered parameters:\n" + "\n".join(wrong)

    changed = {k for k, p in model.named_parameters() if not torch.equal(_full(p), before[k])}
    assert changed == ref_changed, (
        f"changed only when wrapped: {sorted(changed - ref_changed)}; "
        f"changed only unwrapped: {sorted(ref_changed - changed)}"
    )
    diverged = [
        k
        for k, p in model.named_parameters()
        if not isinstance(p, DTensor) and not _same_on_every_rank(p.detach())
    ]
    assert not diverged, f"replicated parameters that differ across ranks: {diverged}"


def _case(arch: ScreenArch, fraction: float | None) -> Callable[[], None]:
    def case() -> None:
        screen(arch, fraction)

    return case


def screen_cases(module_globals: dict[str, object], thresholds: dict[str, float | None]) -> None:
    """One ``case_<arch>_<threshold>`` per architecture and threshold, into a module's globals."""
    for arch in ARCHS.values():
        for label, fraction in thresholds.items():
            module_globals[f"case_{arch.name}_{label}"] = _case(arch, fraction)


screen_cases(globals(), THRESHOLDS)

CASES = collect_cases(globals())
#: The opt-in half: each architecture at the threshold of the two its default case does not use.
SLOW = [
    f"case_{arch.name}_{label}"
    for i, arch in enumerate(ARCHS.values())
    for j, label in enumerate(THRESHOLDS)
    if j != i % len(THRESHOLDS)
]

results, test_screen = distributed_suite(2, __name__, CASES, slow=SLOW)


@pytest.mark.parametrize("name", list(ARCHS))
def test_trains_unwrapped(name: str) -> None:
    """Every architecture of the table trains on one process, unwrapped, in fp32."""
    losses, changed = train_unwrapped(ARCHS[name], rank=0)
    assert all(math.isfinite(x) for x in losses), losses
    assert changed, "no parameter changed"
