"""The project's exception types. Every message names the problem, the value seen and the fix."""

from __future__ import annotations

__all__ = [
    "FsdpPrecisionError",
    "ParamDtypeMapError",
    "PatchIntegrityError",
    "UnsupportedTorchError",
]


class FsdpPrecisionError(Exception):
    """Base class of every error raised by ``fsdp_precision``."""


class ParamDtypeMapError(FsdpPrecisionError, ValueError):
    """A ``param_dtype_map`` (or the layout it describes) cannot be honoured.

    Raised before any parameter is sharded: the model is left as it was.
    """


class UnsupportedTorchError(FsdpPrecisionError, RuntimeError):
    """The installed torch release has no patch module; nothing was patched."""


class PatchIntegrityError(FsdpPrecisionError, RuntimeError):
    """An upstream function the patch replaces or relies on differs from the recorded source.

    The patch refuses to install rather than run against code it was not written for.
    """
