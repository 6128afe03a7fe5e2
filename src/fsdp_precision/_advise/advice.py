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

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_precision._advise.flow import KINDS, Finding, Flow, Kind
from fsdp_precision._advise.stand_in import block_free, carry, check_stand_in
from fsdp_precision._advise.usage import (
    call_forward,
    default_inputs,
    first_line,
    on_model_device,
    quiet_forward,
)
from fsdp_precision._base.errors import ParamDtypeMapError
from fsdp_precision._base.watch import ROOT, RunningModules
from fsdp_precision._policy.casts import Boundary
from fsdp_precision._rules.rules import AdvisedRule, Glob

__all__ = [
    "APPLIED_KINDS",
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

_WHY: Mapping[Kind, str] = {
    "router": "its scores pick the experts: bf16 rounding flips close top-k decisions",
    "log_space": "it is an exponent: exp turns its bf16 rounding (3 significant digits) into a "
    "relative error of the value itself",
    "gain": "it scales activations: its rounding error scales every value it multiplies",
    "sinusoidal": "it reads sinusoidal features (sin/cos of a timestep or position): bf16 keeps "
    "3 significant digits of features whose fine differences encode the value",
    "norm": "a norm weight (weaker: it scales normalised activations; keeping it is cheap)",
}


@dataclass(frozen=True)
class Advice:
    """Parameters of one kind that one rule keeps, and why.

    Attributes:
        kind: ``"router"``, ``"log_space"``, ``"gain"`` or ``"norm"`` (the weaker class).
        pattern: The glob that keeps them (``"*.mlp.gate.weight"``).
        params: The parameters the trace found, root-relative FQNs.
        reason: What the trace saw for the first of them, and why it matters.
    """

    kind: Kind
    pattern: str
    params: tuple[str, ...]
    reason: str

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
    """

    advice: tuple[Advice, ...]
    traced: str
    covered: bool
    not_reached: tuple[str, ...] = field(default_factory=tuple)
    stopped: str = ""

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
        """The advice restricted to ``params`` (entries left with none dropped)."""
        keep = set(params)
        advice = tuple(
            Advice(a.kind, a.pattern, tuple(p for p in a.params if p in keep), a.reason)
            for a in self.advice
        )
        return PrecisionAdvice(
            tuple(a for a in advice if a.params),
            self.traced,
            self.covered,
            self.not_reached,
            self.stopped,
        )

    def explain(self) -> str:
        """The advice as text: per rule its parameters, the rule and the reason (norms in one
        line), then what the trace did not reach."""
        head = f"precision advice ({self.traced}):"
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
            lines.append(f"      {_WHY['norm']}")
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

    def to_dict(self) -> dict[str, Any]:
        """The advice as JSON-ready data."""
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
        }


def advise(
    model: nn.Module, example_inputs: Any = None, *, stand_in: nn.Module | None = None
) -> PrecisionAdvice:
    """Trace one forward of ``model`` and find the parameters whose precision matters.

    ``example_inputs``: a mapping (keyword arguments), a tuple (positional) or one tensor;
    default: the model's ``dummy_inputs`` (Hugging Face models). The model is not modified: the
    forward runs in its own train/eval mode, without gradients, on a forked RNG. Without
    inputs, or when the forward fails before reading any parameter, the advice says it is not
    covered.

    ``stand_in``: a smaller build of the same class from the same config (fewer blocks,
    narrower; :func:`fsdp_precision.testing.tiny_config`), on a device with values. Its forward
    is traced instead (``example_inputs`` are its inputs), and each finding applies to every
    parameter of ``model`` with the same name up to block indices: for a full-size model on the
    meta device whose forward reads values (MoE dispatch, ``Tensor.item()``). ``ValueError``
    for a stand-in of another class.
    """
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return PrecisionAdvice((), "not traced: the model is already sharded", covered=False)
    if stand_in is not None:
        check_stand_in(model, stand_in)
    traced_model = model if stand_in is None else stand_in
    chosen = (example_inputs, "example_inputs") if example_inputs is not None else None
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
    with quiet_forward(traced_model, eval_mode=False), running, flow:
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
    return PrecisionAdvice(
        advice=_group(model, findings, touched),
        traced=traced,
        covered=bool(touched),
        not_reached=_not_reached(model, touched) if touched else (),
        stopped=error,
    )


def advised_rules(advice: PrecisionAdvice) -> tuple[AdvisedRule, ...]:
    """The rules ``advice="apply"`` adds; refuses advice that covers nothing."""
    if not advice.covered:
        raise ParamDtypeMapError(
            'PrecisionRules(advice="apply") needs a traced forward, and got none '
            f"({advice.traced}). Pass inputs: "
            "fsdp_precision.advise(model, example_inputs).rules() into "
            'PrecisionRules(rules=...), or use advice="report" / "off"'
        )
    return tuple(
        AdvisedRule(a.kind, a.pattern, boundary=KIND_BOUNDARY.get(a.kind, "auto"))
        for a in advice.advice
        if a.kind in APPLIED_KINDS
    )


# ---------------------------------------------------------------------------------- wording


def _strongest(findings: list[Finding]) -> dict[str, Finding]:
    best: dict[str, Finding] = {}
    for finding in findings:
        known = best.get(finding.param)
        if known is None or KINDS.index(finding.kind) < KINDS.index(known.kind):
            best[finding.param] = finding
    return best


def _pattern(fqn: str, names: list[str], flagged: set[str]) -> str:
    """The shortest glob that matches the same parameters as ``fqn`` with its block indices
    globbed, and no parameter the trace read without flagging (else ``fqn`` itself)."""
    general = block_free(fqn)
    matched = {n for n in names if fnmatch.fnmatchcase(n, general)}
    if matched - flagged:
        return fqn
    segments = general.split(".")
    stars = [i for i, part in enumerate(segments) if part == "*"]
    # After the last block index (``*.mlp.gate.weight``), else the shortest unique tail.
    starts = [stars[-1] + 1] if stars else list(range(len(segments) - 1, 0, -1))
    for start in starts:
        tail = "*." + ".".join(segments[start:])
        if {n for n in names if fnmatch.fnmatchcase(n, tail)} == matched:
            return tail
    return general


def _reason(model: nn.Module, finding: Finding) -> str:
    where = finding.where
    try:
        module = model if where == ROOT else model.get_submodule(where)
        cls = f" ({type(module).__name__})"
    except AttributeError:
        cls = ""
    return f"{' -> '.join(finding.via)} in {where}{cls}: {_WHY[finding.kind]}"


def _group(model: nn.Module, findings: list[Finding], touched: set[str]) -> tuple[Advice, ...]:
    best = _strongest(findings)
    names = [n for n, _ in model.named_parameters()]
    flagged = set(best)
    groups: dict[tuple[Kind, str], list[Finding]] = {}
    for fqn in names:
        finding = best.get(fqn)
        if finding is not None:
            key = (finding.kind, _pattern(fqn, names, flagged))
            groups.setdefault(key, []).append(finding)
    groups = _merged(groups, names, best, touched)
    ordered = sorted(
        groups.items(),
        key=lambda kv: (KINDS.index(kv[0][0]), names.index(kv[1][0].param)),
    )
    return tuple(
        Advice(kind, pattern, tuple(f.param for f in found), _reason(model, found[0]))
        for (kind, pattern), found in ordered
    )


def _merged(
    groups: dict[tuple[Kind, str], list[Finding]],
    names: list[str],
    best: dict[str, Finding],
    touched: set[str],
) -> dict[tuple[Kind, str], list[Finding]]:
    """One glob per kind where one exists: the common suffix (``*norm.weight``) or the common
    start of the last name segment (``*.time_mix_*``), matching every parameter of that kind
    and nothing the trace read and judged otherwise."""
    by_kind: dict[Kind, list[Finding]] = {}
    for (kind, _), found in groups.items():
        by_kind.setdefault(kind, []).extend(found)
    merged: dict[tuple[Kind, str], list[Finding]] = {}
    for (kind, pattern), found in groups.items():
        everything = by_kind[kind]
        glob = _one_glob(kind, [f.param for f in everything], names, best, touched)
        if glob is None or len(everything) == len(found):
            merged[(kind, pattern)] = found
        else:
            merged.setdefault((kind, glob), everything)
    return merged


def _one_glob(
    kind: Kind, params: list[str], names: list[str], best: dict[str, Finding], touched: set[str]
) -> str | None:
    suffix = _common_suffix(params)
    last = [p.rpartition(".")[2] for p in params]
    stem = _common_prefix(last)
    candidates = []
    if len(suffix) > 3:
        candidates.append("*" + suffix)
    if len(stem) > 3:
        candidates.append("*." + stem + "*")
    wanted = set(params)
    for glob in candidates:
        matched = {n for n in names if fnmatch.fnmatchcase(n, glob)}
        stray = {n for n in matched - wanted if n in touched or n in best}
        if wanted <= matched and not stray:
            return glob
    return None


def _common_suffix(values: list[str]) -> str:
    reversed_prefix = _common_prefix([v[::-1] for v in values])
    return reversed_prefix[::-1]


def _common_prefix(values: list[str]) -> str:
    first, last = min(values), max(values)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _not_reached(model: nn.Module, touched: set[str]) -> tuple[str, ...]:
    modules: dict[str, None] = {}
    for fqn, _ in model.named_parameters():
        if fqn not in touched:
            modules.setdefault(block_free(fqn.rpartition(".")[0] or ROOT), None)
    return tuple(modules)
