"""Parity of a plan-wrapped model against an unsharded reference that computes as FSDP does.

:func:`verify_parity` wraps a model with its :class:`~fsdp_precision.PrecisionPlan` and runs one
forward, backward and AdamW step on it and on an unsharded copy, the *reference*, that emulates
exactly what FSDP does to numerics:

* each parameter is cast to its planned compute dtype (what the all-gather delivers), while an
  fp32 (storage-dtype) master copy is what the optimizer updates;
* each unit's floating inputs are cast to the unit's ``param_dtype`` (``cast_forward_inputs``) and
  its outputs to ``output_dtype``, as FSDP's pre- and post-forward hooks do;
* each unit's grad-requiring inputs pass through an identity autograd node, as FSDP's
  ``RegisterPostBackwardFunction`` does, so gradients meeting from several uses sum in the same
  order;
* each gradient goes through the unit's ``reduce_dtype`` and lands in its parameter's storage
  dtype, as FSDP's reduce-scatter does.

Inputs must be identical on every rank. Then the all-gather is exact, so outputs and losses are
bitwise equal on any number of ranks, and FSDP's averaged gradient is the reference gradient
averaged over N copies of itself: bitwise on 1 and 2 ranks (``(g + g) / 2 == g``), within
rounding of the reduction on other counts (``(g + g + g) / 3`` can round). There the reference
optimizer steps on the gradients FSDP produced, so parameters still compare bitwise and the
gradients are checked against a tolerance, :func:`gradient_tolerance`.

Everything observed (the dtype each parameter was all-gathered in, every difference) is observed
on every rank and combined across ranks (the maximum), so a report holds for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_precision._base.dist import full_tensor, gather_across_ranks
from fsdp_precision._observe.gathers import GatherProbe
from fsdp_precision._observe.guard import unit_guard
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._verify.compare import (
    BITWISE_WORLD_SIZES,
    Comparison,
    compare,
    gradient_tolerance,
    loss_of,
    output_of,
    same_bits,
)
from fsdp_precision._verify.reference import Reference
from fsdp_precision._verify.report import ParamParity, ParityReport

__all__ = ["verify_parity"]


@dataclass(frozen=True)
class _Seen:
    """What one rank saw; every rank's is gathered and the worst of them reported."""

    loss_match: bool
    output_match: bool
    grads: dict[str, Comparison | None]
    after: dict[str, Comparison]
    sharded: frozenset[str]  # FQNs still sharded right after their unit's all-gather


def _worst(mine: Comparison, everyone: list[Comparison]) -> Comparison:
    """``mine`` (and its scale), bitwise only if bitwise on every rank, the largest difference."""
    return replace(
        mine,
        bitwise=all(c.bitwise for c in everyone),
        max_abs_diff=max(c.max_abs_diff for c in everyone),
    )


def verify_parity(
    plan: PrecisionPlan,
    inputs: Mapping[str, Any],
    *,
    lr: float = 1e-3,
    seed: int = 0,
    context: Callable[[], AbstractContextManager[Any]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = loss_of,
    **fully_shard_kwargs: Any,
) -> ParityReport:
    """Wrap ``plan.model`` with ``plan`` and check it against the unsharded reference.

    One forward (``model(**inputs)``), backward of ``loss_fn(output)`` and ``AdamW(lr)`` step on
    both; compared: output and loss (bitwise), every gradient (bitwise on 1 and 2 ranks, else
    within :func:`gradient_tolerance`), every parameter after the step (bitwise), and the dtype
    each parameter was all-gathered in (its planned compute dtype). ``inputs`` must be identical
    on every rank; the RNG is seeded with ``seed`` before each forward (dropout masks agree).
    ``context`` (e.g. ``lambda: torch.autocast("cpu")``) wraps both forwards. Every rank must
    call this (it runs collectives); every rank returns the same report.

    Raises ``ValueError`` when the model is already wrapped, and
    :class:`~fsdp_precision.UnitUsageError` naming the module and its unit when the forward
    uses a parameter outside its unit (:func:`unit_guard`).
    """
    model = plan.model
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "verify_parity needs the unwrapped model: build the reference before fully_shard"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    make_context = context or nullcontext
    name = type(model).__name__  # fully_shard changes the class to FSDP<name>
    reference = Reference(plan)
    plan.apply(**fully_shard_kwargs)
    planned = plan.params_by_fqn

    with ExitStack() as stack:
        seen = stack.enter_context(GatherProbe(model)).seen
        stack.enter_context(unit_guard(plan))  # a module run outside its unit: named
        stack.enter_context(make_context())
        torch.manual_seed(seed)
        out = model(**inputs)
    with make_context():
        torch.manual_seed(seed)
        ref_out = reference.module(**inputs)
    output, ref_output = output_of(out), output_of(ref_out)
    output_match = same_bits(output, ref_output)
    loss, ref_loss = loss_fn(out), loss_fn(ref_out)
    loss_match = same_bits(loss, ref_loss)
    loss.backward()  # type: ignore[no-untyped-call]
    ref_loss.backward()  # type: ignore[no-untyped-call]

    params = dict(model.named_parameters())
    ref_grads = reference.master_grads()
    grads: dict[str, Comparison | None] = {}
    notes: list[str] = []
    for fqn, param in params.items():
        expected = ref_grads[fqn]
        if param.grad is None and expected is None:
            grads[fqn] = None
            continue
        if param.grad is None or expected is None:
            side = "FSDP" if param.grad is None else "the reference"
            grads[fqn] = Comparison(False, math.inf, 0.0)
            notes.append(f"{fqn}: no gradient on {side}")
            continue
        got = full_tensor(param.grad)
        grads[fqn] = compare(got, expected)
        master = reference.masters[fqn]
        # On 1 or 2 ranks the reference steps on its own gradient (end to end); elsewhere on the
        # gradient FSDP reduced, so that the optimizer step itself still compares bitwise.
        master.grad = expected if world in BITWISE_WORLD_SIZES else got.detach().clone()

    optimizer = torch.optim.AdamW([p for p in params.values() if p.grad is not None], lr=lr)
    ref_optimizer = torch.optim.AdamW(
        [m for m in reference.masters.values() if m.grad is not None], lr=lr
    )
    optimizer.step()
    ref_optimizer.step()
    after = {
        fqn: compare(full_tensor(p.detach()), reference.masters[fqn].detach())
        for fqn, p in params.items()
    }
    not_finite = [f for f, m in reference.masters.items() if not bool(m.detach().isfinite().all())]
    if not_finite:
        fp16 = any(reference.masters[f].dtype == torch.float16 for f in not_finite)
        notes.append(
            f"{len(not_finite)} parameters are not finite after the reference's step too "
            f"(e.g. {not_finite[0]}); they were compared bit for bit"
            + ("; AdamW's eps (1e-8) is 0 in float16 storage" if fp16 else "")
        )

    # Combine across ranks: the worst of every rank.
    mine = _Seen(
        loss_match=loss_match,
        output_match=output_match,
        grads=grads,
        after=after,
        sharded=frozenset(f for f, g in seen.items() if g.sharded),
    )
    everyone = gather_across_ranks(mine)
    results = []
    for fqn in params:
        p = planned[fqn]
        g = grads[fqn]
        ranks_g = [c for r in everyone if (c := r.grads[fqn]) is not None]
        gathered = seen.get(fqn)
        results.append(
            ParamParity(
                fqn=fqn,
                aliases=p.aliases,
                unit=plan.unit_names.get(p.fqn, "?"),
                storage=p.storage,
                compute=p.compute,
                gathered=gathered.dtype if gathered is not None else None,
                rule=p.rule,
                grad=None if g is None else _worst(g, ranks_g),
                param=_worst(after[fqn], [r.after[fqn] for r in everyone]),
                grad_rtol=gradient_tolerance(world, p.reduce) if p.reduce is not None else None,
                gathered_sharded=any(fqn in r.sharded for r in everyone),
            )
        )
    return ParityReport(
        model=name,
        world_size=world,
        rules=plan.rules.describe(),
        units=len([u for u in plan.units if u.params]),
        loss=float(loss.detach()),
        reference_loss=float(ref_loss.detach()),
        loss_match=all(r.loss_match for r in everyone),
        output_match=all(r.output_match for r in everyone),
        params=results,
        optimizer=f"AdamW(lr={lr:g})",
        grads_bitwise_expected=world in BITWISE_WORLD_SIZES,
        notes=notes,
    )
