"""The advice's globs: the traced findings grouped into rules, one glob per kind where one
matches them all and nothing the trace judged otherwise (:mod:`._advise.advice`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch.nn as nn

from fsdp_precision._advise.flow import KINDS, Finding, Kind
from fsdp_precision._advise.stand_in import block_free
from fsdp_precision._base.watch import ROOT

__all__ = ["WHY", "Group", "group_findings", "not_reached"]

#: Why each kind's precision matters, as the advice words it.
WHY: Mapping[Kind, str] = {
    "router": "its scores pick the experts: bf16 rounding flips close top-k decisions",
    "log_space": "it is an exponent: exp turns its bf16 rounding (3 significant digits) into a "
    "relative error of the value itself",
    "gain": "it scales activations: its rounding error scales every value it multiplies",
    "sinusoidal": "it reads sinusoidal features (sin/cos of a timestep or position): bf16 keeps "
    "3 significant digits of features whose fine differences encode the value",
    "norm": "a norm's weight or bias (weaker: it scales or shifts normalised activations; "
    "keeping it is cheap)",
}


@dataclass(frozen=True)
class Group:
    """Parameters of one kind one glob keeps: the trace's findings for them, grouped."""

    kind: Kind
    pattern: str
    params: tuple[str, ...]
    reason: str
    sites: tuple[str, ...]


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
    return f"{' -> '.join(finding.via)} in {where}{cls}: {WHY[finding.kind]}"


def group_findings(
    model: nn.Module, findings: list[Finding], touched: set[str]
) -> tuple[Group, ...]:
    """``findings`` grouped by kind and glob, strongest kind first, in model order."""
    best = _strongest(findings)
    names = [n for n, _ in model.named_parameters()]
    flagged = set(best)
    groups: dict[tuple[Kind, str], list[Finding]] = {}
    for fqn in names:
        finding = best.get(fqn)
        if finding is not None:
            key = (finding.kind, _pattern(fqn, names, flagged))
            groups.setdefault(key, []).append(finding)
    groups = _by_module(_merged(groups, names, best, touched), names, best, touched)
    ordered = sorted(
        groups.items(),
        key=lambda kv: (KINDS.index(kv[0][0]), names.index(kv[1][0].param)),
    )
    return tuple(
        Group(
            kind,
            pattern,
            tuple(f.param for f in found),
            _reason(model, found[0]),
            tuple(dict.fromkeys(f.where for f in found)),
        )
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


def _by_module(
    groups: dict[tuple[Kind, str], list[Finding]],
    names: list[str],
    best: dict[str, Finding],
    touched: set[str],
) -> dict[tuple[Kind, str], list[Finding]]:
    """Groups of one kind over the same modules (a LayerNorm's weight and bias) as one, under
    their common glob (``*.ln_1.*``) where it matches them and nothing the trace judged
    otherwise: the rule a user writes, and one candidate to measure (a module is kept whole)."""
    by_modules: dict[tuple[Kind, frozenset[str]], list[str]] = {}
    for (kind, pattern), found in groups.items():
        owners = frozenset(f.param.rpartition(".")[0] for f in found)
        by_modules.setdefault((kind, owners), []).append(pattern)
    out = dict(groups)
    for (kind, _), patterns in by_modules.items():
        if len(patterns) < 2:
            continue
        stem = _common_prefix(patterns).rpartition(".")[0]
        found = [f for p in patterns for f in groups[(kind, p)]]
        wanted = {f.param for f in found}
        glob = f"{stem}.*"
        if not stem or stem == "*" or not _keeps_only(glob, wanted, names, best, touched):
            continue
        for p in patterns:
            del out[(kind, p)]
        out[(kind, glob)] = sorted(found, key=lambda f: names.index(f.param))
    return out


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
    return next((g for g in candidates if _keeps_only(g, wanted, names, best, touched)), None)


def _keeps_only(
    glob: str, wanted: set[str], names: list[str], best: dict[str, Finding], touched: set[str]
) -> bool:
    """``glob`` matches every parameter in ``wanted`` and none the trace read or judged
    otherwise."""
    matched = {n for n in names if fnmatch.fnmatchcase(n, glob)}
    return wanted <= matched and not any(n in touched or n in best for n in matched - wanted)


def _common_suffix(values: list[str]) -> str:
    reversed_prefix = _common_prefix([v[::-1] for v in values])
    return reversed_prefix[::-1]


def _common_prefix(values: list[str]) -> str:
    first, last = min(values), max(values)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def not_reached(model: nn.Module, touched: set[str]) -> tuple[str, ...]:
    """The modules (block indices globbed) holding parameters no op of the trace read."""
    modules: dict[str, None] = {}
    for fqn, _ in model.named_parameters():
        if fqn not in touched:
            modules.setdefault(block_free(fqn.rpartition(".")[0] or ROOT), None)
    return tuple(modules)
