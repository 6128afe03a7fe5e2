"""The released sizes of ``test_diffusion_blocks`` (opt-in: ``pytest -m slow``): one LTX-2.3
layer (814M parameters with its embedders and projections) and one Wan 2.2 14B block (351M),
under FSDP 1x4 and HSDP 2x2 on 4 gloo ranks, kept parameters in-unit against separate units.

Memory: the models are built on the meta device, stored in bf16 with the kept tensors upcast to
fp32 (as ``from_pretrained(dtype=bf16)`` plus the rules give them), sharded, then materialized
tensor by tensor with values that depend only on each tensor's name; the two layouts run one
after the other, the first's gradients kept on disk meanwhile. One forward and backward each:
outputs bitwise; gradients bitwise under HSDP 2x2 and equal to gloo's 4-rank summation order
under FSDP 1x4. Peak: about 4 GiB per rank (LTX-2.3), under 24 GiB for the four.
"""

from __future__ import annotations

import gc
import os
import tempfile
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp_precision as fp
from fsdp_precision.testing import wrap_separate_units

from tests.hf.test_diffusion_blocks import BUILDERS
from tests.support.harness import distributed_suite

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install '.[hf]')")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # four cases, minutes each
bf16, fp32 = torch.bfloat16, torch.float32


def materialize(model: nn.Module) -> None:
    """Every parameter from a generator seeded by its name (the same values in any layout)."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = (torch.randn(param.shape, generator=g) * 0.02).to(param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(full)


def fine(units: list[nn.Module]) -> list[nn.Module]:
    """Units of at most about 32M parameters where the modules allow (a larger leaf is one unit),
    innermost first, the planned units after the units inside them: a unit's gathered
    parameters, gradients and fp32 reduce-scatter buffer exist at once, and four ranks share
    the machine's memory."""

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def members(module: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        for child in module.children():
            out += members(child) if isinstance(child, nn.ModuleList) else [child]
        return out

    def split(module: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        for child in members(module):
            if size(child) > 1 << 20:
                out += [*split(child), child] if size(child) > 32 << 20 else [child]
        return out

    out: list[nn.Module] = []
    for block in units[:-1]:
        out += [*split(block), block]
    root, inner = units[-1], units[-1].get_submodule("model")
    outside = [m for m in split(inner) if not any(m is u or _under(m, u) for u in units[:-1])]
    return [*out, *outside, root]


def _under(module: nn.Module, unit: nn.Module) -> bool:
    return any(module is m for m in unit.modules())


def run(name: str, layout: str, mesh: Any, hsdp: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    with torch.device("meta"):
        driven, units, rules, make = BUILDERS[name](True)
        driven.to(bf16)
    plan = fp.compile_param_dtype_maps(
        driven, rules, fine(units), world_size=mesh.size(-1), hsdp=hsdp
    )
    if layout == "in_unit":
        plan.apply(mesh=mesh)
    else:
        wrap_separate_units(driven, plan, mesh=mesh)
    materialize(driven)
    seed = dist.get_rank() % mesh.size(-1) if hsdp else dist.get_rank()
    inputs = make(torch.Generator().manual_seed(seed))
    out = driven(inputs)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.to_local() for n, p in driven.named_parameters()}  # type: ignore[union-attr]
    kept = {p.fqn for u in plan.units for p in u.params if p.claimed}
    assert kept and all(driven.get_parameter(f).dtype == fp32 for f in kept)
    return out.detach(), grads


def check(name: str, mesh_shape: str) -> None:
    hsdp = mesh_shape == "hsdp_2x2"
    mesh = (
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (dist.get_world_size(),))
    )
    with tempfile.TemporaryDirectory() as tmp:
        # the first layout's gradients wait on disk: four ranks share the machine's memory
        path = os.path.join(tmp, "grads.pt")
        ours, grads = run(name, "in_unit", mesh, hsdp)
        torch.save(grads, path)
        del grads
        gc.collect()
        theirs, their_grads = run(name, "separate_units", mesh, hsdp)
        assert torch.equal(ours, theirs)
        our_grads = torch.load(path, mmap=True, weights_only=True)
        for key, grad in their_grads.items():
            if hsdp:
                assert torch.equal(our_grads[key], grad), key
            else:
                torch.testing.assert_close(our_grads[key], grad, rtol=1e-5, atol=1e-8, msg=key)


def case_ltx23_fsdp_1x4() -> None:
    check("ltx23", "fsdp_1x4")


def case_ltx23_hsdp_2x2() -> None:
    check("ltx23", "hsdp_2x2")


def case_wan22_fsdp_1x4() -> None:
    check("wan22", "fsdp_1x4")


def case_wan22_hsdp_2x2() -> None:
    check("wan22", "hsdp_2x2")


CASES = [n for n in list(globals()) if n.startswith("case_")]
results, test_four_ranks_full_size = distributed_suite(4, __name__, CASES)
