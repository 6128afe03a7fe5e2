"""``fsdp-precision advise MODEL``: which parameters need more than bf16, from a traced forward,
and with ``--measure`` what bf16 does to each of them on the model's own weights and data."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from fsdp_precision._advise.advice import PrecisionAdvice, advise
from fsdp_precision._advise.usage import default_inputs
from fsdp_precision._cli.calibration import Calibration, calibration_batches, load_weights
from fsdp_precision._cli.hf_inputs import adds_to
from fsdp_precision._cli.models import is_hf_spec, load_model, load_tiny_model
from fsdp_precision._cli.options import DTYPES

__all__ = [
    "AdviseOptions",
    "inputs_for",
    "measured_advice",
    "own_or",
    "run_advise",
    "traced_advice",
]


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
    spec: str, data: str | None, calibration: Calibration, dtype: torch.dtype
) -> PrecisionAdvice:
    """The advice for MODEL with its weights, measured on the calibration batches."""
    model = load_weights(spec)
    batches, source = calibration_batches(spec, model, data, calibration)
    found = advise(model, batches, measure=True, dtype=dtype)
    if found.measured is None:
        return found
    return replace(found, measured=replace(found.measured, source=source))


def traced_advice(spec: str, model: nn.Module, inputs: object) -> PrecisionAdvice:
    """The advisor's findings: the full-size forward on the meta device; where that stops
    before its end (it reads values: MoE dispatch, ``Tensor.item()``), the same forward on a
    tiny CPU build of the config, its findings carried to the full-size names by block."""
    found = advise(model, inputs)
    if found.complete or not is_hf_spec(spec):
        return found
    from fsdp_precision._cli.verify import make_inputs  # lazy: verify's inputs, one place

    torch.manual_seed(0)
    try:
        tiny = load_tiny_model(spec, device="cpu", dtype=torch.float32)
        tiny_inputs = make_inputs(spec, tiny, torch.Generator().manual_seed(0))
    except Exception:  # noqa: BLE001 - no tiny build: the meta trace's advice, as it stopped
        return found
    carried = advise(model, own_or(tiny, tiny_inputs), stand_in=tiny)
    if not (carried.complete or (carried.covered and not found.covered)):
        return found
    why = found.stopped or "read no parameter"
    return replace(carried, traced=f"{carried.traced} (on the meta device it stopped: {why})")


def own_or(model: nn.Module, inputs: Any) -> Any:
    """``inputs`` for ``model``'s traced forwards, or ``None`` for its own ``dummy_inputs``
    (a transformers model's, unless ``inputs`` add pixel values, decoder inputs, ...)."""
    own = default_inputs(model)
    return None if own is not None and not adds_to(inputs, own[0]) else inputs


def inputs_for(spec: str, model: nn.Module) -> dict[str, Any] | None:
    """verify's inputs for ``model``, or ``None`` where it makes none (the advice then says it
    traced nothing, and the first forward why)."""
    from fsdp_precision._cli.verify import make_inputs  # lazy: verify's inputs, one place

    try:
        return make_inputs(spec, model, torch.Generator().manual_seed(0))
    except ValueError:
        return None


def run_advise(opts: AdviseOptions) -> int:
    if opts.measure:
        found = measured_advice(opts.model, opts.data, opts.calibration, DTYPES[opts.precision])
    else:
        model = load_model(opts.model)
        found = traced_advice(opts.model, model, own_or(model, inputs_for(opts.model, model)))
    if opts.as_json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        print(found.explain())
    return 0
