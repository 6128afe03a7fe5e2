"""Dtypes: which ones a ``param_dtype_map`` may name (and why the others are rejected), and how
every message, table and JSON document of the package spells one."""

from __future__ import annotations

import torch

__all__ = [
    "MAPPABLE_DTYPES",
    "check_mappable_dtype",
    "dtype_from_name",
    "dtype_name",
    "dtype_repr",
    "exact_upcast",
    "optional_name",
]


def _dtypes(*names: str) -> tuple[torch.dtype, ...]:
    # Older releases lack some float8 variants; keep what this torch has.
    found = (getattr(torch, name, None) for name in names)
    return tuple(d for d in found if isinstance(d, torch.dtype))


MAPPABLE_DTYPES: tuple[torch.dtype, ...] = _dtypes(
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)
"""Dtypes a ``param_dtype_map`` entry may name (contract point 6), those this torch has."""

# Rejected by name: FSDP would need a slow, per-tensor path for them.
_REJECTED: dict[str, str] = {
    "float8_e8m0fnu": (
        "it is an exponent-only scale format with no arithmetic; keep scales as part of a "
        "tensor subclass with fsdp_pre_all_gather/fsdp_post_all_gather instead"
    ),
    "float4_e2m1fn_x2": (
        "it packs two values per byte, so a parameter's numel does not map to its bytes; "
        "use a tensor subclass with fsdp_pre_all_gather/fsdp_post_all_gather instead"
    ),
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: tables and prose."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16`` for the mappable dtypes; ``None`` for anything else
    (what a file says is never looked up beyond them)."""
    return next((d for d in MAPPABLE_DTYPES if dtype_name(d) == name), None)


def dtype_repr(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"torch.bfloat16"``, ``None`` -> ``"None"``: messages that quote a
    policy's value as the user would write it."""
    return "None" if dtype is None else f"torch.{dtype_name(dtype)}"


def optional_name(dtype: torch.dtype | None) -> str | None:
    """``dtype_name`` that keeps ``None`` (JSON's ``null``)."""
    return None if dtype is None else dtype_name(dtype)


def check_mappable_dtype(dtype: object, *, where: str) -> torch.dtype:
    """Return ``dtype`` if a parameter may be mapped to it, else raise ``ValueError``.

    ``where`` names the entry in the message, e.g. ``"param_dtype_map['norm.weight']"``.
    """
    allowed = ", ".join(dtype_name(d) for d in MAPPABLE_DTYPES)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"{where} must be a torch.dtype, got {dtype!r} ({type(dtype).__name__}); "
            f"use one of: {allowed}"
        )
    name = dtype_name(dtype)
    if name in _REJECTED:
        raise ValueError(f"{where} is torch.{name}, which is not supported: {_REJECTED[name]}")
    if dtype not in MAPPABLE_DTYPES:
        kind = "complex" if dtype.is_complex else "non-floating"
        raise ValueError(
            f"{where} is torch.{name}, a {kind} dtype; mixed precision applies to floating "
            f"dtypes only: use one of {allowed}, or leave the parameter out of the map"
        )
    return dtype


def exact_upcast(storage: torch.dtype, kept: torch.dtype) -> bool:
    """Whether every ``storage`` value is exactly a ``kept`` value, and ``kept`` is wider: at
    least as many mantissa bits, at least the range, normals reaching at least as low."""
    if not (storage.is_floating_point and kept.is_floating_point):
        return False
    if storage.itemsize >= kept.itemsize:
        return False
    s, k = torch.finfo(storage), torch.finfo(kept)
    return k.eps <= s.eps and k.max >= s.max and k.smallest_normal <= s.smallest_normal
