"""Check your own model the way this library checks itself (see docs/testing.md).

Observe, do not infer: :func:`verify_parity` (one step of the plan-wrapped model against an
unsharded reference that computes as FSDP does, per parameter, as a :class:`ParityReport`),
:class:`GatherProbe` (what each FSDP unit really all-gathered, read in forward pre-hooks),
:class:`CollectiveRecorder` (every all-gather and reduce-scatter with dtype and bytes),
:func:`unit_guard` (a module used outside its unit, named), :func:`wrap_separate_units` (the
public-API layout of a plan, a reference to compare with), :func:`gather_across_ranks` (typed
results from every rank), ranks on one machine (:func:`launch`, :func:`process_group`), and
small models (:class:`TinyDecoder`, :func:`tiny_config`). The CLI, the tests, the examples and
the benchmarks use these same names.
"""

from __future__ import annotations

import warnings
from typing import Any

from fsdp_precision._base.dist import gather_across_ranks
from fsdp_precision._base.launch import launch, process_group
from fsdp_precision._observe.collectives import Collective, CollectiveRecorder
from fsdp_precision._observe.gathers import GatheredParam, GatherProbe
from fsdp_precision._observe.guard import unit_guard
from fsdp_precision._plan.separate import wrap_separate_units
from fsdp_precision._verify.compare import Comparison
from fsdp_precision._verify.parity import verify_parity
from fsdp_precision._verify.report import ParamParity, ParityReport
from fsdp_precision.testing._models import TinyConfig, TinyDecoder
from fsdp_precision.testing._tiny_config import tiny_config

__all__: list[str] = [
    "Collective",
    "CollectiveRecorder",
    "Comparison",
    "GatherProbe",
    "GatheredParam",
    "ParamParity",
    "ParityReport",
    "TinyConfig",
    "TinyDecoder",
    "gather_across_ranks",
    "launch",
    "process_group",
    "tiny_config",
    "unit_guard",
    "verify_parity",
    "wrap_separate_units",
]

#: Internals of :func:`verify_parity` that 0.1 exported here; they still work for this release,
#: with a ``DeprecationWarning``.
_INTERNALS = ("compare", "gradient_tolerance", "loss_of", "output_of")


def __getattr__(name: str) -> Any:
    if name in _INTERNALS:
        warnings.warn(
            f"fsdp_precision.testing.{name} is deprecated: it is an internal of verify_parity "
            "(read ParityReport and its ParamParity entries instead); it will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        from fsdp_precision._verify import compare  # lazy: only for the deprecated spelling

        return getattr(compare, name)
    raise AttributeError(f"module 'fsdp_precision.testing' has no attribute {name!r}")
