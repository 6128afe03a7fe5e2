"""Which upstream functions a release swaps for which replacement, and the swap itself."""

from __future__ import annotations

from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from fsdp_precision._patch import construct, gather, mp_dtypes, partial, reduce, registry
from fsdp_precision._patch.registry import Replacement
from fsdp_precision._releases.traits import ReleaseTraits

__all__ = ["install", "is_installed", "table", "uninstall"]


def table(release: ReleaseTraits) -> list[Replacement]:
    """What a release with these traits swaps in: the construction wrap, and where the release
    ``patches_precision``, FSDP2's precision machinery (``foreach_reduce`` only where torch's
    cannot reduce mixed gradient dtypes, i.e. without ``mixed_dtype_reduce``); and where torch
    reduces a ``Partial`` gradient over non-FSDP mesh dims in its compute dtype (without
    ``reduces_partial_grads``), ``_get_grad_inner_tensor``."""
    rows: list[Replacement] = [(_fs, "_init_param_group", construct.init_param_group)]
    if release.patches_precision:
        rows += [
            (_group.FSDPParamGroup, "_init_mp_dtypes", mp_dtypes.init_mp_dtypes),
            (_coll, "_get_param_all_gather_inputs", gather.get_param_all_gather_inputs),
        ]
        if not release.mixed_dtype_reduce:  # 2.15 reduces mixed gradient dtypes itself
            rows.append((_group, "foreach_reduce", reduce.foreach_reduce))  # post_backward's
        else:  # ... but refuses 0-size gradients, which mapped calls leave out around it
            rows.append((_group, "foreach_reduce", reduce.foreach_reduce_without_empty))
    if not release.reduces_partial_grads:  # every unit's gradients reduced outside FSDP's dims
        rows.append((FSDPParam, "_get_grad_inner_tensor", partial.get_grad_inner_tensor))
    return rows


def install(release: ReleaseTraits) -> None:
    """Swap in the replacements of a release with these traits; idempotent."""
    registry.install(table(release), release)


def uninstall() -> None:
    """Restore torch's functions; idempotent."""
    registry.uninstall()


def is_installed() -> bool:
    """Whether :func:`install` has run and :func:`uninstall` has not."""
    return registry.is_installed()
