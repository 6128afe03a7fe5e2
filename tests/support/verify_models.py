"""``module:callable`` models for ``fsdp-precision verify`` (tests/verify/test_verify.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.support.models import Block, Net


class TinyNet(Net):
    """tests.support.models.Net with one FSDP unit per block (declared the transformers way) and its
    own inputs."""

    _no_split_modules = ["Block"]

    def example_inputs(self, generator: torch.Generator) -> dict[str, Any]:
        return {"x": torch.randn(4, 16, generator=generator)}


class RankDependent(Net):
    """Negative control: the forward depends on the rank, as a per-rank seed or a rank-sharded
    input pipeline would make it. Each rank's loss still equals its own reference's, but FSDP
    averages the ranks' different gradients, so no rank's gradient is its reference's."""

    _no_split_modules = ["Block"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * (1 + dist.get_rank()))


class TrainingOnlyRead(torch.nn.Module):
    """A parameter read outside its unit only in training mode, which the planner's traced
    forward (in eval mode) does not take: the runtime guard of ``verify`` must name it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x.to(next(self.body.parameters()).dtype)
        return self.head(self.body(x) + x)


def example_inputs(model: torch.nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """Inputs for the models of this module that have no ``example_inputs`` method."""
    return {"x": torch.randn(4, 16, generator=generator)}


__all__ = ["Block", "RankDependent", "TinyNet", "TrainingOnlyRead", "example_inputs"]
