"""``fsdp-precision plan MODEL``: the precision plan of a model, before any GPU hour is spent."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._advise.advice import PrecisionAdvice
from fsdp_precision._cli.advise import measured_advice, traced_advice
from fsdp_precision._cli.calibration import Calibration
from fsdp_precision._cli.models import one_line
from fsdp_precision._cli.options import (
    BOUNDARY_NAMES,
    DTYPES,
    UNITS,
    precision_rules,
    units_of,
)
from fsdp_precision._cli.spec import ModelSpec, own_or, resolve
from fsdp_precision._plan.compile import compile_param_dtype_maps
from fsdp_precision._plan.memory import memory_per_rank
from fsdp_precision._plan.meshes import Meshes
from fsdp_precision._plan.plan import PrecisionPlan
from fsdp_precision._rules.rules import PrecisionRules
from fsdp_precision._train.config import DistributedConfig
from fsdp_precision._train.wrap import plan_model_for_training
from fsdp_precision._verify.trace import DtypeTrace, trace_compute_dtypes

__all__ = ["PlanOptions", "run_plan"]


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    model: str
    world_size: int = 8
    tp: int = 1
    ep: int = 1
    pp: int = 1
    precision: str = "bf16"
    min_params: int = 10_000_000
    rules: tuple[str, ...] = ()
    units: str = "size"
    boundary: str = "auto"
    advice: str = "report"
    advice_threshold: float | None = None
    measure: bool = False
    data: str | None = None
    batches: int = 4
    batch_size: int = 4
    seq_len: int = 128
    uncast_inputs: tuple[str, ...] = ()
    trace: bool = True
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        for flag in ("tp", "ep", "pp"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag} must be >= 1, got {getattr(self, flag)}")
        if self.min_params < 0:
            raise ValueError(f"--min-params must be >= 0, got {self.min_params}")
        if self.units not in UNITS:
            raise ValueError(f"--units must be one of {', '.join(UNITS)}, got {self.units!r}")
        if self.boundary not in BOUNDARY_NAMES:
            raise ValueError(
                f"--boundary must be one of {', '.join(BOUNDARY_NAMES)}, got {self.boundary!r}"
            )
        _rules(self)  # --precision, --keep, --advice(-threshold): refused before anything runs


def _rules(opts: PlanOptions) -> PrecisionRules:
    return precision_rules(
        opts.precision,
        opts.rules,
        boundary=opts.boundary,  # type: ignore[arg-type]
        advice=opts.advice,  # type: ignore[arg-type]
        advice_threshold=opts.advice_threshold,
        uncast_inputs=opts.uncast_inputs,
    )


def _plan(
    model: nn.Module,
    opts: PlanOptions,
    world_size: int,
    inputs: Any = None,
    advice: PrecisionAdvice | None = None,
) -> PrecisionPlan:
    """The plan; ``inputs`` feed its traced forwards (the units torch can run, the precision
    advisor) where the model has no ``dummy_inputs`` of its own (Diffusers, module:callable),
    or where they hold arguments its own lack (pixel values, an encoder-decoder's decoder
    inputs); ``advice``, found already, is used as it is."""
    rules = _rules(opts)
    inputs = own_or(model, inputs)
    if opts.units == "size":  # wrap_model_for_training's units, refusals explained
        config = DistributedConfig(
            fsdp_mixed_precision=rules, fsdp_auto_wrap_min_params=opts.min_params
        )
        return plan_model_for_training(
            model, config, world_size=world_size, example_inputs=inputs, advice=advice
        )
    units = units_of(model, opts.units, min_params=opts.min_params)
    return compile_param_dtype_maps(
        model, rules, units, world_size=world_size, example_inputs=inputs, advice=advice
    )


def _advice(
    opts: PlanOptions, spec: ModelSpec, model: nn.Module, inputs: Any
) -> PrecisionAdvice | None:
    """The advisor's findings: measured on the model's weights (``--measure``, or
    ``--advice measured``), else traced (:func:`~fsdp_precision._cli.advise.traced_advice`)."""
    if opts.advice == "off":
        return None
    if opts.measure or opts.advice == "measured":
        calibration = Calibration(
            batches=opts.batches, batch_size=opts.batch_size, seq_len=opts.seq_len
        )
        dtype = DTYPES[opts.precision]
        if dtype == torch.float32:
            raise ValueError("--measure compares the compute dtype with fp32: use --precision bf16")
        return measured_advice(spec, opts.data, calibration, dtype)
    return traced_advice(spec, model, own_or(model, inputs))


def _trace(opts: PlanOptions, spec: ModelSpec) -> tuple[DtypeTrace | None, str]:
    """The first forward in the planned compute dtypes, on verify's inputs: on a tiny CPU build
    of a transformers or Diffusers config (the same module classes; MoE forwards cannot run on
    meta), on the meta build of a ``module:callable`` model (nothing shrinks it; the meta
    kernels check dtypes), or not at all (no inputs: the reason is said)."""
    if not opts.trace:
        return None, "not traced (--no-trace)"
    hf = spec.is_hf
    copy = "a tiny CPU build of the same config" if hf else "the model's meta build"
    torch.manual_seed(0)
    try:  # the plan above stands where the traced copy cannot be built: untraced, and why
        tiny = spec.build_tiny("cpu", dtype=torch.float32) if hf else spec.build()
    except Exception as exc:  # noqa: BLE001
        return None, f"not traced: {copy} cannot be built ({one_line(exc)})"
    try:
        inputs = spec.inputs(tiny, torch.Generator().manual_seed(0))
    except ValueError as exc:  # no inputs for this model
        return None, f"not traced: {exc}"
    try:
        plan = _plan(tiny, opts, world_size=1, inputs=inputs)
    except Exception as exc:  # noqa: BLE001
        return None, f"not traced: {copy} cannot be planned ({one_line(exc)})"
    trace = trace_compute_dtypes(plan, inputs)
    if not hf:
        return trace, "traced on the model's meta build, in the planned compute dtypes"
    return trace, "traced on a tiny CPU build of the same config, in the planned compute dtypes"


def run_plan(opts: PlanOptions) -> int:
    spec = resolve(opts.model)
    model = spec.build()
    inputs = spec.inputs_or_none(model)
    plan = _plan(model, opts, opts.world_size, inputs, _advice(opts, spec, model, inputs))
    meshes = Meshes(tp=opts.tp, ep=opts.ep, pp=opts.pp)
    meshes_or_none = None if meshes.trivial else meshes
    if meshes_or_none is not None:
        plan.mesh_totals(meshes)  # refused before anything prints: ValueError names the fix
    memory = memory_per_rank(plan)
    trace, how = _trace(opts, spec)
    if opts.as_json:
        data: dict[str, Any] = plan.to_dict(meshes=meshes_or_none)
        data["memory_per_rank_bytes"] = memory
        data["units_layout"] = opts.units
        data["first_forward"] = {"how": how, **(asdict(trace) if trace else {})}
        print(json.dumps(data, indent=2))
        return 0
    print(plan.explain(meshes=meshes_or_none))
    gib = 1024**3
    total = sum(memory.values())
    print(
        f"\nmemory per rank at world size {opts.world_size} (AdamW, before activations"
        + ("; FSDP's shards alone, TP/EP/PP not divided in" if meshes_or_none else "")
        + "): "
        + ", ".join(f"{k} {v / gib:,.2f} GiB" for k, v in memory.items())
        + f"; total {total / gib:,.2f} GiB"
    )
    print(f"units: {opts.units} (--units size | transformer_block | accelerate)")
    print(_first_forward(trace, how))
    if trace is not None and trace.rounded_inputs:
        print(_rounded_inputs(trace))
    return 0


def _rounded_inputs(trace: DtypeTrace) -> str:
    """The inputs the units' casts round, and the names worth ``--uncast-inputs``."""
    lines = ["unit inputs the input cast rounds (first forward):"]
    for r in trace.rounded_inputs:
        fate = f"left {r.dtype} (uncast)" if r.uncast else f"-> {r.cast_to}"
        lines.append(f"  {r.unit}: {r.argument} ({r.dtype} from {r.producer}) {fate}")
    suggested = trace.suggested_uncast()
    if suggested:
        names = ",".join(suggested)
        lines.append(
            f"  computed wide on purpose, by the look of it: --uncast-inputs {names} "
            f"(PrecisionRules(uncast_inputs={suggested!r})) keeps them so into the units"
        )
    return "\n".join(lines)


def _first_forward(trace: DtypeTrace | None, how: str) -> str:
    if trace is None:
        return f"first forward: {how}"
    if trace.ok:
        return f"first forward: runs ({how})"
    if not trace.dtype_error:
        return f"first forward: not checked ({how}; it stopped at {trace.error})"
    lines = [
        f"warning: the first forward fails in the planned compute dtypes ({how}): {trace.error}"
    ]
    lines.extend(f"  {note}" for note in trace.notes)
    return "\n".join(lines)
