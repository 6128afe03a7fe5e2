"""Exact per-parameter precision for PyTorch FSDP2.

One entry point for each way of calling ``fully_shard``:

- your own calls: :class:`ParamDtypeMixedPrecisionPolicy` (exact FQN maps) after
  :func:`apply_param_dtype_map_patch`;
- a framework's calls (accelerate, the HF Trainer, TRL, Lightning, torchtitan):
  :func:`model_policy`, one policy for every call on a model;
- a plan of your units: :func:`compile_param_dtype_maps` -> :class:`PrecisionPlan` (``explain()``,
  ``apply()``), from :class:`PrecisionRules`;
- units chosen for you: :func:`wrap_model_for_training` with a :class:`DistributedConfig`.

Which parameters need more than bf16: :func:`advise` (and ``PrecisionRules(advice=...)``).
The trained weights for an inference engine, unit by unit in the dtypes the plan kept:
:func:`full_weights`.

Checkpoints are in :mod:`fsdp_precision.checkpoint`, Hugging Face helpers in
:mod:`fsdp_precision.hf`, framework seams in :mod:`fsdp_precision.integrations`, and what you
check your own model with in :mod:`fsdp_precision.testing`.

>>> import torch
>>> from torch.distributed.fsdp import fully_shard
>>> from fsdp_precision import ParamDtypeMixedPrecisionPolicy, apply_param_dtype_map_patch
>>> apply_param_dtype_map_patch()  # doctest: +SKIP
>>> policy = ParamDtypeMixedPrecisionPolicy(
...     param_dtype=torch.bfloat16,
...     reduce_dtype=torch.float32,
...     param_dtype_map={"norm.weight": torch.float32},
... )
>>> fully_shard(model, mp_policy=policy)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and documentation
    from fsdp_precision._advise.advice import PrecisionAdvice, advise
    from fsdp_precision._base.dtypes import MAPPABLE_DTYPES
    from fsdp_precision._base.errors import (
        EngineDtypeError,
        FsdpPrecisionError,
        ParamDtypeMapError,
        PatchIntegrityError,
        PolicyNotAppliedError,
        RankMismatchError,
        RoutingReplayError,
        UnitUsageError,
        UnsupportedTorchError,
    )
    from fsdp_precision._base.version import __version__
    from fsdp_precision._edges.stream import WeightMeta, WeightStream, full_weights
    from fsdp_precision._patch import (
        apply_param_dtype_map_patch,
        is_param_dtype_map_patch_applied,
        remove_param_dtype_map_patch,
    )
    from fsdp_precision._plan.compile import compile_param_dtype_maps
    from fsdp_precision._plan.meshes import Meshes
    from fsdp_precision._plan.model_policy import model_policy
    from fsdp_precision._plan.plan import PrecisionPlan
    from fsdp_precision._plan.records import PlannedParam, PlannedUnit
    from fsdp_precision._plan.units import auto_wrap_units, default_units
    from fsdp_precision._policy.casts import ModuleCast
    from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy
    from fsdp_precision._releases import SUPPORTED_RELEASES
    from fsdp_precision._rules.rules import Glob, ModuleClass, PrecisionRules
    from fsdp_precision._train.config import PRESETS, DistributedConfig
    from fsdp_precision._train.wrap import (
        make_grad_scaler,
        plan_model_for_training,
        wrap_model_for_training,
    )


#: Every public name -> the module that defines it: imported on first use (PEP 562), so a
#: process that needs one part (vLLM's plugin, the CLI's help) does not import the rest.
_EXPORTS: dict[str, str] = {
    "PrecisionAdvice": "fsdp_precision._advise.advice",
    "advise": "fsdp_precision._advise.advice",
    "MAPPABLE_DTYPES": "fsdp_precision._base.dtypes",
    "EngineDtypeError": "fsdp_precision._base.errors",
    "FsdpPrecisionError": "fsdp_precision._base.errors",
    "ParamDtypeMapError": "fsdp_precision._base.errors",
    "PatchIntegrityError": "fsdp_precision._base.errors",
    "PolicyNotAppliedError": "fsdp_precision._base.errors",
    "RankMismatchError": "fsdp_precision._base.errors",
    "RoutingReplayError": "fsdp_precision._base.errors",
    "UnitUsageError": "fsdp_precision._base.errors",
    "UnsupportedTorchError": "fsdp_precision._base.errors",
    "__version__": "fsdp_precision._base.version",
    "WeightMeta": "fsdp_precision._edges.stream",
    "WeightStream": "fsdp_precision._edges.stream",
    "full_weights": "fsdp_precision._edges.stream",
    "apply_param_dtype_map_patch": "fsdp_precision._patch",
    "is_param_dtype_map_patch_applied": "fsdp_precision._patch",
    "remove_param_dtype_map_patch": "fsdp_precision._patch",
    "compile_param_dtype_maps": "fsdp_precision._plan.compile",
    "Meshes": "fsdp_precision._plan.meshes",
    "model_policy": "fsdp_precision._plan.model_policy",
    "PrecisionPlan": "fsdp_precision._plan.plan",
    "PlannedParam": "fsdp_precision._plan.records",
    "PlannedUnit": "fsdp_precision._plan.records",
    "auto_wrap_units": "fsdp_precision._plan.units",
    "default_units": "fsdp_precision._plan.units",
    "ModuleCast": "fsdp_precision._policy.casts",
    "ParamDtypeMixedPrecisionPolicy": "fsdp_precision._policy.policy",
    "SUPPORTED_RELEASES": "fsdp_precision._releases",
    "Glob": "fsdp_precision._rules.rules",
    "ModuleClass": "fsdp_precision._rules.rules",
    "PrecisionRules": "fsdp_precision._rules.rules",
    "PRESETS": "fsdp_precision._train.config",
    "DistributedConfig": "fsdp_precision._train.config",
    "make_grad_scaler": "fsdp_precision._train.wrap",
    "plan_model_for_training": "fsdp_precision._train.wrap",
    "wrap_model_for_training": "fsdp_precision._train.wrap",
}

__all__ = [
    "MAPPABLE_DTYPES",
    "PRESETS",
    "SUPPORTED_RELEASES",
    "DistributedConfig",
    "EngineDtypeError",
    "FsdpPrecisionError",
    "Glob",
    "Meshes",
    "ModuleCast",
    "ModuleClass",
    "ParamDtypeMapError",
    "ParamDtypeMixedPrecisionPolicy",
    "PatchIntegrityError",
    "PolicyNotAppliedError",
    "PlannedParam",
    "PlannedUnit",
    "PrecisionAdvice",
    "PrecisionPlan",
    "PrecisionRules",
    "RankMismatchError",
    "RoutingReplayError",
    "UnitUsageError",
    "UnsupportedTorchError",
    "WeightMeta",
    "WeightStream",
    "__version__",
    "advise",
    "apply_param_dtype_map_patch",
    "auto_wrap_units",
    "compile_param_dtype_maps",
    "default_units",
    "full_weights",
    "is_param_dtype_map_patch_applied",
    "make_grad_scaler",
    "model_policy",
    "plan_model_for_training",
    "remove_param_dtype_map_patch",
    "wrap_model_for_training",
]

#: What 0.1 exported here that moved to :mod:`fsdp_precision.checkpoint` (its functions and
#: errors) still works for this release, with a ``DeprecationWarning`` naming the new spelling.
_NEW_IN_CHECKPOINT = ("METADATA_FILE", "StateDictType")


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name != "__version__":  # module protocol (__path__, ...)
        raise AttributeError(name)
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later lookups find it directly
        return value
    checkpoint = importlib.import_module(f"{__name__}.checkpoint")  # also for the submodule
    if name == "checkpoint":
        return checkpoint
    if name in checkpoint.__all__ and name not in _NEW_IN_CHECKPOINT:
        warnings.warn(
            f"fsdp_precision.{name} moved: use fsdp_precision.checkpoint.{name} "
            f"(from fsdp_precision.checkpoint import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'fsdp_precision' has no attribute {name!r}")


logging.getLogger(__name__).addHandler(logging.NullHandler())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
