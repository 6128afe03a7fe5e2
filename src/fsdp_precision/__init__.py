"""Exact per-parameter precision for PyTorch FSDP2.

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

import logging

from ._checkpoint import (
    export_safetensors,
    load_checkpoint,
    load_model_state_dict,
    model_state_dict,
    read_checkpoint_metadata,
    save_checkpoint,
)
from ._compile import compile_param_dtype_maps, default_units
from ._config import PRESETS, DistributedConfig
from ._dtypes import MAPPABLE_DTYPES
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    FsdpPrecisionError,
    ParamDtypeMapError,
    PatchIntegrityError,
    StateDictMismatchError,
    UnitUsageError,
    UnsupportedTorchError,
)
from ._patch import (
    SUPPORTED_RELEASES,
    apply_param_dtype_map_patch,
    is_param_dtype_map_patch_applied,
    remove_param_dtype_map_patch,
)
from ._policy import ParamDtypeMixedPrecisionPolicy
from ._records import PlannedParam, PlannedUnit, PrecisionPlan
from ._rules import Glob, ModuleClass, PrecisionRules
from ._scope import model_policy
from ._units import auto_wrap_units
from ._wrap import (
    make_grad_scaler,
    plan_model_for_training,
    wrap_model_for_training,
)

__version__ = "0.1.0"

__all__ = [
    "MAPPABLE_DTYPES",
    "PRESETS",
    "SUPPORTED_RELEASES",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "DistributedConfig",
    "FsdpPrecisionError",
    "Glob",
    "ModuleClass",
    "ParamDtypeMapError",
    "ParamDtypeMixedPrecisionPolicy",
    "PatchIntegrityError",
    "PlannedParam",
    "PlannedUnit",
    "PrecisionPlan",
    "PrecisionRules",
    "StateDictMismatchError",
    "UnitUsageError",
    "UnsupportedTorchError",
    "apply_param_dtype_map_patch",
    "auto_wrap_units",
    "compile_param_dtype_maps",
    "default_units",
    "export_safetensors",
    "is_param_dtype_map_patch_applied",
    "load_checkpoint",
    "load_model_state_dict",
    "make_grad_scaler",
    "model_policy",
    "model_state_dict",
    "plan_model_for_training",
    "read_checkpoint_metadata",
    "remove_param_dtype_map_patch",
    "save_checkpoint",
    "wrap_model_for_training",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
