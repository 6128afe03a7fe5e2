"""The project's exception types. Every message names the problem, the value seen and the fix."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "EngineDtypeError",
    "FsdpPrecisionError",
    "ParamDtypeMapError",
    "PatchIntegrityError",
    "PolicyNotAppliedError",
    "RankMismatchError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
    "UnsupportedTorchError",
]


class FsdpPrecisionError(Exception):
    """Base class of every error raised by ``fsdp_precision``."""


class ParamDtypeMapError(FsdpPrecisionError, ValueError):
    """A ``param_dtype_map`` (or the layout it describes) cannot be honoured.

    Raised before any parameter is sharded: the model is left as it was.
    """


class RankMismatchError(ParamDtypeMapError):
    """A ``fully_shard`` call resolved differently on some rank (or some rank refused it): raised
    on every rank of the call's mesh, with the same message, before anything is sharded."""


class UnsupportedTorchError(FsdpPrecisionError, RuntimeError):
    """The installed torch release has no patch module; nothing was patched."""


class PatchIntegrityError(FsdpPrecisionError, RuntimeError):
    """An upstream function the patch replaces or relies on differs from the recorded source.

    The patch refuses to install rather than run against code it was not written for.
    """


class CheckpointError(FsdpPrecisionError, ValueError):
    """A checkpoint call failed; the message names the path (where there is one) and the fix.

    Raised as such for bad input (an unknown ``state_dict_type``, a checkpoint or state dict of
    the other type, a missing optimizer state) before the model, the optimizer or any file is
    modified; the subclasses below say what else went wrong.
    """


class CheckpointNotFoundError(CheckpointError):
    """There is no complete ``fsdp_precision`` checkpoint at the path: the directory does not
    exist (and no interrupted save left a complete copy beside it), is a file, or has no
    metadata file (a save that never finished, or a directory this library did not write)."""


class CheckpointReadError(CheckpointError):
    """A checkpoint's files cannot be read or parsed: corrupt or foreign metadata, a missing or
    damaged DCP file. Wraps the underlying error (``__cause__``) where there is one."""


class UnsafeCheckpointError(CheckpointReadError):
    """A checkpoint holds something other than tensors and data: its DCP metadata or a stored
    value would have to run code (a global outside the allow-list) to be read, or it names a
    file outside its directory. Nothing of it was executed, and nothing was loaded."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save or export could not write its files: an unwritable or missing parent, a full disk,
    a target that exists and is not a checkpoint. Also an ``OSError`` (what saves raised before).

    The previous checkpoint at the target, if any, is left in place.
    """


class StateDictMismatchError(CheckpointError):
    """A state dict (or checkpoint) does not match the model: missing keys, unexpected keys or
    shape mismatches, all listed in the message and kept as attributes.

    Raised before anything is loaded: the model is left exactly as it was.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        shape_mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        super().__init__(message)
        #: Keys the model has and the state dict lacks.
        self.missing = missing or []
        #: Keys the state dict has and the model lacks.
        self.unexpected = unexpected or []
        #: ``(key, incoming shape, model shape)`` for every key whose shapes differ.
        self.shape_mismatches = shape_mismatches or []

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable with its lists: ranks exchange errors so that every rank raises the same one.
        return (type(self), (str(self),), self.__dict__)


class PolicyNotAppliedError(FsdpPrecisionError, RuntimeError):
    """A policy would apply nowhere: a model that a ``model_policy`` was built for ran a training
    forward that no ``fully_shard`` call had prepared (a framework skipped FSDP: one process
    without a launcher), raised before the step computes anything; or
    a unit built with a ``param_dtype_map`` ran after ``remove_param_dtype_map_patch``."""


class UnitUsageError(FsdpPrecisionError, RuntimeError):
    """A parameter was used while its FSDP unit was not gathered (a module run, or a parameter
    read, outside its unit's forward); raised by ``fsdp_precision.testing.unit_guard``."""


class EngineDtypeError(FsdpPrecisionError, RuntimeError):
    """An inference engine would hold, or holds, a tensor training kept in another dtype (a
    router gate kept in fp32, rounded to bf16 by the engine), or computes a kept module
    otherwise: raised by name, before the engine serves, instead of degrading silently."""


class RoutingReplayError(FsdpPrecisionError, ValueError):
    """Routing replay cannot do what was asked: a model whose routers the library cannot replay
    (named, with why), routes that do not fit the model (layers, top-k, expert ids) or the batch
    (tokens per sequence), or a router that ran with replay attached and no routes set. Raised
    before the forward computes with them; nothing falls back to live routing silently."""
