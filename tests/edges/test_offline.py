"""The offline export reads a bounded share of a checkpoint at a time, whatever its names: one
numbered block (``layers.3``, or ``3`` where the blocks sit at the root of an ``nn.Sequential``),
or whole modules of no block up to one output shard (issue 48: both were read in one piece).
One process: reads are observed where DCP is asked for keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_precision._edges.offline as offline
from fsdp_precision.checkpoint import export_safetensors, save_checkpoint

from tests.support import requires_export

pytestmark = [pytest.mark.usefixtures("world1"), requires_export]


def reads(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys of each read the offline export makes, in order."""
    seen: list[list[str]] = []
    load = offline.trusted_load

    def recorded(state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        seen.append(sorted(state["model"]))
        return load(state, *args, **kwargs)

    monkeypatch.setattr(offline, "trusted_load", recorded)
    return seen


def exported(model: nn.Module, tmp_path: Path, shard: str) -> dict[str, torch.Tensor]:
    save_checkpoint(tmp_path / "ckpt", model)
    out = tmp_path / "out"
    export_safetensors(tmp_path / "ckpt", out, max_shard_size=shard)
    from safetensors.torch import load_file  # the hf extra (requires_export)

    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_blocks_at_the_root_are_read_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    seen = reads(monkeypatch)
    out = exported(model, tmp_path, "1MB")
    assert seen == [[f"{i}.bias", f"{i}.weight"] for i in range(4)]
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


class NoBlocks(nn.Module):
    """Modules whose names carry no block number: an embedding, two projections, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)  # 8 KB
        self.up = nn.Linear(32, 32)  # 4.2 KB
        self.down = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)  # 8 KB


def test_tensors_of_no_block_are_read_a_shard_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = NoBlocks()
    seen = reads(monkeypatch)
    out = exported(model, tmp_path, "10KB")
    sizes = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    assert len(seen) > 1, seen  # not one read of everything
    assert all(sum(sizes[k] for k in keys) <= 10_000 for keys in seen), seen
    owners = [{k.rpartition(".")[0] for k in keys} for keys in seen]
    assert sorted(m for o in owners for m in o) == ["down", "embed", "head", "up"]  # whole
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


def test_numbered_blocks_are_read_one_at_a_time_and_the_rest_beside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: ``layers.N`` names were already read per block."""
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    model.norm = nn.LayerNorm(8)
    seen = reads(monkeypatch)
    exported(model, tmp_path, "1MB")
    assert seen == [
        *([f"layers.{i}.bias", f"layers.{i}.weight"] for i in range(3)),
        ["norm.bias", "norm.weight"],
    ]
