"""The one install registry: which upstream functions are swapped for which, and back.

Imported only by :func:`fsdp_precision.apply_param_dtype_map_patch` after the release's source
hashes were verified. The replacements (``_construct``, ``_mp_dtypes``, ``_gather``,
``_reduce``) look up torch's originals and the installed release's traits here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.fsdp._fully_shard import _fsdp_collectives as _coll
from torch.distributed.fsdp._fully_shard import _fsdp_common as _common
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _group
from torch.distributed.fsdp._fully_shard import _fully_shard as _fs

from ._traits import ReleaseTraits

__all__ = [
    "Replacements",
    "compiled_autograd_enabled",
    "install",
    "is_installed",
    "original",
    "traits",
    "uninstall",
]

Replacement = tuple[Any, str, Any]  # (owner, attribute name, replacement)


class Replacements:
    """Swap attributes of torch modules or classes in and out, remembering the originals."""

    def __init__(self) -> None:
        self.originals: dict[tuple[Any, str], Any] = {}
        self.installed: list[Replacement] = []
        self.traits: ReleaseTraits | None = None

    def install(self, replacements: Sequence[Replacement], traits: ReleaseTraits) -> None:
        """Swap every ``(owner, name, replacement)`` in; idempotent."""
        if self.originals:
            return
        for owner, name, _ in replacements:
            self.originals[(owner, name)] = owner.__dict__[name]
        self.installed = list(replacements)
        self.traits = traits
        for owner, name, replacement in replacements:
            setattr(owner, name, replacement)

    def uninstall(self) -> None:
        """Restore the originals; idempotent."""
        for (owner, name), function in list(self.originals.items()):
            setattr(owner, name, function)
        self.originals.clear()
        self.installed = []
        self.traits = None

    def is_installed(self) -> bool:
        """Whether every replacement is in place."""
        return bool(self.originals) and all(
            owner.__dict__[name] is replacement for owner, name, replacement in self.installed
        )


_registry = Replacements()


def replacements(release: ReleaseTraits) -> list[Replacement]:
    """What a release with these traits swaps in: the construction wrap, and where the release
    ``patches_precision``, FSDP2's precision machinery (``foreach_reduce`` only where torch's
    cannot reduce mixed gradient dtypes, i.e. without ``mixed_dtype_reduce``)."""
    from . import _construct, _gather, _mp_dtypes, _reduce

    rows: list[Replacement] = [(_fs, "_init_param_group", _construct.init_param_group)]
    if release.patches_precision:
        rows += [
            (_group.FSDPParamGroup, "_init_mp_dtypes", _mp_dtypes.init_mp_dtypes),
            (_coll, "_get_param_all_gather_inputs", _gather.get_param_all_gather_inputs),
        ]
        if not release.mixed_dtype_reduce:  # 2.15 reduces mixed gradient dtypes itself
            rows.append((_group, "foreach_reduce", _reduce.foreach_reduce))  # post_backward's
    return rows


def install(release: ReleaseTraits) -> None:
    """Swap in the replacements of a release with these traits; idempotent."""
    _registry.install(replacements(release), release)


def uninstall() -> None:
    """Restore torch's functions; idempotent."""
    _registry.uninstall()


def is_installed() -> bool:
    """Whether :func:`install` has run and :func:`uninstall` has not."""
    return _registry.is_installed()


def original(owner: Any, name: str) -> Any:
    """The attribute ``owner.name`` held before :func:`install`."""
    return _registry.originals[(owner, name)]


def traits() -> ReleaseTraits:
    """The traits of the installed release (only called by installed replacements)."""
    assert _registry.traits is not None, "called while the patch is not installed"
    return _registry.traits


def compiled_autograd_enabled() -> bool:
    """2.11's ``compiled_autograd_enabled()`` where the release has those branches, else False."""
    if not traits().compiled_autograd_branches:
        return False
    enabled: Callable[[], bool] = getattr(_common, "compiled_autograd_enabled")  # noqa: B009  # 2.11 only
    return enabled()
