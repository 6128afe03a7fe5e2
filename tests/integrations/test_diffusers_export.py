"""A Diffusers ``WanTransformer3DModel`` trained through accelerate's FSDP2 plugin with one
``model_policy``, exported with ``export_safetensors`` to what ``from_pretrained`` loads.

The tiny Wan (2 blocks) keeps its own declarations in fp32 (``_keep_in_fp32_modules``:
``scale_shift_table``, ``time_embedder``, ``norm2``) and, by a rule Diffusers does not know, the
first block's ``attn1.norm_q.weight``. After 2 steps on 2 gloo ranks: ``dtype="stored"`` writes
the fp32 master weights, which ``from_pretrained(dir)`` loads bit for bit; ``dtype=torch.bfloat16``
writes the bulk in bf16 and the kept tensors in fp32. ``from_pretrained(dir, torch_dtype=bf16)``
keeps the declared ones in fp32 (equal to the trained values) and rounds the rule's;
``restore_kept`` puts it back, and the reloaded model's forward is then bitwise the trained
FSDP2 model's (compared on rank 0, in one process).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

import fsdp_precision as fp
from fsdp_precision.checkpoint import export_safetensors, read_export_record, restore_kept
from fsdp_precision.integrations import accelerate_fsdp2_on_cpu
from fsdp_precision.testing import GatherProbe

from tests.support.harness import collect_cases, distributed_suite, fresh_accelerate_state
from tests.support.hf_models import wan, wan_model_inputs

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed")

bf16, fp32 = torch.bfloat16, torch.float32
RULE = "blocks.0.attn1.norm_q.weight"  # kept by a rule, not by Wan's declarations
DECLARED = ("scale_shift_table", "time_embedder", "norm2")
RULES = fp.PrecisionRules(param_dtype=bf16, reduce_dtype=fp32, rules=(fp.Glob(RULE),))


def trained_wan() -> tuple[nn.Module, set[str]]:
    """A tiny Wan prepared by accelerate (FSDP2, ``model_policy``), after 2 AdamW steps; the
    names of the parameters gathered in fp32."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    fresh_accelerate_state()
    torch.manual_seed(0)
    model = wan()  # fp32 master weights
    policy = fp.model_policy(model, RULES)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=policy, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    accelerate_fsdp2_on_cpu(accelerator, plugin)
    model, optim = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        with GatherProbe(model) as probe:
            out = model(**wan_model_inputs(g))[0]
        target = torch.randn(out.shape, generator=g)
        accelerator.backward(torch.nn.functional.mse_loss(out.float(), target))
        optim.step()
        optim.zero_grad()
    kept = {n for n, t in probe.seen.items() if t.dtype == fp32}
    return model, kept


def shared_dir() -> Path:
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    return Path(where[0])


def fsdp_units(model: nn.Module) -> list[str]:
    """The modules accelerate made FSDP units of (the root is ``""``)."""
    from torch.distributed.fsdp import FSDPModule

    return [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unit_input_casts(model: nn.Module, units: list[str]) -> Iterator[None]:
    """Cast the floating inputs of ``units`` to bf16, as FSDP's ``cast_forward_inputs`` did."""

    def cast(module: nn.Module, args: Any, kwargs: Any) -> Any:
        low = tree_map(
            lambda x: x.to(bf16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
            (args, kwargs),
        )
        return low

    handles = [
        model.get_submodule(u).register_forward_pre_hook(cast, with_kwargs=True) for u in units
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def file_dtypes(path: Path) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118


def case_wan_trained_through_accelerate_exports_what_from_pretrained_loads() -> None:
    from diffusers import WanTransformer3DModel

    model, kept = trained_wan()
    declared = {n for n in kept if any(d in n.split(".") for d in DECLARED)}
    assert RULE in kept and declared and kept == declared | {RULE}, sorted(kept)
    trained = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    inputs = wan_model_inputs(torch.Generator().manual_seed(5))  # the same on every rank
    with torch.no_grad():
        expected = model(**inputs)[0]  # the FSDP2 model's forward (collective)
    root = shared_dir()
    try:
        stored = export_safetensors(model, root / "stored")  # collective
        low = export_safetensors(model, root / "bf16", dtype=bf16)
        if dist.get_rank() != 0:
            return
        for out in (stored.parent, low.parent):
            assert sorted(p.name for p in out.iterdir()) == [
                "config.json", "diffusion_pytorch_model.safetensors", "fsdp_precision_export.json"
            ]  # fmt: skip
            config = json.loads((out / "config.json").read_text())
            assert config["_class_name"] == "WanTransformer3DModel" and config["num_layers"] == 2
        # dtype="stored": the fp32 master weights; from_pretrained(dir) loads them bit for bit.
        assert set(file_dtypes(stored).values()) == {fp32}
        reloaded = WanTransformer3DModel.from_pretrained(stored.parent)
        params = dict(reloaded.named_parameters())
        assert params.keys() == trained.keys()
        assert all(
            torch.equal(params[n], t) and params[n].dtype == fp32 for n, t in trained.items()
        )

        # dtype=bf16: the bulk in bf16, every kept tensor in fp32, recorded with its reason.
        written = file_dtypes(low)
        assert {n for n, d in written.items() if d == fp32} == kept, written
        assert all(d == bf16 for n, d in written.items() if n not in kept)
        record = read_export_record(low.parent)
        reasons = {k.name: k.reason for k in record.kept}
        assert reasons.keys() == kept and "_keep_in_fp32_modules" in reasons["scale_shift_table"]
        # from_pretrained(torch_dtype=bf16) keeps Wan's declared modules in fp32 (equal to the
        # trained values) and rounds the rest, the rule's norm_q included.
        reloaded = WanTransformer3DModel.from_pretrained(low.parent, torch_dtype=bf16)
        params = dict(reloaded.named_parameters())
        assert {n for n, p in params.items() if p.dtype == fp32} == declared
        assert all(torch.equal(params[n], trained[n]) for n in declared)
        assert params[RULE].dtype == bf16 and not torch.equal(params[RULE].float(), trained[RULE])
        assert all(torch.equal(p, trained[n].to(bf16)) for n, p in params.items() if n not in kept)
        restored = restore_kept(reloaded, low.parent)
        assert set(restored) == kept, restored
        assert all(params[n].dtype == fp32 and torch.equal(params[n], trained[n]) for n in kept)
        # It computes as the trained model did, given what FSDP did at the unit boundaries:
        # every unit accelerate made casts its floating inputs to bf16 (the rotary tables and
        # the fp32 timestep projection at each block, the fp32 input of norm_out, which
        # accelerate 1.16 makes a unit as the "final norm"). Without those casts it does not.
        for p in reloaded.parameters():  # CPU kernels differ in the last bit with alignment;
            p.data = p.data.clone()  # from_pretrained leaves fp32 tensors 16-byte aligned
        with torch.no_grad():
            plain = reloaded(
                **{k: v.to(bf16) if k.endswith("states") else v for k, v in inputs.items()}
            )[0]
            with unit_input_casts(reloaded, fsdp_units(model)):
                got = reloaded(**inputs)[0]
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        assert not torch.equal(plain, expected)
        # Without a torch_dtype, Diffusers loads every tensor in the model's default fp32: the
        # bf16 bulk upcast, the kept tensors exact.
        upcast = dict(WanTransformer3DModel.from_pretrained(low.parent).named_parameters())
        assert all(p.dtype == fp32 for p in upcast.values())
        assert all(torch.equal(upcast[n], trained[n]) for n in kept)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


CASES = collect_cases(globals())

results, test_diffusers_export = distributed_suite(2, __name__, CASES)
