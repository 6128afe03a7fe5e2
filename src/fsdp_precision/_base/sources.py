"""Source hashes of upstream functions, so a patch never runs against code it was not written for.

A function's source text is the span from its first decorator (or ``def``) to the end of its
last statement, dedented, lines joined with ``\\n``. Comments after the last statement and the
file around it do not count.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from fsdp_precision._base.errors import PatchIntegrityError

__all__ = [
    "WAY_THROUGH",
    "check_sources",
    "lookup",
    "source_differences",
    "source_sha256",
    "verify_sources",
]


def lookup(target: str) -> Any:
    """``"pkg.module:Class.attr"`` -> the object (a property resolves to its getter)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        owner = obj
        obj = (
            inspect.getattr_static(owner, part) if isinstance(owner, type) else getattr(owner, part)
        )
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return obj


def source_sha256(func: Callable[..., Any]) -> str:
    """SHA-256 of ``func``'s source text (see the module docstring for the exact span)."""
    func = inspect.unwrap(func)
    lines, _ = inspect.getsourcelines(func)
    text = textwrap.dedent("".join(lines))
    node = ast.parse(text).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    span = text.splitlines()[: node.end_lineno]
    return hashlib.sha256("\n".join(span).encode()).hexdigest()


#: What an error of an unknown or changed torch names as the way through.
WAY_THROUGH = (
    "to train anyway, plan the public-API layout (each kept module its own fully_shard unit, "
    "bitwise the same numerics, more collectives): compile_param_dtype_maps(..., "
    "unknown_torch='public_api'), DistributedConfig(fsdp_unknown_torch='public_api') or "
    "model_policy(..., unknown_torch='public_api'); fsdp-precision doctor shows what differs"
)


def check_sources(expected: Mapping[str, str]) -> dict[str, str | None]:
    """Each target of ``expected`` (``"pkg.module:qualname"`` -> recorded sha256): ``None``
    where its source matches, else why not (``"sha256 ..., expected ..."``, ``"not found:
    ImportError"``)."""
    checked: dict[str, str | None] = {}
    for target, sha in expected.items():
        try:
            actual = source_sha256(lookup(target))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            checked[target] = f"not found: {type(exc).__name__}"
            continue
        checked[target] = (
            None if actual == sha else f"sha256 {actual[:12]}..., expected {sha[:12]}..."
        )
    return checked


def source_differences(checked: Mapping[str, str | None]) -> list[str]:
    """The targets of a :func:`check_sources` result whose source differs from its recorded
    hash (or cannot be found), as ``"pkg.module:qualname (why)"``; empty when all match."""
    return [f"{target} ({why})" for target, why in checked.items() if why]


def verify_sources(expected: Mapping[str, str], *, torch_version: str) -> None:
    """Raise :class:`PatchIntegrityError` naming every target whose source differs."""
    differing = source_differences(check_sources(expected))
    if differing:
        raise PatchIntegrityError(
            f"fsdp_precision refuses to patch torch {torch_version}: {len(differing)} of the "
            f"{len(expected)} upstream functions the patch replaces or relies on differ from the "
            f"sources it was written for: {'; '.join(differing)}. Nothing was patched. Install "
            f"an unmodified torch of a supported release, or, {WAY_THROUGH}"
        )
