"""Shared fixtures and the test tiers.

Tiers, each runnable alone (the README's ``./dev test`` runs them all):

- ``fast``: in the test process, no spawned ranks and no integration package;
- ``distributed``: spawns gloo process groups (``tests.support.harness``);
- ``integration``: the real framework packages (``tests/integrations/``);
- ``slow``: opt-in (``pytest -m slow``), released model sizes and the repeats of a grid (the
  default tier keeps one case per behaviour); skipped otherwise.

Across them, ``conformance`` (``tests/conformance/``): the library's ports of PyTorch's own FSDP2
tests and of the seed's edge cases, on spawned gloo ranks and on threads of one process (torch's
threaded process group), with the patch applied and on torch alone.

Every test gets the markers of its tier here: ``pytest -m fast``, ``-m distributed``,
``-m integration``, ``-m conformance``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import fsdp_precision as fp
from fsdp_precision._base.dist import free_port

_INTEGRATIONS = Path(__file__).parent / "integrations"
_CONFORMANCE = Path(__file__).parent / "conformance"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    opted_in = "slow" in (config.getoption("-m") or "")
    for item in items:
        if "slow" in item.keywords and not opted_in:
            item.add_marker(
                pytest.mark.skip(
                    reason="opt-in: released sizes, a grid's repeats; run with -m slow"
                )
            )
        if _CONFORMANCE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.conformance)
        if _INTEGRATIONS in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
        elif "distributed" not in item.keywords and "integration" not in item.keywords:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def world1() -> Iterator[None]:
    """A one-rank gloo process group in the test process itself (no spawn), patch applied."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    fp.apply_param_dtype_map_patch()
    yield
    dist.destroy_process_group()
