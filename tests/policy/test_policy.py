"""ParamDtypeMixedPrecisionPolicy: construction-time validation (no process group needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision import MAPPABLE_DTYPES, ParamDtypeMixedPrecisionPolicy

P = ParamDtypeMixedPrecisionPolicy


@pytest.mark.parametrize("dtype", MAPPABLE_DTYPES, ids=str)
def test_mappable_dtypes_accepted(dtype: torch.dtype) -> None:
    policy = P(param_dtype=torch.bfloat16, param_dtype_map={"w": dtype})
    assert policy.param_dtype_map["w"] is dtype


def test_matrix_is_the_contract() -> None:
    names = {str(d).removeprefix("torch.") for d in MAPPABLE_DTYPES}
    assert names == {
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    }


REJECTED = [
    ("float8_e8m0fnu", r"torch\.float8_e8m0fnu, which is not supported: it is an exponent-only"),
    ("float4_e2m1fn_x2", r"torch\.float4_e2m1fn_x2, which is not supported: it packs two"),
    ("int32", r"torch\.int32, a non-floating dtype"),
    ("bool", r"torch\.bool, a non-floating dtype"),
    ("uint8", r"torch\.uint8, a non-floating dtype"),
    ("complex64", r"torch\.complex64, a complex dtype"),
]


@pytest.mark.parametrize(("name", "message"), REJECTED)
def test_unsupported_dtypes_rejected_by_name(name: str, message: str) -> None:
    dtype = getattr(torch, name)
    with pytest.raises(ValueError, match=r"param_dtype_map\['w'\] is " + message):
        P(param_dtype_map={"w": dtype})


BAD_MAPS = [
    ({"w": "float32"}, r"param_dtype_map\['w'\] must be a torch.dtype, got 'float32' \(str\)"),
    ({"blocks.*.norm.weight": torch.float32}, r"contains a wildcard; keys are exact FQNs"),
    ({"": torch.float32}, r"keys must be non-empty parameter FQNs, got ''"),
    ({3: torch.float32}, r"keys must be non-empty parameter FQNs, got 3"),
    ([("w", torch.float32)], r"param_dtype_map must be a mapping .* got list"),
]


@pytest.mark.parametrize(("dtype_map", "message"), BAD_MAPS)
def test_bad_maps_rejected(dtype_map: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P(param_dtype_map=dtype_map)  # type: ignore[arg-type]


def test_policy_is_a_frozen_hashable_mixed_precision_policy() -> None:
    source = {"norm.weight": torch.float32}
    policy = P(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, param_dtype_map=source)
    assert isinstance(policy, MixedPrecisionPolicy)
    source["norm.bias"] = torch.float32  # the policy took a copy
    assert dict(policy.param_dtype_map) == {"norm.weight": torch.float32}
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.param_dtype_map["x"] = torch.float32  # type: ignore[index]
    same = P(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_map=dict(policy.param_dtype_map),
    )
    assert policy == same and hash(policy) == hash(same)
    assert policy != P(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert "norm.weight" in repr(policy) and "torch.float32" in repr(policy)
