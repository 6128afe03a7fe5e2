"""What :func:`~fsdp_precision.testing.verify_parity` found: per parameter, and for the model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._verify.compare import Comparison

__all__ = ["ParamParity", "ParityReport"]


@dataclass(frozen=True)
class ParamParity:
    """One parameter's results.

    Attributes:
        fqn: Root-relative FQN (the first alias of a tied parameter).
        aliases: Other FQNs of the same parameter.
        unit: The FSDP unit that manages it.
        storage: Storage dtype (the sharded parameter's dtype).
        compute: Planned compute dtype.
        gathered: Dtype observed after the unit's all-gather (``None``: the unit never ran).
        rule: What decided the compute dtype (``"default"``: the unit's ``param_dtype``).
        grad: Gradient against the reference (``None``: no gradient on either side).
        param: Parameter after the optimizer step against the reference's master copy.
        grad_rtol: Tolerance the gradient was held to (``None``: bitwise).
        gathered_sharded: Still a DTensor shard right after its unit's all-gather.
    """

    fqn: str
    aliases: tuple[str, ...]
    unit: str
    storage: torch.dtype
    compute: torch.dtype
    gathered: torch.dtype | None
    rule: str
    grad: Comparison | None
    param: Comparison
    grad_rtol: float | None = None
    gathered_sharded: bool = False

    def problems(self) -> list[str]:
        """What is wrong with this parameter (empty when nothing is)."""
        out = []
        if self.gathered is not None and self.gathered != self.compute:
            out.append(
                f"all-gathered in {dtype_name(self.gathered)}, planned {dtype_name(self.compute)}"
            )
        if self.gathered_sharded:
            out.append("still sharded after its unit's all-gather")
        if self.grad is not None and not self.grad.within(self.grad_rtol):
            out.append(f"gradient differs (max |diff| {self.grad.max_abs_diff:.3g})")
        if not self.param.bitwise:
            diff = self.param.max_abs_diff
            out.append(f"parameter after the step differs (max |diff| {diff:.3g})")
        return out


@dataclass(frozen=True)
class ParityReport:
    """What :func:`verify_parity` found, identical on every rank.

    Attributes:
        model: Class name of the model.
        world_size: Ranks the model was sharded over.
        rules: ``PrecisionRules.describe()`` of the plan.
        units: Number of FSDP units (``fully_shard`` calls with parameters).
        loss: The FSDP model's loss (rank 0's).
        reference_loss: The reference's loss.
        loss_match: Losses bitwise equal on every rank.
        output_match: Outputs (logits) bitwise equal on every rank.
        params: One entry per parameter, in ``named_parameters()`` order.
        optimizer: The optimizer step taken, e.g. ``"AdamW(lr=0.001)"``.
        grads_bitwise_expected: Whether the world size allows bitwise gradients.
        notes: Remarks that are not failures (a gradient on one side only is both).
    """

    model: str
    world_size: int
    rules: str
    units: int
    loss: float
    reference_loss: float
    loss_match: bool
    output_match: bool
    params: list[ParamParity]
    optimizer: str
    grads_bitwise_expected: bool
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Everything matched (within the stated tolerance where N is not 1 or 2)."""
        return self.loss_match and self.output_match and not any(p.problems() for p in self.params)

    def problems(self) -> list[str]:
        """One line per problem found."""
        out = []
        if not self.loss_match:
            out.append(f"loss {self.loss!r} != reference {self.reference_loss!r}")
        if not self.output_match:
            out.append("model output differs from the reference's")
        for p in self.params:
            out.extend(f"{p.fqn}: {problem}" for problem in p.problems())
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""

        def cmp(c: Comparison | None) -> dict[str, Any] | None:
            if c is None:
                return None
            diff = c.max_abs_diff if math.isfinite(c.max_abs_diff) else None
            return {"bitwise": c.bitwise, "max_abs_diff": diff, "scale": c.scale}

        return {
            "model": self.model,
            "world_size": self.world_size,
            "rules": self.rules,
            "units": self.units,
            "optimizer": self.optimizer,
            "grads_bitwise_expected": self.grads_bitwise_expected,
            "loss": self.loss,
            "reference_loss": self.reference_loss,
            "loss_bitwise": self.loss_match,
            "output_bitwise": self.output_match,
            "ok": self.ok,
            "problems": self.problems(),
            "notes": list(self.notes),
            "params": [
                {
                    "fqn": p.fqn,
                    "aliases": list(p.aliases),
                    "unit": p.unit,
                    "storage": dtype_name(p.storage),
                    "compute": dtype_name(p.compute),
                    "gathered": dtype_name(p.gathered) if p.gathered is not None else None,
                    "rule": p.rule,
                    "grad": cmp(p.grad),
                    "grad_rtol": p.grad_rtol,
                    "param": cmp(p.param),
                    "ok": not p.problems(),
                }
                for p in self.params
            ],
        }

    def format(self, *, max_problems: int = 12, rest: str = "to_dict() lists all") -> str:
        """The report for people: one row per parameter, a summary line, then the notes.

        At most ``max_problems`` problems are listed, then ``... and N more ({rest})``. Use it as an
        assertion message: ``assert report.ok, report.format()``.
        """
        rows: list[tuple[str, ...]] = [("parameter", "storage", "compute", "rule", "grad", "param")]
        for p in self.params:
            planned = dtype_name(p.compute)
            if p.gathered is None:
                compute = f"{planned} (planned; unit not run)"
            elif p.gathered != p.compute:
                compute = f"{dtype_name(p.gathered)} != planned {planned}"
            else:
                compute = planned
            rows.append(
                (p.fqn, dtype_name(p.storage), compute, p.rule, _cell(p.grad), _cell(p.param))
            )
        lines = [*_table(rows), "", self._verdict(max_problems, rest)]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _verdict(self, max_problems: int, rest: str) -> str:
        n, world = len(self.params), self.world_size
        if self.ok and self.grads_bitwise_expected:
            return (
                f"{n} parameters: all bitwise identical to the unsharded reference on "
                f"{'all ' if world > 1 else ''}{_plural(world, 'rank', 'ranks')} (loss, output, "
                "gradients, parameters after the step; all-gathered in their planned compute "
                "dtype)"
            )
        if self.ok:
            rtols = sorted({p.grad_rtol for p in self.params if p.grad_rtol})
            bound = " or ".join(f"{r:.2e}" for r in rtols)
            differ = sum(1 for p in self.params if p.grad is not None and not p.grad.bitwise)
            return (
                f"{n} parameters match the unsharded reference on all {world} ranks: loss, "
                f"output and parameters after the step bitwise (the reference optimizer stepped "
                f"on FSDP's gradients); gradients within {bound} x max|grad|, {differ} of {n} "
                f"not bitwise (on {world} ranks the reduction may round; bitwise is guaranteed "
                "on 1 or 2)"
            )
        problems = self.problems()
        bad = sum(1 for p in self.params if p.problems())
        lines = [
            f"{bad} of {n} parameters differ from the unsharded reference "
            f"({_plural(len(problems), 'problem', 'problems')}):",
            *(f"  {problem}" for problem in problems[:max_problems]),
        ]
        if len(problems) > max_problems:
            lines.append(f"  ... and {len(problems) - max_problems} more ({rest})")
        return "\n".join(lines)


def _cell(result: Comparison | None) -> str:
    if result is None:
        return "no grad"
    if result.bitwise:
        return "bitwise"
    diff = result.max_abs_diff
    return f"{diff:.2e}" if math.isfinite(diff) else "mismatch"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines
