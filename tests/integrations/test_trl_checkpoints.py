"""TRL's SFTTrainer survives its own save, resume and export, with the real packages.

``examples/trl_sft_qwen3_moe.py`` is the user's run (tiny Qwen3-MoE from a bf16 checkpoint, the
gates in fp32 through ``model_policy`` + ``trainer_fsdp_policy``, ``save_strategy="steps"``,
``save_steps=3``, ``max_steps=6``), launched here with ``torchrun`` on 2 CPU ranks (gloo):

- once straight through to step 6;
- once preempted after step 4 (``--stop-after 4``: checkpoint-3 written, step 4 lost), a save
  that died half-way left beside it (``checkpoint-5`` with weights and config but no
  ``trainer_state.json``: what the Trainer's non-atomic save leaves), and a fresh launch that
  resumes from ``last_complete_checkpoint``.

The resumed run ends with every parameter bitwise equal to the uninterrupted run's (a digest
the example prints), having trained only steps 4-6; the Trainer wrote ``training_args.bin`` with
the policy in it (before the policy pickled, the first save crashed with ``PicklingError``); the
library's export reloads with ``from_pretrained`` + ``restore_kept`` to the trained fp32 gates,
which ``from_pretrained`` alone rounds to bf16. The same for ``--lora`` (the PEFT adapter).
Each launch costs 20-40 s: the runs are made once per module and shared by the tests.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fsdp_precision as fp
from fsdp_precision.integrations import last_complete_checkpoint, trainer_fsdp_policy

from tests.support import ROOT
from tests.support.harness import run_example
from tests.support.hf_models import deepseek_v3

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("trl", reason="trl is not installed (pip install '.[trl]')")
pytest.importorskip("datasets", reason="datasets is not installed (pip install '.[trl]')")

bf16, fp32 = torch.bfloat16, torch.float32
EXAMPLE = ROOT / "examples" / "trl_sft_qwen3_moe.py"
GATES = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]


# ---------------------------------------------------------------------- no launch


def write_checkpoint(root: Path, step: int, *, state: str | None) -> Path:
    """A ``checkpoint-<step>`` as the Trainer leaves it: weights and config, then (``state``)
    the ``trainer_state.json`` it writes last."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_last_complete_checkpoint_skips_what_a_save_left_half_written(tmp_path: Path) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    assert last_complete_checkpoint(tmp_path / "absent") is None
    assert last_complete_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path, 3, state=None)
    assert last_complete_checkpoint(tmp_path) is None  # only a torn one: start fresh
    complete = write_checkpoint(tmp_path, 9, state=json.dumps({"global_step": 9}))
    write_checkpoint(tmp_path, 12, state=None)  # killed before its trainer state
    write_checkpoint(tmp_path, 15, state='{"global_step": 1')  # killed while writing it
    write_checkpoint(tmp_path, 18, state="[]")  # not a trainer state
    (tmp_path / "checkpoint-20").write_text("a file, not a checkpoint")
    (tmp_path / "checkpoint-21-tmp").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(complete)
    assert last_complete_checkpoint(str(tmp_path)) == str(complete)
    # Negative control: transformers' own choice (resume_from_checkpoint=True) is the newest
    # name, whatever is in it.
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-18")
    newer = write_checkpoint(tmp_path, 100, state=json.dumps({"global_step": 100}))
    assert last_complete_checkpoint(tmp_path) == str(newer)  # by step, not by name


def test_the_trainer_arguments_pickle_with_the_policy_in_them() -> None:
    """What the Trainer does at every save: ``torch.save(self.args, "training_args.bin")``.
    The policy in ``fsdp_plugin_args`` is written as the plain policy it reads as."""
    from trl import SFTConfig

    model = deepseek_v3()
    policy = fp.model_policy(model, fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32))
    args = SFTConfig(
        output_dir="unused", use_cpu=True, bf16=True, fsdp=True, fsdp_config={"version": 2},
        report_to=[],
    )  # fmt: skip
    trainer_fsdp_policy(args, policy)
    # Negative control: the live policy's scope holds weak references to the model's modules,
    # which pickle refuses; without the policy's own reduction the save crashed here.
    with pytest.raises(TypeError, match=r"cannot pickle 'weakref"):
        pickle.dumps(policy.scope)
    buffer = io.BytesIO()
    torch.save(args, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).fsdp_plugin_args["mixed_precision_policy"]
    assert type(loaded) is fp.ParamDtypeMixedPrecisionPolicy
    assert dict(loaded.param_dtype_map) == {"model.layers.1.mlp.gate.weight": fp32}
    assert (loaded.param_dtype, loaded.reduce_dtype) == (bf16, fp32)
    assert args.fsdp_plugin_args["mixed_precision_policy"] is policy  # the live one stays


# ---------------------------------------------------------------------- the launches


def launch(*args: object) -> str:
    return run_example(EXAMPLE, *args)


@dataclass(frozen=True)
class Runs:
    """The stdout of each launch and what the directories held before the resume."""

    whole: str  # straight through
    preempted: str  # stopped after step 4
    resumed: str  # the fresh launch after it
    whole_dir: Path
    parted_dir: Path
    picked_by_transformers: str | None  # get_last_checkpoint before the resume
    picked_by_us: str | None  # last_complete_checkpoint before the resume


def make_runs(root: Path, *flags: str) -> Runs:
    from transformers.trainer_utils import get_last_checkpoint

    whole, parted = root / "whole", root / "parted"
    whole_out = launch("--output-dir", whole, *flags)
    preempted = launch("--output-dir", parted, "--stop-after", "4", *flags)
    # A save of step 5 killed after its weights and config (the Trainer writes in place).
    torn = parted / "checkpoint-5"
    torn.mkdir()
    for name in os.listdir(parted / "checkpoint-3"):
        if name.endswith((".json", ".safetensors")) and name != "trainer_state.json":
            shutil.copy(parted / "checkpoint-3" / name, torn / name)
    picked_by_transformers = get_last_checkpoint(str(parted))
    picked_by_us = last_complete_checkpoint(parted)
    resumed = launch("--output-dir", parted, *flags)
    return Runs(whole_out, preempted, resumed, whole, parted, picked_by_transformers, picked_by_us)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return make_runs(tmp_path_factory.mktemp("trl"))


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    pytest.importorskip("peft", reason="peft is not installed (pip install '.[peft]')")
    return make_runs(tmp_path_factory.mktemp("trl-lora"), "--lora")


def test_the_straight_run_gathers_the_gates_in_fp32(runs: Runs) -> None:
    """The example's own check, printed by the uninterrupted run (the launch
    ``tests/project/test_examples.py`` leaves to this module)."""
    assert "gathered in fp32 (router gates)" in runs.whole, runs.whole[-2000:]


def test_the_straight_lora_run_gathers_the_gates_and_adapters_in_fp32(lora_runs: Runs) -> None:
    assert "gathered in fp32 (router gates, adapters)" in lora_runs.whole, lora_runs.whole[-2000:]


def digest(stdout: str) -> str:
    found = re.findall(r"parameters sha256 ([0-9a-f]{16})", stdout)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


def logged_steps(stdout: str) -> int:
    """How many training steps this launch logged (``logging_steps=1``)."""
    return len(re.findall(r"^\{'loss': ", stdout, flags=re.MULTILINE))


def losses(stdout: str) -> str:
    found = re.findall(r"loss per step: ([0-9., ]+)\)", stdout)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_fresh_launch_resumes_the_last_complete_checkpoint_bitwise(
    kind: str, request: pytest.FixtureRequest
) -> None:
    r: Runs = request.getfixturevalue("runs" if kind == "full" else "lora_runs")
    assert "preempted after step 4" in r.preempted and "checkpoint checkpoint-3" in r.preempted
    # The half-written checkpoint-5: transformers' choice (resume_from_checkpoint=True) ...
    assert r.picked_by_transformers == str(r.parted_dir / "checkpoint-5")
    # ... and the one the example resumed from.
    assert r.picked_by_us == str(r.parted_dir / "checkpoint-3")
    assert "resumed from checkpoint-3; trained to step 6" in r.resumed, r.resumed[-2000:]
    assert "started fresh; trained to step 6" in r.whole
    # The resumed launch trained steps 4-6 only (a restart from scratch would log 6), and
    # ended bitwise where the uninterrupted run did; the digest moves with training (step 4's
    # is another).
    assert (logged_steps(r.whole), logged_steps(r.preempted), logged_steps(r.resumed)) == (6, 4, 3)
    assert digest(r.resumed) == digest(r.whole)
    assert digest(r.preempted) != digest(r.whole)
    assert losses(r.resumed) == losses(r.whole)  # the history, steps 1-3 from checkpoint-3


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_every_trainer_save_holds_the_policy_as_a_plain_record(
    kind: str, request: pytest.FixtureRequest
) -> None:
    r: Runs = request.getfixturevalue("runs" if kind == "full" else "lora_runs")
    for checkpoint in ("checkpoint-3", "checkpoint-6"):
        path = r.whole_dir / checkpoint
        assert (path / "trainer_state.json").is_file(), sorted(os.listdir(path))
        args = torch.load(path / "training_args.bin", weights_only=False)
        policy = args.fsdp_plugin_args["mixed_precision_policy"]
        assert type(policy) is fp.ParamDtypeMixedPrecisionPolicy, type(policy)
        kept = {k for k, v in policy.param_dtype_map.items() if v == fp32}
        prefix = "base_model.model." if kind == "lora" else ""
        assert {prefix + g for g in GATES} <= kept, kept
        assert all(("lora_" in k) == (kind == "lora") for k in kept - {prefix + g for g in GATES})


@pytest.mark.integration
def test_the_exports_reload_with_the_trained_fp32_gates(runs: Runs) -> None:
    """``save_model()`` writes accelerate's fp32 masters (every tensor fp32); the library's
    export the bulk in bf16 and the gates in fp32, sharded. Reloaded with ``from_pretrained``
    the gates are rounded (Qwen3-MoE declares no keep for them); ``restore_kept`` puts back the
    values ``save_model()`` holds, bit for bit."""
    from safetensors.torch import load_file

    from fsdp_precision.checkpoint import read_export_record, restore_kept

    assert "restore_kept put back their trained fp32 values (bitwise)" in runs.whole
    final = load_file(runs.whole_dir / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {fp32}  # the fp32 masters
    export = runs.whole_dir / "export"
    record = read_export_record(export)
    shards = [f for f in record.files if f.endswith(".safetensors")]
    assert len(shards) > 1 and record.weights == "model.safetensors.index.json", record
    assert sorted(k.name for k in record.kept) == GATES and record.bulk == bf16
    exported: dict[str, torch.Tensor] = {}
    for shard in shards:
        exported.update(load_file(export / shard))
    assert exported.keys() == final.keys()
    for name, tensor in exported.items():
        want = final[name] if name in GATES else final[name].to(bf16)
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=bf16)
    rounded = {n: p.detach().clone() for n, p in model.named_parameters() if n in GATES}
    assert {p.dtype for p in rounded.values()} == {bf16}
    assert not any(torch.equal(rounded[n].float(), final[n]) for n in GATES)  # precision lost
    assert sorted(restore_kept(model, export)) == GATES
    params = dict(model.named_parameters())
    for name in GATES:
        assert params[name].dtype == fp32 and torch.equal(params[name], final[name]), name


@pytest.mark.integration
def test_the_adapter_exports_load_with_peft(lora_runs: Runs) -> None:
    """``--lora``: both exports are the adapter alone, in fp32; PEFT loads the library's."""
    from safetensors.torch import load_file

    assert "PeftModel.from_pretrained loaded the 8 trained fp32 adapters" in lora_runs.whole
    export = lora_runs.whole_dir / "export"
    assert {p.name for p in export.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "fsdp_precision_export.json",
    }
    ours = load_file(export / "adapter_model.safetensors")
    trainers = load_file(lora_runs.whole_dir / "final" / "adapter_model.safetensors")
    assert ours.keys() == trainers.keys() and len(ours) == 8
    assert all(t.dtype == fp32 and torch.equal(t, trainers[n]) for n, t in ours.items())
