"""The plan's public names, where importers have always found them.

Compiling lives in :mod:`fsdp_precision._compile`, the records in :mod:`fsdp_precision._records`,
reporting in :mod:`fsdp_precision._report`, the cost model in :mod:`fsdp_precision._cost` and
separate units in :mod:`fsdp_precision._separate`.
"""

from __future__ import annotations

from fsdp_precision._compile import compile_param_dtype_maps, default_units
from fsdp_precision._records import PlannedParam, PlannedUnit, PrecisionPlan, RuleClaims

__all__ = [
    "PlannedParam",
    "PlannedUnit",
    "PrecisionPlan",
    "RuleClaims",
    "compile_param_dtype_maps",
    "default_units",
]
