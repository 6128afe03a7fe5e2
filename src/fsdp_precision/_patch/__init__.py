"""The guarded patch of FSDP2 internals: version dispatch, source checks, install and removal.

Layout: one release module per supported torch release (``v2_11`` ... ``v2_15``: its name, the
SHA-256 ``SOURCES`` of every upstream function the patch replaces or relies on, and its
``TRAITS``, a :class:`~._traits.ReleaseTraits` record of what that release does differently);
one implementation of each replaced function, by idea (``_construct``: the ``fully_shard``
construction wrap; ``_native``: torch 2.15's ``param_dtype_override_fn``; ``_mp_dtypes``,
``_gather``, ``_reduce``: the precision machinery), each reading the installed release's traits;
one install registry (``_install``).

Nothing outside this package imports ``torch.distributed.fsdp._fully_shard``. Importing this
package touches no torch internals: a release module is imported only when the patch is applied,
and only after the installed torch release was found in ``SUPPORTED_RELEASES``.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from fsdp_precision._errors import UnsupportedTorchError

from ._sources import verify_sources

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ._traits import ReleaseTraits

__all__ = [
    "SUPPORTED_RELEASES",
    "apply_param_dtype_map_patch",
    "check_planned_call",
    "is_param_dtype_map_patch_applied",
    "release_traits",
    "remove_param_dtype_map_patch",
    "torch_release",
]

logger = logging.getLogger(__name__)

SUPPORTED_RELEASES: tuple[str, ...] = ("2.11", "2.12", "2.13", "2.14", "2.15")
"""The torch releases (``major.minor``, any patch level and build) this library supports, oldest
first. Release ``X.Y`` lives in ``_patch/v{X}_{Y}.py``; what differs is in its ``TRAITS``."""

_lock = threading.Lock()
_applied: ReleaseTraits | None = None  # the installed release's traits, while installed


def torch_release(version: str | None = None) -> str:
    """``"2.14.1+cu128"`` -> ``"2.14"``: the key of the patch module (build suffix ignored)."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise UnsupportedTorchError(f"cannot parse the torch version {text!r}")
    return f"{match.group(1)}.{match.group(2)}"


def release_module_name(release: str) -> str:
    """``"2.14"`` -> ``"v2_14"``: the private module holding that release's hashes and traits."""
    return "v" + release.replace(".", "_")


def _release_module(version: str | None = None) -> ModuleType:
    release = torch_release(version)
    if release not in SUPPORTED_RELEASES:
        supported = ", ".join(SUPPORTED_RELEASES)
        raise UnsupportedTorchError(
            f"fsdp_precision has no patch for torch {torch.__version__} (release {release}); "
            f"supported releases: {supported}. Install one of them (pip install 'torch==2.14.*'), "
            "or give each fp32 module its own fully_shard unit with param_dtype=None"
        )
    return importlib.import_module(f"{__name__}.{release_module_name(release)}")


def release_traits(version: str | None = None) -> ReleaseTraits:
    """What the installed (or the given) torch release's FSDP2 does differently, as data.

    Reads the release module only (no torch internal is imported, no source is checked); raises
    :class:`UnsupportedTorchError` for a release without one.
    """
    traits: ReleaseTraits = _release_module(version).TRAITS
    return traits


def apply_param_dtype_map_patch() -> None:
    """Enable ``ParamDtypeMixedPrecisionPolicy.param_dtype_map`` in ``fully_shard``.

    Idempotent. Call it before ``fully_shard``. Raises :class:`UnsupportedTorchError` on a torch
    release without a patch module and :class:`PatchIntegrityError` when any upstream function
    the patch replaces or relies on differs from the recorded source; in both cases nothing is
    patched. Units whose policy has no map keep the upstream code path exactly.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return
        release = _release_module()
        verify_sources(release.SOURCES, torch_version=torch.__version__)
        from . import _install  # imports torch internals: only after the hashes matched

        _install.install(release.TRAITS)
        _applied = release.TRAITS
        logger.info("fsdp_precision: patched FSDP2 of torch %s", torch.__version__)


def check_planned_call(
    modules: Sequence[nn.Module], params: Sequence[nn.Parameter], policy: MixedPrecisionPolicy
) -> None:
    """Raise what ``fully_shard(modules, mp_policy=policy)`` would refuse on the installed
    release for the ``params`` it would manage (a ``ParamDtypeMapError``), touching nothing.

    A plan calls this for every planned call before its first ``fully_shard``; it reads the
    release's traits without importing any torch internal.
    """
    from ._refusals import check_call

    check_call(release_traits(), modules, params, policy)


def remove_param_dtype_map_patch() -> None:
    """Restore torch's original functions. Idempotent.

    Modules already wrapped with a mapped policy must not run afterwards: their FSDP state was
    built for the patched functions.
    """
    global _applied
    with _lock:
        if _applied is None:
            return
        from . import _install

        _install.uninstall()
        _applied = None


def is_param_dtype_map_patch_applied() -> bool:
    """Whether :func:`apply_param_dtype_map_patch` is in effect."""
    if _applied is None:
        return False
    from . import _install

    return _install.is_installed()
