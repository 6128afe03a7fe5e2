"""transformers' native FSDP2 (``from_pretrained(..., distributed_config=...)``) with the opt-in.

transformers wraps the model itself with one hard-coded ``MixedPrecisionPolicy(bf16, fp32)``:
DeepSeek-V3's ``_keep_in_fp32_modules_strict`` router gates get their own unit and are still
gathered in bf16 (the negative control). Inside ``transformers_native_fsdp(rules)`` every call
gets ``model_policy(model, rules)``: the gates are gathered in fp32, the collectives unchanged.
2 gloo ranks, a real checkpoint written by ``save_pretrained`` of a tiny model. Parity: one step
is bitwise equal to the same checkpoint wrapped by ``testing.wrap_separate_units`` (other units,
the same rules and ranks); transformers' own policy is not. Save, resume and export: the example
(``examples/transformers_native_qwen3_moe.py``) under ``torchrun``, straight through and
preempted then resumed in a fresh launch from the library's step checkpoints, ends bitwise
equal; its export reloads to the trained fp32 gates with ``restore_kept``.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_precision as fp
from fsdp_precision.integrations import transformers_native_fsdp
from fsdp_precision.testing import CollectiveRecorder, GatherProbe, wrap_separate_units

from tests.support import ROOT
from tests.support.harness import (
    collect_cases,
    distributed_suite,
    run_example,
    torchrun_environment,
)
from tests.support.hf_models import deepseek_v3

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
if not hasattr(transformers, "DistributedConfig"):
    pytest.skip("this transformers has no native FSDP2 path", allow_module_level=True)

bf16, fp32 = torch.bfloat16, torch.float32
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32)


def load(path: str) -> nn.Module:
    torchrun_environment()
    config = transformers.DistributedConfig(
        fsdp_size=dist.get_world_size(), fsdp_mixed_precision=True
    )
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=bf16, distributed_config=config
    )


def ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))


@contextmanager
def checkpoint() -> Iterator[str]:
    """A tiny DeepSeek-V3 checkpoint, written by rank 0 into a directory every rank reads."""
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    path = os.path.join(where[0], "dsv3")
    try:
        if dist.get_rank() == 0:
            torch.manual_seed(0)
            deepseek_v3().save_pretrained(path)
        dist.barrier()
        yield path
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)


def step(model: nn.Module) -> tuple[dict[str, torch.dtype], tuple[int, int]]:
    batch = ids()
    with CollectiveRecorder() as recorder, GatherProbe(model) as probe:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    assert torch.isfinite(loss)
    kinds = [c.kind for c in recorder.calls]
    seen = {k: v.dtype for k, v in probe.seen.items()}
    return seen, (kinds.count("all_gather"), kinds.count("reduce_scatter"))


def gates(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("mlp.gate.weight")]


def case_native_fsdp_honours_the_keep_declarations() -> None:
    with checkpoint() as path:
        with transformers_native_fsdp(RULES):
            model = load(path)
        plain = load(path)  # outside the context: transformers' own policy
    for m in (model, plain):
        not_sharded = [n for n, p in m.named_parameters() if not isinstance(p, DTensor)]
        assert not not_sharded, not_sharded
    kept = gates(model)
    assert kept and all(p.dtype == fp32 for n, p in model.named_parameters() if n in kept)
    seen, counts = step(model)
    assert all(seen[n] == fp32 for n in kept), {n: seen[n] for n in kept}
    assert all(d == bf16 for n, d in seen.items() if n not in kept)
    plain_seen, plain_counts = step(plain)
    assert all(plain_seen[n] == bf16 for n in kept)  # the negative control: precision lost
    assert counts == plain_counts, (counts, plain_counts)


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward on this rank's batch; the loss and every gradient, gathered."""
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def case_native_fsdp_is_bitwise_equal_to_separate_fp32_units() -> None:
    """Parity: transformers' native wrap with the opt-in, against the separate-units reference.

    transformers makes its own calls (a unit per gate, each layer, the embedding, a grouped
    ``[norm, lm_head]`` kept after forward, the root), so the reference cannot go through it:
    the same checkpoint is loaded without ``distributed_config`` (the same storage dtypes: bf16,
    the gates fp32) and wrapped by ``wrap_separate_units`` with the same rules on the same 2
    ranks, with other units (each gate its own fp32 unit, each layer, the root). One step on
    the same batch gives bitwise the same loss and gradients: the grouping changes which
    collective carries a parameter, not the elements each reduce-scatter sums.
    """
    with checkpoint() as path:
        with transformers_native_fsdp(RULES):
            model = load(path)
        plain = load(path)  # transformers' own policy: the gates gathered in bf16
        local = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=bf16)
    assert not any(isinstance(p, DTensor) for p in local.parameters())
    plan = fp.compile_param_dtype_maps(local, RULES, fp.default_units(local), world_size=2)
    reference = wrap_separate_units(copy.deepcopy(local), plan)
    assert model.training == reference.training
    storage = {n: p.dtype for n, p in model.named_parameters()}
    assert storage == {n: p.dtype for n, p in reference.named_parameters()}
    kept = gates(model)
    assert kept and {storage[n] for n in kept} == {fp32}, storage
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = loss_and_grads(reference)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype and torch.equal(grad, ref_grads[name]), name
    # Negative control: transformers' own policy computes the gates' gradients differently, so
    # the equality above would fail if the opt-in gathered the gates in bf16.
    _, plain_grads = loss_and_grads(plain)
    assert not any(torch.equal(plain_grads[n], ref_grads[n]) for n in kept), kept


def test_unchecked_transformers_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from fsdp_precision import PatchIntegrityError
    from fsdp_precision._train.transformers_native import CHECKED

    live = importlib.import_module("transformers")  # the module the opt-in reads (sys.modules)
    monkeypatch.setattr(live, "__version__", "9.9.9")
    with pytest.raises(PatchIntegrityError, match=r"was not checked against transformers 9.9.9"):
        with transformers_native_fsdp(RULES):
            pass
    monkeypatch.setattr(live, "__version__", "5.24.0")
    changed = {k: "0" * 64 for k in CHECKED.get("5.24.0", {"x:y": ""})}
    monkeypatch.setitem(CHECKED, "5.24.0", changed)
    with pytest.raises(PatchIntegrityError, match=r"differs from the source the native-FSDP2"):
        with transformers_native_fsdp(RULES):
            pass
    import transformers.distributed.mixin as mixin
    from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism

    assert mixin.apply_fully_sharded_data_parallelism is apply_fully_sharded_data_parallelism


# ---------------------------------------------------------------------- save, resume, export

EXAMPLE = ROOT / "examples" / "transformers_native_qwen3_moe.py"


def launch(*args: object) -> str:
    return run_example(EXAMPLE, *args)


def digest(stdout: str) -> str:
    found = re.findall(r"parameters sha256 ([0-9a-f]{16})", stdout)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


def test_native_fsdp_resumes_bitwise_in_a_fresh_launch_and_exports(tmp_path: Path) -> None:
    """4 steps straight through, against 3 steps (a save at step 2), then a fresh launch that
    resumes from step 2 (``resume_from_latest``) and trains steps 3-4: every parameter bitwise
    equal. The export's gates are the trained fp32 values; ``from_pretrained(dtype=bf16)``
    alone rounds them (the example asserts both on rank 0 and says so)."""
    from safetensors.torch import load_file

    from fsdp_precision.checkpoint import read_export_record

    whole = launch("--output-dir", tmp_path / "whole")
    preempted = launch("--output-dir", tmp_path / "parted", "--stop-after", "3")
    resumed = launch("--output-dir", tmp_path / "parted")
    assert "started fresh, trained steps 1-4" in whole, whole[-2000:]
    assert "on transformers' FSDP2" in whole, whole[-2000:]  # the gates' gather, the example's
    assert "started fresh, trained steps 1-3; preempted" in preempted, preempted[-2000:]
    assert "resumed from step 2, trained steps 3-4" in resumed, resumed[-2000:]
    assert digest(resumed) == digest(whole)
    assert digest(preempted) != digest(whole)  # the digest sees training
    for out in (whole, resumed):
        assert "restore_kept put back their trained fp32 values (bitwise)" in out, out[-2000:]
    export = tmp_path / "whole" / "export"
    record = read_export_record(export)
    gates = [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
    assert sorted(k.name for k in record.kept) == gates and record.bulk == bf16
    assert record.weights == "model.safetensors.index.json" and record.step == 4
    # transformers' own save_pretrained works on the sharded model: every tensor as stored
    # (bf16 bulk, fp32 gates), equal to the export's, and no record of what was kept.
    saved = load_file(tmp_path / "whole" / "save_pretrained" / "model.safetensors")
    exported: dict[str, torch.Tensor] = {}
    for shard in (f for f in record.files if f.endswith(".safetensors")):
        exported.update(load_file(export / shard))
    assert saved.keys() == exported.keys()
    assert all(t.dtype == saved[n].dtype and torch.equal(t, saved[n]) for n, t in exported.items())
    assert {n for n, t in saved.items() if t.dtype == fp32} == set(gates)
    assert not (tmp_path / "whole" / "save_pretrained" / "fsdp_precision_export.json").exists()


CASES = collect_cases(globals())

results, test_native = distributed_suite(2, __name__, CASES)
