"""The guarded patch of FSDP2 internals: install and removal, after the source check.

The only package that imports ``torch.distributed.fsdp._fully_shard`` (ruff's banned-api rule
fences it). One implementation of each replaced function, by idea: ``construct`` (the
``fully_shard`` construction wrap: resolve the map, take torch 2.15's native override where it can
express it), ``mp_dtypes``, ``gather``, ``reduce`` (the precision machinery), ``tags`` (what they
record on torch's ``FSDPParam``), each reading the installed release's traits
(:mod:`fsdp_precision._releases`); ``replacements`` (which upstream function is swapped for which)
and ``registry`` (the swap itself, and the originals).

Importing this package touches no torch internals: a module that does is imported only when the
patch is applied, and only after every source hash of the installed release matched.
"""

from __future__ import annotations

import logging
import threading

import torch

from fsdp_precision._base.sources import verify_sources
from fsdp_precision._policy.agree import set_checking
from fsdp_precision._policy.armed import register_installer
from fsdp_precision._releases import ReleaseTraits, release_module

__all__ = [
    "apply_param_dtype_map_patch",
    "is_param_dtype_map_patch_applied",
    "remove_param_dtype_map_patch",
]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_applied: ReleaseTraits | None = None  # the installed release's traits, while installed


def apply_param_dtype_map_patch(*, check_ranks: bool | None = None) -> None:
    """Enable ``ParamDtypeMixedPrecisionPolicy.param_dtype_map`` in ``fully_shard``.

    Idempotent. Building a policy with a map (or boundary casts, or uncast inputs) calls it
    too; call it yourself to fail early or to set ``check_ranks``. Raises
    :class:`UnsupportedTorchError` on a torch release without a release module and
    :class:`PatchIntegrityError` when any upstream function the patch replaces or relies on
    differs from the recorded source; in both cases nothing is patched. Units whose policy has
    no map keep the upstream code path exactly.

    ``check_ranks``: while the patch is installed, every ``fully_shard`` call compares what it
    resolved across the ranks of its mesh (one all-gather of 16 bytes per call, at construction)
    and raises :class:`RankMismatchError` on every rank where they differ, instead of a gloo
    abort or an NCCL hang at the first all-gather. ``False`` turns it off (on every rank alike),
    ``True`` back on; ``None`` (default) keeps the current setting, on at first.
    """
    global _applied
    if check_ranks is not None:
        if not isinstance(check_ranks, bool):
            raise ValueError(f"check_ranks must be True, False or None, got {check_ranks!r}")
        set_checking(check_ranks)
    with _lock:
        if _applied is not None:
            return
        release = release_module()
        verify_sources(release.SOURCES, torch_version=torch.__version__)
        # lazy: imports torch internals, only after the hashes matched
        from fsdp_precision._patch import replacements

        replacements.install(release.TRAITS)
        _applied = release.TRAITS
        logger.info("fsdp_precision: patched FSDP2 of torch %s", torch.__version__)


def remove_param_dtype_map_patch() -> None:
    """Restore torch's original functions. Idempotent.

    A unit ``fully_shard`` built under the patch with a map then stops its next forward with
    :class:`PolicyNotAppliedError` (its gathers and reductions are the patch's) until the patch
    is applied again. Removing the patch is asking for torch alone: a policy with a map built
    before and passed to ``fully_shard`` after is torch's plain policy (a policy built after
    installs the patch again).
    """
    global _applied
    with _lock:
        if _applied is None:
            return
        from fsdp_precision._patch import replacements  # lazy: imports torch internals

        replacements.uninstall()
        _applied = None


register_installer(apply_param_dtype_map_patch)


def is_param_dtype_map_patch_applied() -> bool:
    """Whether :func:`apply_param_dtype_map_patch` is in effect."""
    if _applied is None:
        return False
    from fsdp_precision._patch import replacements  # lazy: imports torch internals

    return replacements.is_installed()
