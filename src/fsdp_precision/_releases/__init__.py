"""Layer 1: the supported torch releases, as data.

One module per release (``v2_11`` ... ``v2_15``): its name, the SHA-256 ``SOURCES`` of every
upstream function the patch replaces or relies on, and its ``TRAITS``, a
:class:`~fsdp_precision._releases.traits.ReleaseTraits` record of what that release's FSDP2 does
differently, with the rules derived from them. Pure data: nothing here imports a torch internal,
so every layer above may ask what the installed release does.

A release module's ``SOURCES`` holds the SHA-256 of every upstream function the patch replaces
or relies on, ``hashed_functions(TRAITS)``. Regenerate it with ``python scripts/hash_sources.py``
in a venv holding that release; check it with ``python scripts/hash_sources.py --check``.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

import torch

from fsdp_precision._base.errors import UnsupportedTorchError
from fsdp_precision._base.sources import WAY_THROUGH
from fsdp_precision._releases.traits import ReleaseTraits

__all__ = [
    "SUPPORTED_RELEASES",
    "ReleaseTraits",
    "release_module",
    "release_module_name",
    "release_traits",
    "torch_release",
]

SUPPORTED_RELEASES: tuple[str, ...] = ("2.11", "2.12", "2.13", "2.14", "2.15")
"""The torch releases (``major.minor``, any patch level and build) this library supports, oldest
first. Release ``X.Y`` lives in ``_releases/v{X}_{Y}.py``; what differs is in its ``TRAITS``."""


def torch_release(version: str | None = None) -> str:
    """``"2.14.1+cu128"`` -> ``"2.14"``: the key of the release module (build suffix ignored)."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise UnsupportedTorchError(f"cannot parse the torch version {text!r}")
    return f"{match.group(1)}.{match.group(2)}"


def release_module_name(release: str) -> str:
    """``"2.14"`` -> ``"v2_14"``: the module holding that release's hashes and traits."""
    return "v" + release.replace(".", "_")


def release_module(version: str | None = None) -> ModuleType:
    """The release module of the installed (or the given) torch release; raises
    :class:`UnsupportedTorchError` naming the supported releases for any other."""
    release = torch_release(version)
    if release not in SUPPORTED_RELEASES:
        supported = ", ".join(SUPPORTED_RELEASES)
        raise UnsupportedTorchError(
            f"fsdp_precision has no patch for torch {torch.__version__} (release {release}); "
            f"supported releases: {supported}. Install one of them (pip install 'torch==2.14.*'), "
            f"or, {WAY_THROUGH}"
        )
    return importlib.import_module(f"{__name__}.{release_module_name(release)}")


def release_traits(version: str | None = None) -> ReleaseTraits:
    """What the installed (or the given) torch release's FSDP2 does differently, as data.

    Reads the release module only (no torch internal is imported, no source is checked); raises
    :class:`UnsupportedTorchError` for a release without one.
    """
    traits: ReleaseTraits = release_module(version).TRAITS
    return traits
