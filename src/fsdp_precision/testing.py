"""Check your own model the way this library checks itself (see docs/testing.md).

Observe, do not infer: :func:`verify_parity` (one step of the plan-wrapped model against an
unsharded reference that computes as FSDP does, per parameter), :class:`GatherProbe` (what each
FSDP unit really all-gathered, read in forward pre-hooks), :class:`CollectiveRecorder` (every
all-gather and reduce-scatter with dtype and bytes), :func:`gather_across_ranks` (typed results
from every rank), ranks on one machine (:func:`launch`, :func:`process_group`), and small test
models (:class:`TinyDecoder`, :func:`tiny_config`). The CLI, the tests, the examples and the
benchmarks use these same names.
"""

from __future__ import annotations

from fsdp_precision._compare import Comparison, compare, gradient_tolerance, loss_of, output_of
from fsdp_precision._guard import unit_guard
from fsdp_precision._launch import launch, process_group
from fsdp_precision._observe import Collective, CollectiveRecorder, GatheredParam, GatherProbe
from fsdp_precision._parity_report import ParamParity, ParityReport
from fsdp_precision._ranks import gather_across_ranks
from fsdp_precision._separate import wrap_separate_units
from fsdp_precision._tiny import TinyConfig, TinyDecoder
from fsdp_precision._tiny_config import tiny_config
from fsdp_precision._verify import verify_parity

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
    "compare",
    "gather_across_ranks",
    "gradient_tolerance",
    "launch",
    "loss_of",
    "output_of",
    "process_group",
    "tiny_config",
    "unit_guard",
    "verify_parity",
    "wrap_separate_units",
]
