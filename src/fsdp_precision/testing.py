"""Check your own model the way this library checks itself.

Public, documented helpers for tests, examples, benchmarks and the CLI: the separate-units
reference (the public-API way to keep parameters in another dtype), the gather observer (what each
unit really all-gathers, seen in forward pre-hooks), the collective recorder (every all-gather and
reduce-scatter, with dtype and bytes) and typed results gathered across ranks.
"""

from __future__ import annotations

from fsdp_precision._compare import Comparison, compare, gradient_tolerance, loss_of, output_of
from fsdp_precision._observe import Collective, CollectiveRecorder, GatheredParam, GatherProbe
from fsdp_precision._parity_report import ParamParity, ParityReport
from fsdp_precision._ranks import gather_across_ranks
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
    "loss_of",
    "output_of",
    "tiny_config",
    "verify_parity",
]
