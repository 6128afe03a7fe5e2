"""Elastic resume and many nodes, run as users run them: ``torchrun --max-restarts 1`` on
``examples/elastic_resume.py`` (``checkpoint.save_step`` every step, ``resume_from_latest`` at
start), and two torchrun agents with a c10d rendezvous on localhost standing for two nodes, HSDP
replicated across them. Each ends bitwise equal to an uninterrupted run: every parameter, the
optimizer state and the loss history."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_precision._base.dist import free_port

from tests.support import ROOT

SCRIPT = str(ROOT / "examples" / "elastic_resume.py")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def torchrun(*args: str, nproc: int = 2, agent: list[str] | None = None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = agent or ["--standalone", "--max-restarts", "1"]
    command = [sys.executable, "-m", "torch.distributed.run", *launcher,
               f"--nproc_per_node={nproc}", SCRIPT, *args]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert a["params"].keys() == b["params"].keys()
    for name, tensor in a["params"].items():
        assert tensor.dtype == b["params"][name].dtype and torch.equal(tensor, b["params"][name])
    states = a["optim"]["state"], b["optim"]["state"]
    assert states[0].keys() == states[1].keys() and states[0]
    for name, state in states[0].items():
        for key, value in state.items():
            other = states[1][name][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (name, key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    where = tmp_path_factory.mktemp("uninterrupted")
    stdout = torchrun("--root", str(where / "ckpt"), "--out", str(where / "out.pt"))
    assert "attempt 0: start at 0" in stdout and "attempt 1" not in stdout
    return torch.load(where / "out.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        ("--kill-at", "the last rank SIGKILLs itself after step 3's update, before its save"),
        ("--kill-in-save", "rank 0 dies in step 3's save: step 3 is incomplete, step 2 is used"),
    ],
)
def test_a_killed_rank_resumes_by_itself_bitwise(
    uninterrupted: dict[str, Any], tmp_path: Path, flag: str, why: str
) -> None:
    out = tmp_path / "out.pt"
    stdout = torchrun("--root", str(tmp_path / "ckpt"), "--out", str(out), flag, "3")
    # the first attempt died, torchrun restarted the group, the loop resumed after step 2
    assert "attempt 0: start at 0" in stdout and "attempt 1: start at 3" in stdout, stdout
    assert_bitwise(torch.load(out, weights_only=False), uninterrupted)
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["step-000000004", "step-000000005"], kept  # keep_last=2, leftovers removed


def test_negative_control_without_max_restarts_the_run_fails(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               SCRIPT, "--root", str(tmp_path / "ckpt"), "--kill-at", "3"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert out.returncode != 0 and "attempt 1" not in out.stdout


def two_nodes(root: Path, out: str, steps: int) -> str:
    """Two torchrun agents, one per "node", 2 processes each, c10d rendezvous on localhost;
    both agents' output (the rendezvous decides which holds rank 0)."""
    port, run_id = free_port(), f"job-{steps}-{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
                "--nproc_per_node=2",
                SCRIPT,
                "--root",
                str(root),
                "--hsdp",
                "2",
                "--steps",
                str(steps),
                "--out",
                out,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=240) for agent in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    return "".join(stdout for stdout, _ in outputs)


def test_two_nodes_hsdp_trains_and_resumes_bitwise_like_one(tmp_path: Path) -> None:
    one = tmp_path / "one.pt"
    stdout = torchrun("--root", str(tmp_path / "one"), "--hsdp", "2", "--out", str(one), nproc=4)
    assert "on mesh [[0, 1], [2, 3]]" in stdout  # replicate x shard: replicas across the nodes
    two = tmp_path / "two.pt"
    first = two_nodes(tmp_path / "two", str(two), steps=3)
    assert "attempt 0: start at 0" in first and "on mesh [[0, 1], [2, 3]]" in first
    resumed = two_nodes(tmp_path / "two", str(two), steps=6)  # a new job resumes the checkpoint
    assert "start at 3" in resumed
    assert_bitwise(torch.load(two, weights_only=False), torch.load(one, weights_only=False))
