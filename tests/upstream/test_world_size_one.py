"""NeMo Automodel #3589 (FSDP skipped at world size 1, the mixed-precision policy never applied)
and #3327 (its crash, "expected m1 and m2 to have the same dtype"), through the real packages.

One process without a launcher (the usual first debug run): accelerate runs as
``DistributedType.NO`` and applies no ``fully_shard``. A ``model_policy`` stops the first
training forward with :class:`PolicyNotAppliedError`, before anything trained, under
``mixed_precision`` "bf16" and "no". Without the guard (the negative control) accelerate
computes the kept gates in bf16 under autocast and says nothing, or crashes in the router
without it. Under a launcher with one process the policy applies: FSDP2 at world size 1, the
gates computed in fp32. The HF Trainer refuses FSDP without a launcher itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.harness import free_port

pytest.importorskip(
    "accelerate", reason="accelerate is not installed (pip install '.[accelerate]')"
)
pytest.importorskip("transformers", reason="transformers is not installed")

pytestmark = pytest.mark.distributed
FP32 = {"model.layers.0.mlp.gate": "torch.float32", "model.layers.1.mlp.gate": "torch.float32"}
BF16 = {k: "torch.bfloat16" for k in FP32}


def one_step(*args: str, launcher: bool = False) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)  # alone means alone
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    command = [*(run if launcher else [sys.executable]), "-m", "tests.support.one_process", *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(lines[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("mixed", ["bf16", "no"])
def test_accelerate_alone_stops_before_the_first_step(mixed: str) -> None:
    ran = one_step("accelerate", mixed)
    assert ran["error"].startswith("PolicyNotAppliedError: a model_policy was built"), ran
    assert "'model.layers.0.mlp.gate.weight' in float32" in ran["error"]
    assert "torchrun --nproc_per_node N" in ran["error"]
    assert ran["gates"] == {} and ran["changed"] == [], ran  # nothing computed, nothing trained


def test_accelerate_alone_without_the_guard_drops_the_policy() -> None:
    """The negative control: what accelerate does with the policy on its own."""
    autocast = one_step("accelerate", "bf16", "unguarded")
    assert autocast["error"] is None and autocast["distributed_type"] == "DistributedType.NO"
    assert autocast["gates"] == BF16 and autocast["changed"], autocast  # silently bf16, trained
    plain = one_step("accelerate", "no", "unguarded")
    assert "expected m1 and m2 to have the same dtype" in plain["error"], plain


@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_one_process_under_a_launcher_applies_the_policy(framework: str) -> None:
    ran = one_step(framework, "bf16", launcher=True)
    assert ran["error"] is None and ran["sharded"], ran
    assert ran["gates"] == FP32, ran


def test_lightning_fabric_on_one_device() -> None:
    """``ModelParallelStrategy`` on one device, no launcher: Fabric makes a world of one and
    the ``parallelize_fn`` applies the policy; the default single-device strategy makes no
    ``fully_shard`` call, and the policy built for the model stops its first step."""
    pytest.importorskip(
        "lightning", reason="lightning is not installed (pip install '.[lightning]')"
    )
    sharded = one_step("fabric", "bf16-true")
    assert sharded["error"] is None and sharded["sharded"], sharded
    assert sharded["strategy"] == "ModelParallelStrategy" and sharded["gates"] == FP32, sharded
    single = one_step("fabric", "bf16-mixed")
    assert single["error"].startswith("PolicyNotAppliedError"), single
    assert single["changed"] == [], single


def test_trainer_alone_refuses_fsdp_itself() -> None:
    ran = one_step("trainer", "bf16")
    assert "fsdp only works in distributed training" in ran["error"], ran
