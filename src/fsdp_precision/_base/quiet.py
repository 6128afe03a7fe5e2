"""The library's own imports of optional packages, without the log lines only their developers
need.

Building a transformers model or resolving a Diffusers model class imports torchao (and
bitsandbytes) when they are installed, and those imports log to every process: CUDA kernels that
do not load on this machine, torch's deprecation of torchao's ``Enum`` registrations, a quantizer
that cannot find a tensor class. Where the library itself makes that import (the CLI building a
``MODEL``, an offline export building a model on meta), :func:`quiet_imports` drops exactly those
records, on the loggers that emit them, for the duration of the import. The same import made by
the user's code, before or after, logs as it always does: nothing is set on the root logger, no
logger's level changes, no ``warnings`` filter is installed.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

__all__ = ["IMPORT_NOISE", "quiet_imports"]

#: Logger -> the records its package's import logs that :func:`quiet_imports` drops.
IMPORT_NOISE: dict[str, re.Pattern[str]] = {
    # torchao/__init__.py: its CUDA kernels (.so) on a machine that cannot load them
    "torchao": re.compile(r"Failed to load .*\.so\b|Skipping import of cpp extensions"),
    # torch/utils/_pytree.py: torchao registers Enum subclasses torch now handles natively
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
    # diffusers' torchao quantizer, when torchao's tensor classes moved
    "diffusers.quantizers.torchao.torchao_quantizer": re.compile(
        r"Unable to import `torchao` Tensor objects"
    ),
    # bitsandbytes' CPU backend, without the optional `kernels` package
    "bitsandbytes.backends.cpu.ops": re.compile(r"Failed to load CPU gemm_4bit_forward"),
}


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.search(record.getMessage()) is None


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, the records of :data:`IMPORT_NOISE` are dropped where they are logged;
    every other record of those loggers, and everything after the block, passes."""
    installed = [(logging.getLogger(name), _DropNoise(p)) for name, p in IMPORT_NOISE.items()]
    for logger, drop in installed:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in installed:
            logger.removeFilter(drop)
