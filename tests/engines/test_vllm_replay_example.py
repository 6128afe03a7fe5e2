"""``examples/rl_replay_vllm.py`` as a user runs it, in vLLM's real runtime (its CPU build, in
``.venv-vllm``; elsewhere it skips): two RL steps under ``torchrun``, then a fresh launch that
resumes. Every step the trainer's routers pick the experts vLLM routed each token to (routing
replay, observed by a forward hook on each gate), and its logprobs of the sampled tokens match
the engine's to bf16 noise: the weights vLLM sampled with are the ones the trainer scored with,
so every sync through vLLM's RL API landed (a resumed launch whose engine kept the base weights
measured a mean |Δlogprob| of 2e-2 against about 7e-4 here).

The example's launches are this module's: its row in ``tests/project/test_examples.py`` is
asserted here (``RUN_IN``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.vllm_runtime import import_vllm  # noqa: E402

import_vllm()

from fsdp_precision._base.dist import free_port  # noqa: E402
from fsdp_precision.checkpoint import EXPORT_RECORD  # noqa: E402

from tests.support import ROOT  # noqa: E402

pytestmark = pytest.mark.integration
GATES = {f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)}
STEP = re.compile(
    r"step (\d+): trainer routed as the engine on (\d+)/(\d+) tokens x layers "
    r"\(live routing: (\d+)/\d+\); mean \|Δlogprob\| (\S+), k3 KL (\S+) over (\d+) sampled "
    r"tokens .*; synced (\d+) tensors to vLLM, 2 kept in fp32"
)


def launch(output: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "examples" / "rl_replay_vllm.py"), "--output", str(output),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def steps(stdout: str) -> dict[int, tuple[int, int, int, float, float, int]]:
    """Each printed step: agreed, pairs, live-agreed, mean |Δlogprob|, k3 KL, tensors synced."""
    return {
        int(m[1]): (int(m[2]), int(m[3]), int(m[4]), float(m[5]), float(m[6]), int(m[8]))
        for m in STEP.finditer(stdout)
    }


def test_the_rl_replay_example_routes_as_vllm_and_resumes(tmp_path: Path) -> None:
    first = launch(tmp_path)
    assert "first launch" in first
    assert "step 2: trainer routed as the engine on" in first  # the row in test_examples.py
    declared = json.loads((tmp_path / "kept.json").read_text())["kept"]
    assert {n: e["dtype"] for n, e in declared.items()} == dict.fromkeys(GATES, "float32")
    second = launch(tmp_path)
    assert "resumed from step 2" in second
    printed = {**steps(first), **steps(second)}
    assert sorted(printed) == [1, 2, 3, 4], first[-2000:] + second[-2000:]
    for step, (agreed, pairs, live, delta, k3, synced) in printed.items():
        assert pairs > 0 and agreed == pairs, step  # replay: the engine's experts, every token
        assert 0 <= live <= pairs
        assert delta < 5e-3 and 0 <= k3 < 1e-4, (step, delta, k3)  # the engine's weights
        assert synced > 0
    assert (tmp_path / "export" / EXPORT_RECORD).exists()
