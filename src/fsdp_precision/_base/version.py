"""The package version, single-sourced from ``pyproject.toml`` through the installed metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__: str = version("fsdp-precision")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
