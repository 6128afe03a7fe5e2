"""What bf16 does to each candidate the advisor found, measured on the model's own weights and
the caller's batches.

Two kinds of figure, from forwards without gradients in eval mode:

- **At each candidate module, on the same inputs.** During the reference forward (the model as
  it is stored, fp32), each module holding a candidate's parameters is run again on the inputs
  it just received, rounded to the compute dtype, twice: its candidate parameters in the compute
  dtype (as the uniform policy computes it), and in their storage dtype (as kept). The relative
  error of its output between the two, and for a router the share of tokens whose top-k expert
  set differs and the error of the weights top-k returned (scattered over the experts): the
  candidate's own precision, apart from everything upstream. Where the selection runs in a
  module above the router's (a gate returning logits), that module is run again instead.
- **At the model's end.** The whole forward under :class:`~._advise.emulate.Computing`: no
  candidate kept (the uniform policy), every candidate kept, and each candidate alone kept,
  against the reference: the logits' KL divergence and the share of tokens whose argmax changes
  (a model returning ``logits``), else the relative error of its output; the loss change where
  the output has a ``loss``. A candidate's **effect** is the share of the uniform policy's
  error (KL, else output error) that keeping it alone removes.

Memory: the model, plus one module's activations and low-precision parameters at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._advise.emulate import Computing
from fsdp_precision._advise.ends import EndFigures, EndSums
from fsdp_precision._advise.sites import Site, owner_of, within
from fsdp_precision._advise.usage import call_forward, on_model_device, quiet_forward
from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._policy.casts import Boundary

__all__ = ["Candidate", "EndFigures", "Figures", "Measurement", "RouterFigures", "measure"]


@dataclass(frozen=True)
class Candidate:
    """One group of parameters the advisor would keep together (one rule).

    Attributes:
        kind: What the trace found (``"router"``, ``"norm"``, ...).
        pattern: The rule's glob.
        params: The parameters' FQNs.
        boundary: The boundary the rule asks for.
        selects_in: For a router, the modules in which the trace saw the selection (top-k).
    """

    kind: str
    pattern: str
    params: tuple[str, ...]
    boundary: Boundary = "auto"
    selects_in: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouterFigures:
    """One router, compute dtype against kept, on the same inputs.

    Attributes:
        module: FQN of the module whose selection was compared.
        tokens: Rows the selection ran on.
        flips: Share of them whose top-k expert set differs.
        weight_error: ``sum |w - w_kept| / sum |w_kept|`` of the top-k weights over the experts.
    """

    module: str
    tokens: int
    flips: float
    weight_error: float


@dataclass(frozen=True)
class Figures:
    """One candidate, measured.

    Attributes:
        candidate: What was measured.
        module_error: Mean relative error of its modules' outputs, compute dtype against kept.
        module_error_max: The largest of them.
        routers: Per router module, its selection (routers only).
        alone: The model's end with this candidate alone kept.
        effect: Share of the uniform policy's end error that keeping it alone removes (negative:
            keeping it alone moved the output further, within rounding noise).
        bytes_kept: Extra bytes its parameters take gathered when kept instead of computed in
            the compute dtype.
    """

    candidate: Candidate
    module_error: float
    module_error_max: float
    routers: tuple[RouterFigures, ...]
    alone: EndFigures
    effect: float
    bytes_kept: int

    @property
    def flips(self) -> float | None:
        """Share of all routed tokens whose expert set changes (routers only)."""
        tokens = sum(r.tokens for r in self.routers)
        return sum(r.flips * r.tokens for r in self.routers) / tokens if tokens else None

    def lines(self, dtype: torch.dtype) -> list[str]:
        """The figures as text, one router per line."""
        low = dtype_name(dtype)
        lines = []
        for r in self.routers:
            lines.append(
                f"router {r.module}: experts change for {r.flips:.2%} of {r.tokens} tokens in "
                f"{low}, routing weights off {r.weight_error:.2%}"
            )
        end = self.alone
        removed = "of the uniform policy's logits KL" if end.kl is not None else "of its error"
        lines.append(
            f"measured: output off {self.module_error:.2%} in {low} (worst module "
            f"{self.module_error_max:.2%}); kept alone it removes {_share(self.effect)} {removed}, "
            f"for {_size(self.bytes_kept)} more gathered"
        )
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON-ready data."""
        return {
            "pattern": self.candidate.pattern,
            "kind": self.candidate.kind,
            "params": list(self.candidate.params),
            "module_error": self.module_error,
            "module_error_max": self.module_error_max,
            "flips": self.flips,
            "routers": [asdict(r) for r in self.routers],
            "alone": asdict(self.alone),
            "effect": self.effect,
            "bytes_kept": self.bytes_kept,
        }


@dataclass(frozen=True)
class Measurement:
    """What bf16 does to each candidate, measured.

    Attributes:
        dtype: The compute dtype measured against the stored one.
        batches: How many batches ran.
        source: What they were.
        uniform: The model's end with no candidate kept.
        kept_all: The model's end with every candidate kept.
        figures: One per candidate, in the advice's order.
        seconds: Wall time of the measurement.
    """

    dtype: torch.dtype
    batches: int
    source: str
    uniform: EndFigures
    kept_all: EndFigures
    figures: tuple[Figures, ...]
    seconds: float

    def describe(self) -> str:
        """What was measured, on what, how long it took."""
        return (
            f"measured {dtype_name(self.dtype)} against the stored precision on {self.source}, "
            f"in {self.seconds:.1f} s"
        )

    def summary(self) -> list[str]:
        """The model's end under the uniform policy and with every candidate kept, and the
        candidates ranked by effect per byte kept."""
        lines = [
            f"at the end, {dtype_name(self.dtype)} uniform: {_end_text(self.uniform)}",
            f"at the end, every candidate kept: {_end_text(self.kept_all)}",
        ]
        ranked = [f for f in self.ranked() if f.effect > 0]
        if ranked:
            shown = "; ".join(
                f"{i}. {f.candidate.pattern} ({f.effect:.0%}, {_size(f.bytes_kept)})"
                for i, f in enumerate(ranked, 1)
            )
            lines.append(f"by effect per byte kept: {shown}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The measurement as JSON-ready data."""
        return {
            "dtype": dtype_name(self.dtype),
            "batches": self.batches,
            "source": self.source,
            "seconds": self.seconds,
            "uniform": asdict(self.uniform),
            "kept_all": asdict(self.kept_all),
            "figures": [f.to_dict() for f in self.figures],
            "ranked": [f.candidate.pattern for f in self.ranked()],
        }

    def ranked(self) -> tuple[Figures, ...]:
        """The candidates by effect per byte kept, largest first."""
        return tuple(
            sorted(self.figures, key=lambda f: f.effect / max(f.bytes_kept, 1), reverse=True)
        )


def _share(value: float) -> str:
    """A share in whole percent, with no ``-0%``."""
    return f"{round(value, 2) + 0.0:.0%}"


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024  # type: ignore[assignment]
    return f"{count} B"


def _end_text(end: EndFigures) -> str:
    parts = []
    if end.kl is not None and end.argmax_flips is not None:
        parts.append(f"logits KL {end.kl:.3g}, argmax flips {end.argmax_flips:.2%}")
    parts.append(f"output off {end.output_error:.2%}")
    if end.loss_delta is not None:
        parts.append(f"loss {end.loss_delta:+.3g}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------- measure


def _sites(model: nn.Module, candidate: Candidate) -> list[Site]:
    """Where ``candidate`` is run again: each owner of its parameters, or for a router the
    module above it where the trace saw its selection."""
    names: dict[str, None] = {}
    for param in candidate.params:
        owner = owner_of(param)
        names.setdefault(next((w for w in candidate.selects_in if within(owner, w)), owner))
    return [Site(model, name, candidate.params) for name in names]


def _extra_bytes(model: nn.Module, candidate: Candidate, dtype: torch.dtype) -> int:
    params = dict(model.named_parameters())
    return sum(
        params[p].numel() * max(params[p].element_size() - dtype.itemsize, 0)
        for p in candidate.params
    )


def measure(
    model: nn.Module,
    candidates: Sequence[Candidate],
    batches: Sequence[Any],
    *,
    dtype: torch.dtype = torch.bfloat16,
    source: str = "the given batches",
) -> Measurement:
    """Measure ``candidates`` of ``model`` (unsharded, with values, in its stored precision) on
    ``batches`` (each a mapping of keyword arguments, a tuple of positional ones, or a tensor).
    The model is left as it was."""
    start = time.perf_counter()
    sites = {c.pattern: _sites(model, c) for c in candidates}
    configs: dict[str, dict[str, Boundary]] = {"uniform": {}, "kept_all": {}}
    for c in candidates:
        configs["kept_all"].update(dict.fromkeys(c.params, c.boundary))
        configs[c.pattern] = dict.fromkeys(c.params, c.boundary)
    sums = {name: EndSums() for name in configs}
    busy = [False]

    def rerun(site: Site) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not busy[0]:
                busy[0] = True
                try:
                    site.rerun(args, kwargs, dtype)
                finally:
                    busy[0] = False

        return hook

    with quiet_forward(model, experts="eager"):
        for batch in batches:
            moved = on_model_device(model, batch)
            handles = [
                site.module.register_forward_hook(rerun(site), with_kwargs=True)
                for found in sites.values()
                for site in found
            ]
            try:
                reference = call_forward(model, moved)
            finally:
                for handle in handles:
                    handle.remove()
            for name, kept in configs.items():
                with Computing(model, dtype, kept):
                    sums[name].add(reference, call_forward(model, moved))
    uniform = sums["uniform"].figures()
    figures = []
    for c in candidates:
        errors = [e for site in sites[c.pattern] for e in site.errors]
        routers = tuple(
            RouterFigures(s.name, int(s.selections[0]), s.selections[1] / s.selections[0],
                          s.selections[2] / s.selections[3] if s.selections[3] else 0.0)
            for s in sites[c.pattern]
            if s.selections[0]
        )  # fmt: skip
        alone = sums[c.pattern].figures()
        effect = (uniform.error - alone.error) / uniform.error if uniform.error else 0.0
        figures.append(
            Figures(
                candidate=c,
                module_error=sum(errors) / len(errors) if errors else 0.0,
                module_error_max=max(errors, default=0.0),
                routers=routers if c.kind == "router" else (),
                alone=alone,
                effect=effect,
                bytes_kept=_extra_bytes(model, c, dtype),
            )
        )
    return Measurement(
        dtype=dtype,
        batches=len(batches),
        source=source,
        uniform=uniform,
        kept_all=sums["kept_all"].figures(),
        figures=tuple(figures),
        seconds=time.perf_counter() - start,
    )
