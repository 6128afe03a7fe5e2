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

__all__ = ["lookup", "source_sha256", "verify_sources"]


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


def verify_sources(expected: Mapping[str, str], *, torch_version: str) -> None:
    """Raise :class:`PatchIntegrityError` on the first target whose source hash differs."""
    for target, sha in expected.items():
        try:
            actual = source_sha256(lookup(target))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            raise PatchIntegrityError(
                f"fsdp_precision cannot find {target} in torch {torch_version} ({exc}); the "
                "patch for this release was written against a different torch build. Install "
                "the torch release the patch supports, or report the torch build you use"
            ) from exc
        if actual != sha:
            raise PatchIntegrityError(
                f"fsdp_precision refuses to patch torch {torch_version}: {target} differs from "
                f"the source this patch was written for (sha256 {actual[:12]}..., expected "
                f"{sha[:12]}...). Nothing was patched. Install an unmodified torch of a "
                "supported release, or, for a fully supported path without the patch, give "
                "each fp32 module its own fully_shard unit with param_dtype=None"
            )
