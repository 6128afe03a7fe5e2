"""The guarded patch of FSDP2 internals: version dispatch, source checks, install and removal.

Nothing outside this package imports ``torch.distributed.fsdp._fully_shard``. Importing this
package touches no torch internals: a release module is imported only when the patch is applied,
and only after the installed torch release was found in ``SUPPORTED_RELEASES``.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from types import ModuleType

import torch

from fsdp_precision._errors import UnsupportedTorchError

from ._sources import verify_sources

__all__ = [
    "SUPPORTED_RELEASES",
    "apply_param_dtype_map_patch",
    "is_param_dtype_map_patch_applied",
    "remove_param_dtype_map_patch",
    "torch_release",
]

logger = logging.getLogger(__name__)

#: torch release (major.minor) -> private module holding its source hashes and installer.
SUPPORTED_RELEASES: dict[str, str] = {
    # 2.11: one FSDPParamGroup per call, no non-floating clamp, compiled-autograd branches
    "2.11": "v2_11",
    # 2.12: per-parameter meshes (a list of groups); foreach_reduce still returns six values
    "2.12": "v2_12",
    "2.13": "v2_13",  # 2.13: foreach_reduce returns post_reduce_stream (seven values)
    "2.14": "v2_14",  # 2.14: _init_mp_dtypes takes floating params of frozen units; same plan
    # 2.15: native MixedPrecisionPolicy.param_dtype_override_fn; only construction is wrapped
    "2.15": "v2_15",
}

_lock = threading.Lock()
_applied: ModuleType | None = None  # the implementation module, while installed


def torch_release(version: str | None = None) -> str:
    """``"2.14.1+cu128"`` -> ``"2.14"``: the key of the patch module (build suffix ignored)."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise UnsupportedTorchError(f"cannot parse the torch version {text!r}")
    return f"{match.group(1)}.{match.group(2)}"


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def _release_module(version: str | None = None) -> ModuleType:
    release = torch_release(version)
    name = SUPPORTED_RELEASES.get(release)
    if name is None:
        supported = ", ".join(sorted(SUPPORTED_RELEASES, key=_release_key))
        raise UnsupportedTorchError(
            f"fsdp_precision has no patch for torch {torch.__version__} (release {release}); "
            f"supported releases: {supported}. Install one of them (pip install 'torch==2.14.*'), "
            "or give each fp32 module its own fully_shard unit with param_dtype=None"
        )
    return importlib.import_module(f"{__name__}.{name}")


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
        implementation = importlib.import_module(f"{__name__}.{release.IMPLEMENTATION}")
        implementation.install()
        _applied = implementation
        logger.info("fsdp_precision: patched FSDP2 of torch %s", torch.__version__)


def remove_param_dtype_map_patch() -> None:
    """Restore torch's original functions. Idempotent.

    Modules already wrapped with a mapped policy must not run afterwards: their FSDP state was
    built for the patched functions.
    """
    global _applied
    with _lock:
        if _applied is None:
            return
        _applied.uninstall()
        _applied = None


def is_param_dtype_map_patch_applied() -> bool:
    """Whether :func:`apply_param_dtype_map_patch` is in effect."""
    return _applied is not None and bool(_applied.is_installed())
