"""``fsdp-precision advise MODEL``: which parameters need more than bf16, from a traced forward,
and with ``--measure`` what bf16 does to each of them on the model's own weights and data."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from fsdp_precision._advise.advice import PrecisionAdvice, advise
from fsdp_precision._cli.calibration import Calibration, calibration_batches
from fsdp_precision._cli.options import DTYPES
from fsdp_precision._cli.spec import ModelSpec, own_or, resolve

__all__ = ["AdviseOptions", "measured_advice", "run_advise", "traced_advice"]


@dataclass(frozen=True, kw_only=True)
class AdviseOptions:
    model: str
    measure: bool = False
    data: str | None = None
    calibration: Calibration = field(default_factory=Calibration)
    precision: str = "bf16"
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.data is not None and not self.measure:
            raise ValueError("--data feeds the measurement: add --measure")


def measured_advice(
    spec: ModelSpec, data: str | None, calibration: Calibration, dtype: torch.dtype
) -> PrecisionAdvice:
    """The advice for MODEL with its weights, measured on the calibration batches."""
    model = spec.with_weights()
    batches, source = calibration_batches(spec, model, data, calibration)
    found = advise(model, batches, measure=True, dtype=dtype)
    if found.measured is None:
        return found
    return replace(found, measured=replace(found.measured, source=source))


def traced_advice(spec: ModelSpec, model: nn.Module, inputs: object) -> PrecisionAdvice:
    """The advisor's findings: the full-size forward on the meta device; where that stops
    before its end (it reads values: MoE dispatch, ``Tensor.item()``), the same forward on a
    tiny CPU build of the config, its findings carried to the full-size names by block."""
    found = advise(model, inputs)
    if found.complete or not spec.is_hf:
        return found
    torch.manual_seed(0)
    try:
        tiny = spec.build_tiny("cpu", dtype=torch.float32)
        tiny_inputs = spec.inputs(tiny, torch.Generator().manual_seed(0))
    except Exception:  # noqa: BLE001 - no tiny build: the meta trace's advice, as it stopped
        return found
    carried = advise(model, own_or(tiny, tiny_inputs), stand_in=tiny)
    if not (carried.complete or (carried.covered and not found.covered)):
        return found
    why = found.stopped or "read no parameter"
    return replace(carried, traced=f"{carried.traced} (on the meta device it stopped: {why})")


def run_advise(opts: AdviseOptions) -> int:
    spec = resolve(opts.model)
    if opts.measure:
        found = measured_advice(spec, opts.data, opts.calibration, DTYPES[opts.precision])
    else:
        model = spec.build()
        found = traced_advice(spec, model, own_or(model, spec.inputs_or_none(model)))
    if opts.as_json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        print(found.explain())
    return 0
