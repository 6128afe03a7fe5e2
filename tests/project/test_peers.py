"""The peers' collectives, asserted: ``benchmarks/bench_peers.py`` measures what users would pick
instead of the library, and the counts it publishes (``docs/compared.md``) are checked here, so a
regression in the library or in a peer shows. Two gloo ranks, the benchmark's Qwen3-MoE at its
smoke size (2 decoder layers, their routers kept): one unit per layer and the root.

Peers that run from venvs of their own (NeMo Automodel, torch 2.15's native override) are
asserted where their package is installed; elsewhere they skip, saying so. Their venvs (the
recipes: ``benchmarks/peers/nemo_automodel.py``, ``benchmarks/peers/torch_native.py``) run this
file as::

    /work/venvs/nemo/bin/python -m pytest tests/project/test_peers.py
    /work/venvs/torch-2.15.0/bin/python -m pytest tests/project/test_peers.py
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peers  # noqa: E402
from fsdp_precision.testing import launch, process_group  # noqa: E402

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


# The peers from venvs of their own, each beside torch_uniform in one process group, as
# bench_peers runs them there: (units, all-gathers, reduce-scatters per step, routers gathered in)
ELSEWHERE = {
    "nemo_automodel": (5, 9, 5, ["float32"]),  # each router its own fp32 unit, as separate_units
    "torch_native": (3, 5, 3, ["float32"]),  # in the layers' units, packed as bytes
}

#: The venvs of the module docstring.
VENVS = {
    "nemo_automodel": "/work/venvs/nemo/bin/python",
    "torch_native": "/work/venvs/torch-2.15.0/bin/python",
}


def _first_forward(name: str, family: str) -> str:
    """The peer as shipped (without the hooks its wrap adds): what its first forward raises."""
    from peers import harness

    model = harness.build(family, smoke=True)
    bench_peers.peer(name).wrap(model, harness.KEPT[family], as_shipped=True)
    try:
        model(input_ids=harness.batch(0))
    except RuntimeError as e:
        return str(e)
    return "ran"


def _elsewhere(name: str) -> tuple[dict[str, Any], dict[str, str]]:
    from peers import harness

    torch.set_num_threads(1)
    with process_group():
        peers = [bench_peers.peer("torch_uniform"), bench_peers.peer(name)]
        runs = harness.measure(peers, "moe", 0, smoke=True)
        shipped = {family: _first_forward(name, family) for family in ("moe", "dense")}
    return runs, shipped


@pytest.fixture(scope="module", params=list(ELSEWHERE))
def elsewhere(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], dict[str, str]]:
    name = request.param
    pytest.importorskip("transformers")
    why = bench_peers.peer(name).available()
    if why is not None:
        pytest.skip(f"{why}; in its venv: {VENVS[name]} -m pytest tests/project/test_peers.py")
    runs, shipped = launch(_elsewhere, (name,), nproc=2, start_method="spawn")
    return name, runs, shipped


def test_each_peer_from_its_own_venv_issues_its_collectives(
    elsewhere: tuple[str, dict[str, Any], dict[str, str]],
) -> None:
    name, runs, _ = elsewhere
    units, gathers, scatters, gathered = ELSEWHERE[name]
    run = runs[name]
    assert (run["units"], run["all_gathers"], run["reduce_scatters"]) == (units, gathers, scatters)
    assert run["gathered"] == gathered
    assert {c["weight"] for c in run["computed"].values()} == {"float32"}
    # beside it, in the same processes, the uniform policy as in this environment
    baseline = runs["torch_uniform"]
    assert (baseline["units"], baseline["all_gathers"], baseline["reduce_scatters"]) == (3, 5, 3)


def test_each_peer_from_its_own_venv_fails_as_shipped_as_it_reports(
    elsewhere: tuple[str, dict[str, Any], dict[str, str]],
) -> None:
    """What the table's 'as shipped' column says: the first forward without the hooks fails in
    both families (the router's bf16 input; the norm's fp32 output), and the wrap says so."""
    name, runs, shipped = elsewhere
    expected = bench_peers.peer(name).AS_SHIPPED
    assert expected in shipped["moe"] and "BFloat16 != float" in shipped["moe"], shipped
    assert expected in shipped["dense"] and "float != c10::BFloat16" in shipped["dense"], shipped
    assert f"as shipped the first forward fails with '{expected}'" in runs[name]["needed"]


def test_each_peer_from_its_own_venv_trains_bitwise_like_the_library(
    elsewhere: tuple[str, dict[str, Any], dict[str, str]], local: dict[str, Any]
) -> None:
    """With the hooks, the same loss and gradients as the library in this venv (its torch), and
    not as the uniform policy (negative control)."""
    name, runs, _ = elsewhere
    assert runs[name]["digest"] == local["fsdp_precision"]["digest"]
    assert runs["torch_uniform"]["digest"] == local["torch_uniform"]["digest"]
    assert runs[name]["digest"] != runs["torch_uniform"]["digest"]
