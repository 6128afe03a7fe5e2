"""A dtype error at the first forward names the kept parameter, the module and the fix.

torch's own message ("expected m1 and m2 to have the same dtype") names none of them; the note
the construction step's hooks add does, in training, in ``verify`` and in ``plan``'s trace.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fsdp_precision as fp
from fsdp_precision._policy.diagnose import NOTE_PREFIX, notes_of

from tests.policy.test_casts import Model, model, rules, run, wrap


@pytest.mark.usefixtures("world1")
def test_a_kept_module_that_does_not_cast_is_named_with_its_fix() -> None:
    m = model()
    wrap(m, fp.model_policy(m, rules("*router.weight", boundary="none")))
    with pytest.raises(RuntimeError, match="same dtype") as caught:
        run(m)
    (note,) = notes_of(caught.value)
    assert note.startswith(NOTE_PREFIX)
    assert "module 'router' (Router) holds kept 'router.weight' (float32)" in note
    assert "got bfloat16 inputs" in note and "boundary='auto'" in note
    assert "module_casts={'router': ModuleCast(torch.float32)}" in note


@pytest.mark.usefixtures("world1")
def test_activations_left_in_the_kept_dtype_are_named_where_they_fail() -> None:
    m = model()
    wrap(m, fp.model_policy(m, rules("*norm.weight", boundary="inputs")))
    with pytest.raises(RuntimeError) as caught:
        run(m)
    (note,) = notes_of(caught.value)
    assert "in the Layer came after kept modules returned activations" in note
    assert "'norm' (Scale) returned float32 for bfloat16 inputs" in note
    assert "boundary='inputs_outputs'" in note


class Broken(Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("not a dtype problem")


@pytest.mark.usefixtures("world1")
def test_other_errors_and_unmapped_models_get_no_note() -> None:
    torch.manual_seed(0)
    m = Broken()
    wrap(m, fp.model_policy(m, rules("*router.weight", boundary="none")))
    with pytest.raises(ValueError, match="not a dtype problem") as caught:
        m(torch.randn(2, 16))
    assert notes_of(caught.value) == []
    # A plain policy: torch's path, nothing installed, torch's error unchanged.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plain = nn.Linear(4, 4)
    fully_shard(plain, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(RuntimeError) as caught:
        plain(torch.randn(2, 4, dtype=torch.float64).to(torch.int64))
    assert notes_of(caught.value) == []


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_precision", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_plan_warns_when_a_keep_meets_a_module_that_does_not_cast() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    out = cli("plan", "hf:qwen3_moe", "--keep", "*.mlp.gate.weight", "--boundary", "none")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning: the first forward fails in the planned compute dtypes" in out.stdout
    assert "'model.layers.0.mlp.gate' (Qwen3MoeTopKRouter) holds kept" in out.stdout
    ok = cli("plan", "hf:qwen3_moe", "--keep", "*.mlp.gate.weight", "--units", "accelerate")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "first forward: runs" in ok.stdout and "warning" not in ok.stdout
    assert "units: accelerate" in ok.stdout


@pytest.mark.distributed
def test_verify_names_the_parameter_the_module_and_the_fix() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    out = cli("verify", "hf:qwen3_moe", "--keep", "*.mlp.gate.weight", "--boundary", "none")
    assert out.returncode == 1
    assert "verify failed: RuntimeError: expected m1 and m2 to have the same dtype" in out.stderr
    assert "(Qwen3MoeTopKRouter) holds kept 'mlp.gate.weight' (float32)" in out.stderr
    good = cli("verify", "hf:qwen3_moe", "--keep", "*.mlp.gate.weight")
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]


class Table(nn.Module):
    """A block that holds a kept table itself and mixes it into its activations without
    casting back (LTX-Video's transformer block and its ``scale_shift_table``)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(dim) / 10)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * (1 + self.table))


@pytest.mark.usefixtures("world1")
def test_a_kept_parameter_the_block_mixes_in_itself_is_named() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(Table(), nn.Linear(16, 16))
    kept = fp.PrecisionRules(rules=(fp.Glob("*table"),), param_dtype=torch.bfloat16)
    plan = fp.compile_param_dtype_maps(m, kept, [m[0], m])
    plan.apply()
    with pytest.raises(RuntimeError) as caught:
        m(torch.randn(3, 16))
    (note,) = notes_of(caught.value)
    assert "the Table holds kept 'table' (float32) itself" in note
    assert "keep none of them" in note
    assert "returned" not in note  # no kept module returned anything: none is blamed
