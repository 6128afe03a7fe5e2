"""The peers' collectives, asserted: ``benchmarks/bench_peers.py`` measures what users would pick
instead of the library, and the counts it publishes (``docs/compared.md``) are checked here, so a
regression in the library or in a peer shows. Two gloo ranks, the benchmark's Qwen3-MoE at its
smoke size (2 decoder layers, their routers kept): one unit per layer and the root.

Peers that run from venvs of their own (NeMo Automodel, torch 2.15's native override) are
asserted where their package is installed; elsewhere they skip, saying so.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peers  # noqa: E402
from fsdp_precision.testing import launch  # noqa: E402

pytestmark = pytest.mark.distributed

# peer -> (units, all-gathers, reduce-scatters per step, dtype the routers are gathered in)
COUNTS = {
    "torch_uniform": (3, 5, 3, ["bfloat16"]),
    "fsdp_precision": (3, 5, 3, ["float32"]),
    "separate_units": (5, 9, 5, ["float32"]),  # each router its own unit
    "torchtitan_autocast": (3, 5, 3, ["bfloat16"]),
}


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    pytest.importorskip("transformers")
    args = (list(bench_peers.LOCAL), "moe", 0, True)
    return launch(bench_peers._measure, args, nproc=2, start_method="spawn")  # type: ignore[no-any-return]


@pytest.mark.parametrize("peer", list(COUNTS))
def test_each_peer_issues_its_collectives(local: dict[str, Any], peer: str) -> None:
    run = local[peer]
    units, gathers, scatters, gathered = COUNTS[peer]
    assert (run["units"], run["all_gathers"], run["reduce_scatters"]) == (units, gathers, scatters)
    assert run["gathered"] == gathered


def test_the_library_trains_bitwise_like_separate_units_with_fewer_collectives(
    local: dict[str, Any],
) -> None:
    ours, separate = local["fsdp_precision"], local["separate_units"]
    assert ours["digest"] == separate["digest"]  # the same loss and gradients, bit for bit
    assert ours["all_gathers"] < separate["all_gathers"]
    assert ours["reduce_scatters"] < separate["reduce_scatters"]
    # Negative control: the uniform policy rounds the routers, so it is not bitwise either.
    assert local["torch_uniform"]["digest"] != ours["digest"]
