"""Diffusion transformer blocks (the Miles seed): an LTX-2.3 transformer and a Wan 2.2 block,
kept parameters inside their units, bitwise against the separate-units layout (each kept module
its own unit, plain torch policies), under FSDP 1x4 and HSDP 2x2 on 4 gloo ranks; tiny sizes
here, the released sizes in the opt-in slow tier (``-m slow``).

Kept (fp32 master weights, bf16 compute): LTX-2.3's gated-attention gates (``to_gate_logits``,
a router-like gate on every attention, whose logits scale the attention output: outputs back to
bf16, ``boundary="inputs_outputs"``) and query/key norms; Wan's declared ``norm2`` and the
query/key norms. Under HSDP 2x2 both layouts train two AdamW steps with outputs, losses,
gradients and parameters bitwise equal; under FSDP 1x4 outputs and losses are bitwise and the
gradients equal to the order in which gloo sums 4 ranks' contributions (it follows each
element's position in the reduce-scatter buffer, which the layouts fill differently). The kept
weights are gathered in fp32, the rest in bf16.

The default tier runs each mesh once (LTX-2.3 under FSDP 1x4, Wan under HSDP 2x2); the other
pairing of each runs with ``-m slow``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_precision as fp
from fsdp_precision.testing import GatherProbe, wrap_separate_units

from tests.support.harness import distributed_suite
from tests.support.hf_models import ltx23, ltx23_inputs, wan_inputs
from tests.support.models import train_in_lockstep

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install '.[hf]')")
bf16, fp32 = torch.bfloat16, torch.float32


class Driven(nn.Module):
    """A model driven by keyword inputs, returning one tensor (its outputs, flattened)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        out = self.model(**inputs)
        outs = out if isinstance(out, tuple) else (out,)
        return torch.cat([o.float().flatten() for o in outs])


def ltx(full: bool) -> tuple[Driven, list[nn.Module], fp.PrecisionRules, Callable[..., Any]]:
    torch.manual_seed(0)
    model = ltx23(full)
    rules = fp.PrecisionRules(
        param_dtype=bf16,
        reduce_dtype=fp32,
        rules=(
            # the gate logits scale the attention output: back to bf16 after the fp32 matmul
            fp.Glob("*to_gate_logits.*", boundary="inputs_outputs"),
            fp.Glob("*.norm_q.*"),
            fp.Glob("*.norm_k.*"),
        ),
    )
    driven = Driven(model)
    units = [*model.transformer_blocks, driven]  # type: ignore[attr-defined]
    return driven, units, rules, lambda g: ltx23_inputs(model, g)


def wan(full: bool) -> tuple[Driven, list[nn.Module], fp.PrecisionRules, Callable[..., Any]]:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    dim, ffn, heads = (5120, 13824, 40) if full else (32, 64, 4)
    block = WanTransformerBlock(
        dim=dim, ffn_dim=ffn, num_heads=heads, qk_norm="rms_norm_across_heads",
        cross_attn_norm=True, eps=1e-6,
    )  # fmt: skip
    rules = fp.PrecisionRules(
        param_dtype=bf16,
        reduce_dtype=fp32,
        rules=(fp.Glob("*norm2.*"), fp.Glob("*.norm_q.*"), fp.Glob("*.norm_k.*")),
    )
    driven = Driven(block)

    def inputs(g: torch.Generator) -> dict[str, Any]:
        if not full:
            return wan_inputs(g)
        seq, head_dim = 6, dim // heads
        freqs = torch.randn(1, seq, 1, head_dim // 2, generator=g)
        return {
            "hidden_states": torch.randn(1, seq, dim, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, dim, generator=g),
            "temb": torch.randn(1, 6, dim, generator=g),
            "rotary_emb": (
                freqs.cos().repeat_interleave(2, -1),
                freqs.sin().repeat_interleave(2, -1),
            ),
        }

    return driven, [block, driven], rules, inputs


BUILDERS = {"ltx23": ltx, "wan22": wan}


def bitwise_against_separate_units(name: str, mesh_shape: str, full: bool = False) -> None:
    hsdp = mesh_shape == "hsdp_2x2"
    mesh = (
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (dist.get_world_size(),))
    )
    ours, units, rules, make = BUILDERS[name](full)
    plan = fp.compile_param_dtype_maps(ours, rules, units, world_size=mesh.size(-1), hsdp=hsdp)
    kept = [p.fqn for u in plan.units for p in u.params if p.claimed]
    assert kept, "the rules keep something"
    reference = wrap_separate_units(copy.deepcopy(ours), plan, mesh=mesh)
    plan.apply(mesh=mesh)
    # the same inputs on every rank of a replica group, others per shard group
    seed = dist.get_rank() % mesh.size(-1) if hsdp else dist.get_rank()

    def step_inputs(step: int) -> Any:
        return make(torch.Generator().manual_seed(1000 * step + seed))

    with GatherProbe(ours) as probe:
        if hsdp:  # reduce-scatters over 2 ranks: a sum of two, the same in any layout
            train_in_lockstep([ours, reference], steps=2, make_input=step_inputs)
        else:
            one_step_to_reduction_order(ours, reference, step_inputs(0))
    assert all(probe.seen[f].dtype == fp32 for f in kept), [probe.seen[f].dtype for f in kept]
    bulk = [g.dtype for f, g in probe.seen.items() if f not in kept and g.numel > 1]
    assert bulk and all(d == bf16 for d in bulk), set(bulk)


def one_step_to_reduction_order(ours: nn.Module, reference: nn.Module, inputs: Any) -> None:
    """Over 4 ranks gloo sums each element's 4 contributions in an order set by its position in
    the reduce-scatter buffer, which the two layouts fill differently: outputs and losses are
    bitwise, gradients equal to fp32 summation order."""
    outs = [ours(inputs), reference(inputs)]
    assert torch.equal(outs[0], outs[1])
    for out in outs:
        out.float().pow(2).mean().backward()
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        mine, other = param.grad.full_tensor(), theirs[name].grad.full_tensor()  # type: ignore[union-attr]
        assert mine.dtype == other.dtype, name
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-8, msg=name)


def case_ltx23_fsdp_1x4() -> None:
    bitwise_against_separate_units("ltx23", "fsdp_1x4")


def case_ltx23_hsdp_2x2() -> None:
    bitwise_against_separate_units("ltx23", "hsdp_2x2")


def case_wan22_fsdp_1x4() -> None:
    bitwise_against_separate_units("wan22", "fsdp_1x4")


def case_wan22_hsdp_2x2() -> None:
    bitwise_against_separate_units("wan22", "hsdp_2x2")


CASES = [n for n in list(globals()) if n.startswith("case_")]
SLOW = ["case_ltx23_hsdp_2x2", "case_wan22_fsdp_1x4"]
results, test_four_ranks = distributed_suite(4, __name__, CASES, slow=SLOW)
