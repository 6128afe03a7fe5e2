"""``fsdp-precision verify MODEL``: parity of a sharded model against its unsharded reference.

The parent process validates everything it can on the meta device (the model, the rules, the
plan at the requested world size, where the inputs come from), so that mistakes are one-line
errors before any process starts; then N gloo processes build the model, wrap it and run
:func:`fsdp_precision.testing.verify_parity`; the parent prints rank 0's report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._advise.advice import PrecisionAdvice
from fsdp_precision._base.dist import is_rank0
from fsdp_precision._base.launch import launch, process_group
from fsdp_precision._cli.options import BOUNDARY_NAMES, UNITS, precision_rules, units_of
from fsdp_precision._cli.spec import ModelSpec, resolve
from fsdp_precision._patch import apply_param_dtype_map_patch
from fsdp_precision._plan.compile import compile_param_dtype_maps
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._verify.parity import verify_parity
from fsdp_precision._verify.report import ParityReport

__all__ = ["VerifyOptions", "format_report", "run_verify"]

_MAX_PROBLEMS = 12  # listed under the table; --json has them all


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """What ``fsdp-precision verify`` checks."""

    model: str
    nproc: int = 2
    precision: str = "bf16"
    rules: tuple[str, ...] = ()
    full_size: bool = False
    min_params: int | None = None
    units: str | None = None
    boundary: str = "auto"
    advice: str = "report"
    uncast_inputs: tuple[str, ...] = ()
    seed: int = 0
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.units is not None and self.units not in UNITS:
            raise ValueError(f"--units must be one of {', '.join(UNITS)}, got {self.units!r}")
        if self.boundary not in BOUNDARY_NAMES:
            raise ValueError(
                f"--boundary must be one of {', '.join(BOUNDARY_NAMES)}, got {self.boundary!r}"
            )
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"--nproc must be an integer >= 1, got {self.nproc!r}")
        if self.min_params is not None and self.min_params < 0:
            raise ValueError(f"--min-params must be >= 0, got {self.min_params}")

    @property
    def tiny(self) -> bool:
        return resolve(self.model).is_hf and not self.full_size


# --------------------------------------------------------------------------- model, plan, inputs


def _build(opts: VerifyOptions, device: str) -> tuple[nn.Module, PrecisionPlan, ModelSpec]:
    """The model, its plan at ``opts.nproc`` ranks, and ``MODEL`` resolved."""
    torch.manual_seed(opts.seed)
    spec = resolve(opts.model)
    # fp32 master weights for Hugging Face models (from_config would take the config's dtype);
    # a module:callable model is used as it is built.
    model = spec.build(device, tiny=opts.tiny, dtype=torch.float32 if spec.is_hf else None)
    rules = precision_rules(
        opts.precision,
        opts.rules,
        boundary=opts.boundary,  # type: ignore[arg-type]
        advice=opts.advice,  # type: ignore[arg-type]
        uncast_inputs=opts.uncast_inputs,
    )
    layout = opts.units or ("transformer_block" if opts.min_params is None else "size")
    # The check's own inputs feed the traced forwards: the one that keeps units torch cannot
    # run out (size-based units) and, on the ranks' real tensors, the precision advisor's.
    inputs = spec.inputs(model, torch.Generator().manual_seed(opts.seed))
    min_params = 10_000_000 if opts.min_params is None else opts.min_params
    units = units_of(
        model, layout, min_params=min_params, example_inputs=inputs if layout == "size" else None
    )
    advised = inputs if device != "meta" else None
    plan = compile_param_dtype_maps(
        model, rules, units, world_size=opts.nproc, example_inputs=advised
    )
    return model, plan, spec


# --------------------------------------------------------------------------- running


def run_verify(opts: VerifyOptions) -> int:
    """Validate on meta, run the check on ``opts.nproc`` processes, print; 0 ok, 1 mismatch."""
    model, plan, _ = _build(opts, "meta")  # one-line errors before any process starts
    n_params = sum(p.numel() for p in model.parameters())
    del model, plan
    # The ranks are forked where that is safe: they inherit torch and transformers already
    # imported (the imports take longer than the check).
    report, advice = launch(_rank, (opts,), nproc=opts.nproc)
    if is_rank0():
        header = {
            "spec": opts.model,
            "tiny": opts.tiny,
            "numel": n_params,
            "precision": opts.precision,
            "torch": torch.__version__,
        }
        found = {"advice": advice.to_dict() if advice is not None else None}
        if opts.as_json:
            print(json.dumps({**header, **report.to_dict(), **found}, indent=2))
        else:
            print(format_report(report, header, advice))
    return 0 if report.ok else 1


def _rank(opts: VerifyOptions) -> tuple[ParityReport, PrecisionAdvice | None]:
    torch.set_num_threads(1)
    with process_group("gloo"):
        apply_param_dtype_map_patch()
        model, plan, spec = _build(opts, "cpu")
        advice = plan.advice  # traced at compile time, before the model is wrapped
        inputs = spec.inputs(model, torch.Generator().manual_seed(opts.seed))
        return verify_parity(plan, inputs, seed=opts.seed), advice


# --------------------------------------------------------------------------- presentation


def format_report(
    report: ParityReport, header: dict[str, Any], advice: PrecisionAdvice | None = None
) -> str:
    """The human report: header, the precision advice, then the report's table and summary
    line (the verdict stays the last line)."""
    world = report.world_size
    size = "tiny config" if header["tiny"] else "as built"
    processes = f"{world} process" if world == 1 else f"{world} processes"
    lines = [
        f"fsdp-precision verify {header['spec']}: {report.model} ({size}, "
        f"{header['numel']:,} parameters), {processes} (gloo, CPU), torch {header['torch']}",
        f"plan: {report.units} FSDP units; {report.rules}",
        f"step: forward, backward, {report.optimizer} on the same inputs on every rank; "
        f"loss {report.loss:.6f}, reference {report.reference_loss:.6f} "
        f"({'bitwise' if report.loss_match else 'DIFFERENT'})",
        "",
        *([advice.explain(), ""] if advice is not None else []),
        report.format(max_problems=_MAX_PROBLEMS, rest="--json lists all"),
    ]
    return "\n".join(lines)
