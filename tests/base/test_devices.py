"""The device a rank computes and communicates on, read from its process group (issue 53), in
the test process's one-rank gloo group, CUDA simulated where a case needs it (nothing here
touches a GPU): every ``init_process_group`` form, the ``LOCAL_RANK`` rule, a caller's own
choice kept, gloo groups on the CPU, meshes and bare backends."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_precision._base import devices
from fsdp_precision._base.devices import (
    backends_by_device,
    group_device,
    mesh_device,
    parse_backend_config,
    rank_device,
)

pytestmark = pytest.mark.usefixtures("world1")

CONFIGS = [  # what dist.get_backend_config(group) returns after each init_process_group form
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),  # init_process_group() on GPUs
    ("cpu:gloo", {"cpu": "gloo"}),  # init_process_group() on a CPU build
    ("cuda:nccl", {"cuda": "nccl"}),  # "nccl"
    ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),  # "gloo"
    ("nccl", {"cuda": "nccl"}),
    ("gloo", {"cpu": "gloo"}),
]


@pytest.mark.parametrize(("config", "expected"), CONFIGS)
def test_backend_config_forms(config: str, expected: dict[str, str]) -> None:
    assert parse_backend_config(config) == expected


def test_the_real_gloo_group_stays_on_the_cpu() -> None:
    assert backends_by_device() == {"cpu": "gloo", "cuda": "gloo"}
    assert rank_device() == torch.device("cpu")
    assert group_device(dist.group.WORLD) == torch.device("cpu")


@dataclass(frozen=True)
class Gpus:
    """A simulated node: the group's backend config, CUDA, the launcher's LOCAL_RANK."""

    config: str
    local_rank: str | None = "3"
    current: int = 0  # the current CUDA device before the call
    count: int = 8
    available: bool = True
    bound: int | None = None  # init_process_group(device_id=cuda:N)


GRID = [  # (node, the device chosen, the device made current or None)
    (Gpus("cpu:gloo,cuda:nccl"), "cuda:3", 3),  # a plain init_process_group(): LOCAL_RANK
    (Gpus("cuda:nccl"), "cuda:3", 3),
    (Gpus("cpu:gloo,cuda:nccl", current=5), "cuda:5", None),  # the caller chose: kept
    (Gpus("cpu:gloo,cuda:nccl", bound=2), "cuda:2", 2),  # the group's bound device
    (Gpus("cpu:gloo,cuda:nccl", count=1), "cuda:0", None),  # one visible device per process
    (Gpus("cpu:gloo,cuda:nccl", local_rank=None), "cuda:0", None),  # no launcher
    (Gpus("cpu:gloo,cuda:gloo"), "cpu", None),  # gloo on a GPU machine stays on the CPU
    (Gpus("cpu:gloo"), "cpu", None),
    (Gpus("cpu:gloo,cuda:nccl", available=False), "cpu", None),
]


@pytest.fixture
def simulate(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(node: Gpus) -> list[int]:
        made_current: list[int] = []
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: node.config)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: node.available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: node.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: node.current)
        monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
        if node.local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", node.local_rank)
        bound = None if node.bound is None else torch.device("cuda", node.bound)
        monkeypatch.setattr(dist.group.WORLD, "bound_device_id", bound)
        return made_current

    return install


@pytest.mark.parametrize(("node", "device", "current"), GRID)
def test_rank_device(simulate: Any, node: Gpus, device: str, current: int | None) -> None:
    made_current = simulate(node)
    assert rank_device() == torch.device(device)
    assert made_current == ([] if current is None else [current])


def test_a_cuda_mesh_and_an_nccl_backend_use_the_local_rank(simulate: Any) -> None:
    made_current = simulate(Gpus("cpu:gloo,cuda:nccl"))

    class CudaMesh:
        device_type = "cuda"

        def get_group(self, dim: int) -> Any:
            return dist.group.WORLD

    assert mesh_device(CudaMesh()) == torch.device("cuda", 3)
    assert made_current == [3]
    assert group_device(object()) == torch.device("cpu")  # a bare gloo-like backend


def test_a_bare_nccl_backend_sends_from_this_ranks_gpu(
    simulate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``send_weights`` / ``receive_weights`` on a standalone NCCL group (``weight_group``)
    default to this rank's GPU: they defaulted to CPU tensors, which NCCL refuses."""
    made_current = simulate(Gpus("cpu:gloo,cuda:nccl"))

    class ProcessGroupNCCL:  # stands in for the class CPU builds do not have
        pass

    monkeypatch.setattr(dist, "ProcessGroupNCCL", ProcessGroupNCCL, raising=False)
    assert group_device(ProcessGroupNCCL()) == torch.device("cuda", 3)
    assert made_current == [3]


def test_no_module_compares_the_backend_with_one_string() -> None:
    """``dist.get_backend() == "nccl"`` is False after ``init_process_group()`` ("undefined")
    and after ``"cpu:gloo,cuda:nccl"``: the wrap built a CPU mesh on an NCCL group."""
    src = Path(devices.__file__).parents[1]
    found = [
        f"{path.relative_to(src)}:{n}"
        for path in sorted(src.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"get_backend\([^)]*\)\s*(==|!=|in\b)", line)
    ]
    assert not found, found
