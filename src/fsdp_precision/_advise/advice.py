"""The precision advisor: which parameters need more than bf16, found from the model's own
forward (:mod:`fsdp_precision._advise.flow`), each with its reason and a rule ready to paste.

>>> advice = advise(model)  # doctest: +SKIP
>>> print(advice.explain())  # doctest: +SKIP
>>> rules = PrecisionRules(rules=advice.rules())  # doctest: +SKIP

The trace runs once, on the meta device at full size (no memory, no compute) or on real
inputs, with the caller's ``example_inputs`` or the model's ``dummy_inputs``; or on a smaller
build of the same architecture (``stand_in``), where the meta device cannot run the forward
(it reads values), its findings carried to the model's names (:mod:`._advise.stand_in`). What it
did not reach is said (:attr:`PrecisionAdvice.not_reached`), never silently empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._advise.flow import KINDS, Flow, Kind
from fsdp_precision._advise.globs import WHY, group_findings, not_reached
from fsdp_precision._advise.measure import Candidate, Measurement
from fsdp_precision._advise.measure import measure as measure_candidates
from fsdp_precision._advise.stand_in import carry, check_stand_in
from fsdp_precision._advise.usage import (
    call_forward,
    default_inputs,
    first_line,
    on_model_device,
    quiet_forward,
)
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._base.watch import RunningModules
from fsdp_precision._policy.casts import Boundary
from fsdp_precision._rules.rules import MEASURED_THRESHOLD, AdvisedRule, Glob

__all__ = [
    "APPLIED_KINDS",
    "MEASURED_THRESHOLD",
    "Advice",
    "PrecisionAdvice",
    "advise",
    "advised_rules",
]

#: What ``advice="apply"`` keeps. Norms are reported only: they are many, cheap to keep, and
#: most models train well without (keep them with ``ModuleClass`` or a ``Glob`` of your own).
APPLIED_KINDS: tuple[Kind, ...] = ("router", "log_space", "gain", "sinusoidal")

#: The boundary cast each kind's rule asks for where it is not ``"auto"``: a timestep-feature
#: layer returns activations for the bf16 layers after it (the auto rule would keep a kept
#: matrix's output in fp32, as a router's logits are).
KIND_BOUNDARY: dict[str, Boundary] = {"sinusoidal": "inputs_outputs"}


@dataclass(frozen=True)
class Advice:
    """Parameters of one kind that one rule keeps, and why.

    Attributes:
        kind: ``"router"``, ``"log_space"``, ``"gain"`` or ``"norm"`` (the weaker class).
        pattern: The glob that keeps them (``"*.mlp.gate.weight"``).
        params: The parameters the trace found, root-relative FQNs.
        reason: What the trace saw for the first of them, and why it matters.
        sites: The modules in which the deciding ops ran (a router's top-k).
    """

    kind: Kind
    pattern: str
    params: tuple[str, ...]
    reason: str
    sites: tuple[str, ...] = ()

    @property
    def rule(self) -> str:
        """The rule, ready to paste: ``Glob("*.mlp.gate.weight")``."""
        boundary = KIND_BOUNDARY.get(self.kind)
        if boundary is not None:
            return f'Glob("{self.pattern}", boundary="{boundary}")'
        return f'Glob("{self.pattern}")'


@dataclass(frozen=True)
class PrecisionAdvice:
    """What the advisor found in one model.

    Attributes:
        advice: One entry per kind and rule, strongest kind first.
        traced: What the forward ran on, and whether it reached its end.
        covered: Whether a forward ran far enough to read any parameter.
        not_reached: Modules holding parameters no op of the trace read (globbed over block
            indices): no advice covers them.
        stopped: Where the forward stopped before its end (``"Type: message"``), else ``""``.
        measured: What the compute dtype does to each entry on real weights and batches
            (``advise(..., measure=True)``), in the entries' order; else ``None``.
    """

    advice: tuple[Advice, ...]
    traced: str
    covered: bool
    not_reached: tuple[str, ...] = field(default_factory=tuple)
    stopped: str = ""
    measured: Measurement | None = None

    @property
    def complete(self) -> bool:
        """Whether the forward reached its end (and so every parameter it uses)."""
        return self.covered and not self.stopped

    def rules(self, kinds: Iterable[Kind] = APPLIED_KINDS) -> tuple[Glob, ...]:
        """The rules that keep ``kinds`` in fp32, for ``PrecisionRules(rules=...)``."""
        wanted = set(kinds)
        return tuple(
            Glob(a.pattern, boundary=KIND_BOUNDARY.get(a.kind, "auto"))
            for a in self.advice
            if a.kind in wanted
        )

    def params(self, kinds: Iterable[Kind] = KINDS) -> set[str]:
        """Every parameter found, of ``kinds``."""
        wanted = set(kinds)
        return {p for a in self.advice if a.kind in wanted for p in a.params}

    def only(self, params: Iterable[str]) -> PrecisionAdvice:
        """The advice restricted to ``params`` (entries left with none dropped). The
        measurement stays whole: it is of the model, and its figures say why the candidates
        no longer listed (kept wider by a plan) were kept."""
        keep = set(params)
        advice = tuple(
            replace(a, params=tuple(p for p in a.params if p in keep)) for a in self.advice
        )
        return PrecisionAdvice(
            tuple(a for a in advice if a.params),
            self.traced,
            self.covered,
            self.not_reached,
            self.stopped,
            self.measured,
        )

    def kept_by_measure(self, threshold: float = MEASURED_THRESHOLD) -> tuple[Advice, ...]:
        """The entries whose measured effect is at least ``threshold``, by effect per byte
        kept (what ``advice="measured"`` keeps); ``ValueError`` without a measurement."""
        if self.measured is None:
            raise ValueError(
                "this advice was not measured: call fsdp_precision.advise(model, batches, "
                "measure=True)"
            )
        by_pattern = {a.pattern: a for a in self.advice}
        return tuple(
            by_pattern[f.candidate.pattern]
            for f in self.measured.ranked()
            if f.effect >= threshold and f.candidate.pattern in by_pattern
        )

    def explain(self) -> str:
        """The advice as text: per rule its parameters, the rule and the reason (norms in one
        line), then what the trace did not reach."""
        head = f"precision advice ({self.traced}):"
        if self.covered and self.measured is not None:
            return "\n".join([head, *self._measured_lines()])
        if not self.covered:
            return (
                f"{head}\n  not covered: no parameter was reached, so there is no advice; pass "
                "inputs (compile_param_dtype_maps(..., example_inputs=...), "
                'fsdp_precision.advise(model, inputs)) or PrecisionRules(advice="off")'
            )
        lines = [head]
        strong = [a for a in self.advice if a.kind in APPLIED_KINDS]
        norms = [a for a in self.advice if a.kind == "norm"]
        if not self.advice:
            lines.append("  no parameter computing in a low-precision dtype looks sensitive")
        for a in strong:
            lines.append(f"  {a.kind:<9} {len(a.params):>4} params  {a.rule}")
            lines.append(f"      {a.params[0]}: {a.reason}")
        if norms:
            count = sum(len(a.params) for a in norms)
            rules = ", ".join(a.rule for a in norms[:4]) + (", ..." if len(norms) > 4 else "")
            lines.append(f"  {'norm':<9} {count:>4} params  {rules}")
            lines.append(f"      {WHY['norm']}")
        if self.not_reached:
            shown = ", ".join(self.not_reached[:6])
            more = f" and {len(self.not_reached) - 6} more" if len(self.not_reached) > 6 else ""
            lines.append(f"  not covered (the trace did not reach them): {shown}{more}")
        if strong:
            lines.append(
                '  keep them: PrecisionRules(advice="apply") (all but the norms), or paste the '
                "rules"
            )
        return "\n".join(lines)

    def _measured_lines(self) -> list[str]:
        measured = self.measured
        assert measured is not None
        figures = {f.candidate.pattern: f for f in measured.figures}
        lines = [f"  {measured.describe()}"]
        if not self.advice:
            lines.append("  no parameter computing in a low-precision dtype looks sensitive")
        for a in self.advice:
            lines.append(f"  {a.kind:<9} {len(a.params):>4} params  {a.rule}")
            lines.append(f"      {a.params[0]}: {a.reason}")
            found = figures.pop(a.pattern, None)
            if found is not None:
                lines.extend(f"      {line}" for line in found.lines(measured.dtype))
        for pattern, found in figures.items():  # not listed: computes wider already
            lines.append(f"  {'kept':<9} {len(found.candidate.params):>4} params  {pattern}")
            lines.extend(f"      {line}" for line in found.lines(measured.dtype))
        lines.extend(f"  {line}" for line in measured.summary())
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The advice as JSON-ready data."""
        measured = self.measured.to_dict() if self.measured is not None else None
        return {
            "traced": self.traced,
            "covered": self.covered,
            "stopped": self.stopped,
            "not_reached": list(self.not_reached),
            "advice": [
                {
                    "kind": a.kind,
                    "rule": a.rule,
                    "pattern": a.pattern,
                    "params": list(a.params),
                    "reason": a.reason,
                }
                for a in self.advice
            ],
            "measured": measured,
        }


def advise(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    stand_in: nn.Module | None = None,
    measure: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> PrecisionAdvice:
    """Trace one forward of ``model`` and find the parameters whose precision matters; with
    ``measure=True``, also measure what ``dtype`` does to each of them on real weights.

    ``example_inputs``: a mapping (keyword arguments), a tuple (positional) or one tensor;
    default: the model's ``dummy_inputs`` (Hugging Face models). With ``measure=True`` it may
    also be a list of such batches (the calibration data): the trace runs on the first, the
    measurement on all (:mod:`fsdp_precision._advise.measure`: per candidate, its module's
    output error and a router's expert flips on the same inputs, and the logits' KL with it
    alone kept; the figures in :attr:`PrecisionAdvice.measured`, ``explain()`` and
    ``to_dict()``). Measuring needs the model unsharded, with values, stored wider than
    ``dtype`` (``ValueError`` otherwise, nothing run).

    The model is not modified: the forwards run without gradients, on a forked RNG (the trace
    in the model's own train/eval mode, the measurement in eval mode). Without inputs, or when
    the forward fails before reading any parameter, the advice says it is not covered.

    ``stand_in``: a smaller build of the same class from the same config (fewer blocks,
    narrower; :func:`fsdp_precision.testing.tiny_config`), on a device with values. Its forward
    is traced instead (``example_inputs`` are its inputs), and each finding applies to every
    parameter of ``model`` with the same name up to block indices: for a full-size model on the
    meta device whose forward reads values (MoE dispatch, ``Tensor.item()``). ``ValueError``
    for a stand-in of another class, or with ``measure=True``.
    """
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return PrecisionAdvice((), "not traced: the model is already sharded", covered=False)
    if stand_in is not None:
        check_stand_in(model, stand_in)
    batches = _batches(example_inputs) if measure else None
    first = "example_inputs"
    if measure:
        _check_measurable(model, stand_in, dtype)
        example_inputs = batches[0] if batches else None
        first = "the first batch"
    traced_model = model if stand_in is None else stand_in
    chosen = (example_inputs, first) if example_inputs is not None else None
    chosen = chosen or default_inputs(traced_model)
    if chosen is None:
        return PrecisionAdvice(
            (), "not traced: no example_inputs and no dummy_inputs", covered=False
        )
    inputs, source = chosen
    moved = on_model_device(traced_model, inputs)
    running = RunningModules(traced_model)
    flow = Flow(traced_model, running)
    flow.mark_inputs(moved)
    error = ""
    # In the model's own mode: some layers change themselves at an eval forward without
    # gradients (bitsandbytes' CPU 4-bit layers repack their weights in place).
    experts = "eager" if measure else "batched_mm"  # on values: one expert at a time
    with quiet_forward(traced_model, eval_mode=False, experts=experts), running, flow:
        try:
            call_forward(traced_model, moved)
        except Exception as exc:  # noqa: BLE001 - what ran before is advice; the rest is said
            error = first_line(exc)
    findings, touched = list(flow.findings.values()), set(flow.touched)
    if stand_in is not None:
        count = sum(p.numel() for p in stand_in.parameters())
        source = f"{source} of a smaller build ({count:,} parameters), carried by block name"
        findings, touched = carry(findings, touched, stand_in, model)
    traced = f"traced a forward on {source}" + (f", which stopped early: {error}" if error else "")
    entries = tuple(
        Advice(g.kind, g.pattern, g.params, g.reason, g.sites)
        for g in group_findings(model, findings, touched)
    )
    measured = None
    if measure and touched:
        measured = measure_candidates(
            model,
            [_candidate(a) for a in entries],
            batches or [inputs],
            dtype=dtype,
            source=f"{len(batches)} given batches" if batches else source,
        )
    return PrecisionAdvice(
        advice=entries,
        traced=traced,
        covered=bool(touched),
        not_reached=not_reached(model, touched) if touched else (),
        stopped=error,
        measured=measured,
    )


def _batches(example_inputs: Any) -> list[Any]:
    """The calibration batches: a list of batches, or one batch."""
    if example_inputs is None:
        return []
    if isinstance(example_inputs, list):
        return list(example_inputs)
    return [example_inputs]


def _check_measurable(model: nn.Module, stand_in: nn.Module | None, dtype: torch.dtype) -> None:
    if stand_in is not None:
        raise ValueError(
            "advise(measure=True) measures the model itself, with its weights, and got a "
            "stand_in: measure a model with values (loaded from its checkpoint), or drop "
            "measure=True to trace the stand-in"
        )
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if any(p.is_meta for p in floating):
        raise ValueError(
            "advise(measure=True) needs the model's weights, and the model is on the meta "
            "device: load it from its checkpoint (from_pretrained, torch_dtype=torch.float32) "
            "or measure a smaller build"
        )
    if floating and all(p.element_size() <= dtype.itemsize for p in floating):
        raise ValueError(
            f"advise(measure=True) compares {dtype_name(dtype)} with the stored precision, and "
            f"the model is stored in {dtype_name(floating[0].dtype)}: load it in float32 "
            "(from_pretrained(..., torch_dtype=torch.float32))"
        )


def _candidate(advice: Advice) -> Candidate:
    return Candidate(
        kind=advice.kind,
        pattern=advice.pattern,
        params=advice.params,
        boundary=KIND_BOUNDARY.get(advice.kind, "auto"),
        selects_in=advice.sites if advice.kind == "router" else (),
    )


def advised_rules(
    advice: PrecisionAdvice, *, threshold: float | None = None
) -> tuple[AdvisedRule, ...]:
    """The rules ``advice="apply"`` adds (``threshold``: those ``advice="measured"`` adds, the
    measured candidates at or above it); refuses advice that covers nothing."""
    mode = "apply" if threshold is None else "measured"
    if not advice.covered:
        raise ParamDtypeMapError(
            f'PrecisionRules(advice="{mode}") needs a traced forward, and got none '
            f"({advice.traced}). Pass inputs: "
            "fsdp_precision.advise(model, example_inputs).rules() into "
            'PrecisionRules(rules=...), or use advice="report" / "off"'
        )
    chosen: Sequence[Advice] = (
        [a for a in advice.advice if a.kind in APPLIED_KINDS]
        if threshold is None
        else advice.kept_by_measure(threshold)
    )
    return tuple(
        AdvisedRule(a.kind, a.pattern, boundary=KIND_BOUNDARY.get(a.kind, "auto")) for a in chosen
    )
