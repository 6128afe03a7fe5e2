"""``quiet_imports``: the import noise of optional packages is dropped inside the library's own
imports only; the same records outside, and other records inside, pass (issue 48)."""

from __future__ import annotations

import logging
import warnings

import pytest

from fsdp_precision._base.quiet import IMPORT_NOISE, quiet_imports

ENUM = (
    "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
    "torch.compile as an opaque value type."
)


def test_the_noise_is_dropped_inside_and_logged_outside(caplog: pytest.LogCaptureFixture) -> None:
    pytree = logging.getLogger("torch.utils._pytree")
    torchao = logging.getLogger("torchao")
    before = {name: list(logging.getLogger(name).filters) for name in IMPORT_NOISE}
    with caplog.at_level(logging.WARNING):
        with quiet_imports():
            pytree.warning("%s is an Enum subclass and is now natively supported by ...", "E")
            torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
            torchao.warning("a torchao warning of another kind")  # not import noise: passes
        pytree.warning(ENUM)  # the user's own import, after: passes
    assert [r.getMessage() for r in caplog.records] == ["a torchao warning of another kind", ENUM]
    assert {name: list(logging.getLogger(name).filters) for name in IMPORT_NOISE} == before


def test_nothing_global_is_set() -> None:
    """No root logger, no level, no warnings filter: only the listed loggers' filters, and
    those only inside the block."""
    root = logging.getLogger()
    state = (list(root.filters), list(root.handlers), list(warnings.filters))
    levels = {name: logging.getLogger(name).level for name in IMPORT_NOISE}
    with quiet_imports():
        assert (list(root.filters), list(root.handlers), list(warnings.filters)) == state
        assert {name: logging.getLogger(name).level for name in IMPORT_NOISE} == levels
