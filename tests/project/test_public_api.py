"""The public surface: the names each face exports, their docstrings, the 0.1 spellings that
still work for this release (with a ``DeprecationWarning`` naming the new one), and the version,
single-sourced from pyproject.toml."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import tomllib

import fsdp_precision as fp

from tests.support import ROOT

#: Every public name, by face: a change here is an API change (CHANGELOG.md, docs/api.md).
SURFACE = {
    "fsdp_precision": [
        "MAPPABLE_DTYPES", "PRESETS", "SUPPORTED_RELEASES", "DistributedConfig",
        "EngineDtypeError", "FsdpPrecisionError", "Glob", "Meshes", "ModuleCast", "ModuleClass", "ParamDtypeMapError",
        "ParamDtypeMixedPrecisionPolicy", "PatchIntegrityError", "PlannedParam", "PlannedUnit",
        "PolicyNotAppliedError",
        "PrecisionAdvice", "PrecisionPlan", "PrecisionRules", "RankMismatchError", "RoutingReplayError", "UnitUsageError", "UnsupportedTorchError",
        "WeightMeta", "WeightStream",
        "__version__", "advise", "apply_param_dtype_map_patch", "auto_wrap_units",
        "compile_param_dtype_maps", "default_units", "full_weights", "is_param_dtype_map_patch_applied",
        "make_grad_scaler", "model_policy", "plan_model_for_training",
        "remove_param_dtype_map_patch", "wrap_model_for_training",
    ],
    "fsdp_precision.checkpoint": [
        "EXPORT_RECORD", "METADATA_FILE", "SAFE_GLOBALS", "CheckpointError", "CheckpointNotFoundError",
        "CheckpointReadError", "CheckpointWriteError", "ExportRecord", "KeptTensor",
        "RecordedCast", "StateDictMismatchError", "StateDictType", "UnsafeCheckpointError", "check_checkpoint",
        "export_safetensors",
        "latest_checkpoint", "load_checkpoint", "load_model_state_dict", "model_state_dict",
        "read_checkpoint_metadata", "read_export_record", "restore_kept", "resume_from_latest",
        "save_checkpoint", "save_step",
    ],
    "fsdp_precision.hf": [
        "Declaration", "cast_keeping_fp32", "keep_in_fp32_declarations", "kept_fqns",
        "library_of", "load_state_dict_aligned",
    ],
    "fsdp_precision.integrations": [
        "KEPT_ENV", "ReceivedWeights", "declare_kept", "accelerate_fsdp2_on_cpu", "cpu_fsdp2_trainer",
        "last_complete_checkpoint", "receive_weights", "send_weights", "trainer_fsdp_policy",
        "transformers_native_fsdp", "weight_group",
    ],
    "fsdp_precision.integrations.vllm": [
        "ARCHITECTURES", "FSDPTrainerInitInfo", "FSDPWeightSource", "TESTED_VLLM",
        "WeightReceiver", "register", "repair_expert_updates", "update_weights",
    ],
    "fsdp_precision.integrations.sglang": [
        "ARCHITECTURES", "READ_SGLANG", "DistributedUpdate", "FlatTensor", "SGLangSettings",
        "distributed_updates", "sglang_settings", "update_payloads",
    ],
    "fsdp_precision.replay": [
        "MISSING", "RouteShape", "RoutingReplay", "RoutingReplayError", "batch_routes",
        "from_sglang", "from_vllm", "spread",
    ],
    "fsdp_precision.testing": [
        "Collective", "CollectiveRecorder", "Comparison", "GatherProbe", "GatheredParam",
        "ParamParity", "ParityReport", "TinyConfig", "TinyDecoder", "gather_across_ranks",
        "launch", "process_group", "tiny_config", "unit_guard", "verify_parity",
        "wrap_separate_units",
    ],
}  # fmt: skip


@pytest.mark.parametrize("face", SURFACE)
def test_each_face_exports_exactly_its_names(face: str) -> None:
    module = importlib.import_module(face)
    assert sorted(module.__all__) == sorted(SURFACE[face])
    for name in module.__all__:
        public(module, name)


@pytest.mark.parametrize("face", SURFACE)
def test_every_public_callable_and_class_has_a_docstring(face: str) -> None:
    module = importlib.import_module(face)
    missing = [
        name
        for name in module.__all__
        if (inspect.isclass(obj := public(module, name)) or inspect.isfunction(obj))
        and not inspect.getdoc(obj)
    ]
    assert missing == []


def public(module: object, name: str) -> object:
    """``module.name``; ``None`` for a name that needs an engine not installed here (vLLM's
    subclasses raise ``ImportError`` saying what to install: checked where vLLM is)."""
    try:
        return getattr(module, name)
    except ImportError as err:
        assert "is not installed here; install it" in str(err)
        return None


def test_every_public_name_is_in_the_api_reference() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    absent = [
        f"{face}.{n}" for face, names in SURFACE.items() for n in names if f"`{n}`" not in api
    ]
    assert absent == []


# (face, 0.1 name, where it lives now)
MOVED = [
    ("fsdp_precision", name, "fsdp_precision.checkpoint")
    for name in (
        "CheckpointError", "CheckpointNotFoundError", "CheckpointReadError",
        "CheckpointWriteError", "StateDictMismatchError", "export_safetensors",
        "load_checkpoint", "load_model_state_dict", "model_state_dict",
        "read_checkpoint_metadata", "save_checkpoint",
    )
] + [
    ("fsdp_precision.testing", name, "fsdp_precision._verify.compare")
    for name in ("compare", "gradient_tolerance", "loss_of", "output_of")
]  # fmt: skip


@pytest.mark.parametrize(("face", "name", "home"), MOVED)
def test_names_of_0_1_still_work_with_a_warning_naming_the_new_spelling(face, name, home) -> None:
    module = importlib.import_module(face)
    with pytest.warns(DeprecationWarning, match=rf"{face}\.{name} (moved|is deprecated)"):
        obj = getattr(module, name)
    assert obj is getattr(importlib.import_module(home), name)
    assert name not in module.__all__


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            fp.nope  # noqa: B018


def test_the_version_is_single_sourced_from_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert fp.__version__ == project["version"]
    assert "version" not in project.get("dynamic", [])
