"""Every checkpoint the library writes resumes: parameters the optimizer held no state for at the
save (an expert no token reached yet, a head not used yet) resume exactly, bitwise the
uninterrupted run, on 2 gloo ranks, sharded and full."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.checkpoint import (
    METADATA_FILE,
    CheckpointReadError,
    load_checkpoint,
    save_checkpoint,
)

from tests.support.harness import check, run_cases

ROOT_ENV = "FSDP_PRECISION_RESUME_ROOT"


class Experts(nn.Module):
    """A router choosing between two experts; ``reach`` says which the tokens reach (a
    router that sends nothing to expert 1 yet), plus a head used only from some step."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.router = nn.Linear(8, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)
        self.aux_head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, reach: tuple[int, ...], aux: bool) -> torch.Tensor:
        h = self.norm(x)
        weights = torch.softmax(self.router(h).float(), -1).to(h.dtype)
        h = sum(weights[..., i : i + 1] * self.experts[i](h) for i in reach)
        out = self.head(h).sum()
        return out + self.aux_head(h).sum() if aux else out


def wrapped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Experts()
    rules = PrecisionRules(param_dtype=torch.bfloat16, rules=(Glob("router.weight"),), advice="off")
    policy = model_policy(model, rules)
    for expert in model.experts:
        fully_shard(expert, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


#: Steps 0-1 reach expert 0 only, without the auxiliary head; from step 2 everything is used.
def step(model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + dist.get_rank()))
    reach, aux = ((0,), False) if i < 2 else ((0, 1), True)
    model(x, reach, aux).backward()
    optimizer.step()
    optimizer.zero_grad()


def local(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    found = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            found[f"{n}/{key}"] = (
                value.to_local() if hasattr(value, "to_local") else value
            ).clone()
    return found


def case_a_checkpoint_with_stateless_parameters_resumes_bitwise() -> None:
    root = Path(os.environ[ROOT_ENV])
    uninterrupted, opt = wrapped(0)
    for i in range(4):
        if i == 2:
            for kind in ("sharded", "full"):
                save_checkpoint(root / kind, uninterrupted, opt, state_dict_type=kind, step=i)
        step(uninterrupted, opt, i)
    want = local(uninterrupted, opt)
    for kind in ("sharded", "full"):
        marker = json.loads((root / kind / METADATA_FILE).read_text())
        assert marker["optimizer_stateless"] == [
            "aux_head.bias", "aux_head.weight", "experts.1.bias", "experts.1.weight"
        ]  # fmt: skip
        resumed, ropt = wrapped(1)
        assert load_checkpoint(root / kind, resumed, ropt)["step"] == 2
        assert not any(ropt.state.get(p) for p in resumed.experts[1].parameters())
        for i in (2, 3):
            step(resumed, ropt, i)
        got = local(resumed, ropt)
        assert got.keys() == want.keys(), kind
        differs = [n for n in want if not torch.equal(got[n], want[n])]
        assert not differs, (kind, differs)


def case_without_the_record_the_load_fails_as_it_did() -> None:
    """The negative control: the marker's record of stateless parameters removed, the load fails
    as every such checkpoint did before (DCP finds no state for the unreached expert)."""
    root = Path(os.environ[ROOT_ENV])
    marker = root / "sharded" / METADATA_FILE
    dist.barrier()
    if dist.get_rank() == 0:
        data = json.loads(marker.read_text())
        data["optimizer_stateless"] = []
        marker.write_text(json.dumps(data))
    dist.barrier()
    resumed, ropt = wrapped(1)
    with pytest.raises(CheckpointReadError, match=r"Missing key in checkpoint state_dict: optim\."):
        load_checkpoint(root / "sharded", resumed, ropt)


CASES = [
    "case_a_checkpoint_with_stateless_parameters_resumes_bitwise",
    "case_without_the_record_the_load_fails_as_it_did",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    os.environ[ROOT_ENV] = str(tmp_path_factory.mktemp("resume"))
    return run_cases(2, __name__, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_two_ranks(results: dict[str, str], case: str) -> None:
    check(results[case])
