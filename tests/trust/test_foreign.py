"""check_checkpoint: a checkpoint another framework will load (accelerate's ``save_state``
layout, torchtitan's ``step-N``), checked as the library's own loads check theirs. Each crafted
file is refused with nothing run; the negative control loads it the way those frameworks do
(DCP's default reader and planner) and the payload runs."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from fsdp_precision.checkpoint import (
    CheckpointNotFoundError,
    CheckpointReadError,
    UnsafeCheckpointError,
    check_checkpoint,
    save_step,
)

from tests.support.hostile import CRAFTED

pytestmark = pytest.mark.fast

#: The directory each craft damages, as accelerate lays out ``save_state`` under FSDP2.
TARGET = {
    "metadata": "pytorch_model_fsdp_0",
    "byte item": "optimizer_0",
    "escaping path": "optimizer_0",
}


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def accelerate_like(tmp_path: Path) -> Path:
    """``save_state``'s directories: the model and the optimizer, each a DCP checkpoint (keyed
    as accelerate keys them), beside files that are not DCP's."""
    root = tmp_path / "step_3"
    model, optimizer = trained()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd}, checkpoint_id=root / "pytorch_model_fsdp_0", no_dist=True)
    dcp.save({"optimizer": osd}, checkpoint_id=root / "optimizer_0", no_dist=True)
    (root / "random_states_0.pkl").write_bytes(b"accelerate's own, loaded by accelerate")
    return root


def test_an_undamaged_framework_checkpoint_passes(accelerate_like: Path) -> None:
    found = check_checkpoint(accelerate_like)
    assert [p.name for p in found] == ["optimizer_0", "pytorch_model_fsdp_0"]


@pytest.mark.parametrize("craft", list(CRAFTED))
def test_a_crafted_file_is_refused_and_runs_nothing(
    accelerate_like: Path, tmp_path: Path, craft: str
) -> None:
    sentinel = tmp_path / "ran"
    damage, message = CRAFTED[craft]
    damage(accelerate_like / TARGET[craft], sentinel)
    with pytest.raises(UnsafeCheckpointError, match=message):
        check_checkpoint(accelerate_like)
    assert not sentinel.exists(), "the payload ran"


@pytest.mark.parametrize("craft", ["metadata", "byte item"])
def test_the_framework_s_own_load_runs_the_payload(
    accelerate_like: Path, tmp_path: Path, craft: str
) -> None:
    """The negative control: DCP's defaults (what accelerate's load_state and torchtitan call)."""
    sentinel = tmp_path / "ran"
    CRAFTED[craft][0](accelerate_like / TARGET[craft], sentinel)
    model, optimizer = trained()
    msd, osd = get_state_dict(model, optimizer)
    key, state = ("model", msd) if craft == "metadata" else ("optimizer", osd)
    with contextlib.suppress(Exception, CheckpointException):  # it fails after the payload ran
        dcp.load({key: state}, checkpoint_id=accelerate_like / TARGET[craft], no_dist=True)
    assert sentinel.exists()


def test_a_library_checkpoint_inside_is_verified_against_its_checksums(tmp_path: Path) -> None:
    model, optimizer = trained()
    save_step(tmp_path / "run", model, optimizer, step=1)
    assert [p.name for p in check_checkpoint(tmp_path / "run")] == ["step-000000001"]
    data = next((tmp_path / "run" / "step-000000001").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointReadError, match=r"does not match the checksum"):
        check_checkpoint(tmp_path / "run")


def test_a_short_data_file_is_refused(accelerate_like: Path) -> None:
    data = next((accelerate_like / "pytorch_model_fsdp_0").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(CheckpointReadError, match=r"holds \d+ bytes, its metadata needs"):
        check_checkpoint(accelerate_like)


def test_a_directory_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"no torch\.distributed\.checkpoint dir"):
        check_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=r"not a directory"):
        check_checkpoint(tmp_path / "missing")


def test_a_symlinked_directory_is_not_followed(accelerate_like: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dcp.save({"x": torch.ones(2)}, checkpoint_id=outside / "ck", no_dist=True)
    (accelerate_like / "linked").symlink_to(outside / "ck", target_is_directory=True)
    assert "linked" not in [p.name for p in check_checkpoint(accelerate_like)]
