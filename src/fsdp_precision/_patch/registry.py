"""The install registry: the upstream attributes swapped out, their originals, and the traits of
the installed release. The replacements (``construct``, ``mp_dtypes``, ``gather``, ``reduce``)
look up torch's originals and the release's traits here; ``replacements`` says what is swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.fsdp._fully_shard import _fsdp_common as _common

from fsdp_precision._releases.traits import ReleaseTraits

__all__ = [
    "Replacement",
    "compiled_autograd_enabled",
    "install",
    "is_applied",
    "is_installed",
    "original",
    "traits",
    "uninstall",
]

Replacement = tuple[Any, str, Any]  # (owner, attribute name, replacement)


class _Registry:
    """Swap attributes of torch modules or classes in and out, remembering the originals."""

    def __init__(self) -> None:
        self.originals: dict[tuple[Any, str], Any] = {}
        self.installed: list[Replacement] = []
        self.traits: ReleaseTraits | None = None

    def install(self, replacements: Sequence[Replacement], traits: ReleaseTraits) -> None:
        if self.originals:
            return
        for owner, name, _ in replacements:
            self.originals[(owner, name)] = owner.__dict__[name]
        self.installed = list(replacements)
        self.traits = traits
        for owner, name, replacement in replacements:
            # Whoever reads the installed function's source (the source check, doctor) reads
            # torch's: inspect.unwrap follows __wrapped__, as for functools.wraps.
            replacement.__wrapped__ = self.originals[(owner, name)]
            setattr(owner, name, replacement)

    def uninstall(self) -> None:
        for _, _, replacement in self.installed:
            replacement.__dict__.pop("__wrapped__", None)
        for (owner, name), function in list(self.originals.items()):
            setattr(owner, name, function)
        self.originals.clear()
        self.installed = []
        self.traits = None

    def is_installed(self) -> bool:
        return bool(self.originals) and all(
            owner.__dict__[name] is replacement for owner, name, replacement in self.installed
        )


_registry = _Registry()


def install(replacements: Sequence[Replacement], release: ReleaseTraits) -> None:
    """Swap every ``(owner, name, replacement)`` in for a release with these traits; idempotent."""
    _registry.install(replacements, release)


def uninstall() -> None:
    """Restore torch's originals; idempotent."""
    _registry.uninstall()


def is_installed() -> bool:
    """Whether :func:`install` has run, :func:`uninstall` has not, and every swap is in place."""
    return _registry.is_installed()


def is_applied() -> bool:
    """Whether :func:`install` has run and :func:`uninstall` has not (a replacement swapped back
    by hand, as the negative controls do, still counts)."""
    return bool(_registry.originals)


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
