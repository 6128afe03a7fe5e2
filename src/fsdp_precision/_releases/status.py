"""Whether the patch can run on the installed torch, and if not, exactly why: without raising,
for ``fsdp-precision doctor`` and for the plans that fall back to the public-API layout.

Importing this module touches no torch internals; :func:`patch_status` hashes the upstream
functions of a release that has a release module (importing their modules, as
``apply_param_dtype_map_patch`` does), and nothing on any other release.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_precision._base.errors import UnsupportedTorchError
from fsdp_precision._base.sources import check_sources, source_differences
from fsdp_precision._releases import SUPPORTED_RELEASES, release_module, torch_release

__all__ = ["PatchStatus", "patch_status"]


@dataclass(frozen=True)
class PatchStatus:
    """What the patch can do on this torch.

    Attributes:
        torch_version: ``torch.__version__``.
        release: Its ``major.minor``.
        supported: A release module exists for it (its hashes and traits).
        functions: Each upstream function the patch replaces or relies on, with ``None`` where
            its source matches the recorded one, else why not (empty on an unsupported release).
    """

    torch_version: str
    release: str
    supported: bool
    functions: tuple[tuple[str, str | None], ...]

    @property
    def differing(self) -> tuple[str, ...]:
        """The functions whose sources differ, each as ``"target (why)"``."""
        return tuple(source_differences(dict(self.functions)))

    @property
    def usable(self) -> bool:
        """Whether ``apply_param_dtype_map_patch()`` would succeed."""
        return self.supported and not self.differing

    def reason(self) -> str:
        """One line: why the patch cannot run ("" when it can)."""
        if not self.supported:
            return (
                f"torch {self.torch_version} (release {self.release}) is not a supported release "
                f"({', '.join(SUPPORTED_RELEASES)})"
            )
        if self.differing:
            return (
                f"torch {self.torch_version}: {len(self.differing)} of the {len(self.functions)} "
                f"upstream functions the patch relies on differ: {'; '.join(self.differing)}"
            )
        return ""


def patch_status() -> PatchStatus:
    """The status on the installed torch (its upstream functions hashed now)."""
    version = torch.__version__
    release = torch_release(version)
    try:
        module = release_module(version)
    except UnsupportedTorchError:
        return PatchStatus(version, release, False, ())
    return PatchStatus(version, release, True, tuple(check_sources(module.SOURCES).items()))
