"""Hostile and damaged checkpoints: loading never runs what a file holds, and refuses a damaged
one before the model or the optimizer is touched.

Each crafted file carries a live payload (it creates a sentinel file when unpickled the way torch
itself would unpickle it: the negative control of each case shows that), and every load entry
point must refuse it with the sentinel absent and the model and optimizer as they were.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_precision.checkpoint import (
    CheckpointReadError,
    UnsafeCheckpointError,
    export_safetensors,
    load_checkpoint,
    resume_from_latest,
    save_step,
)

from tests.support import requires_export
from tests.support.hostile import CRAFTED

pytestmark = pytest.mark.fast


def model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A run's root with one step checkpoint, ``step-000000001``."""
    model, optimizer = model_and_optimizer()
    save_step(tmp_path / "run", model, optimizer, step=1)
    return tmp_path / "run" / "step-000000001"


ENTRY_POINTS: dict[str, Callable[[Path, nn.Module, torch.optim.Optimizer], Any]] = {
    "load_checkpoint": lambda p, m, o: load_checkpoint(p, m, o),
    "resume_from_latest": lambda p, m, o: resume_from_latest(p.parent, m, o),
    "export_safetensors": lambda p, m, o: export_safetensors(p, p.parent.parent / "export"),
}
ENTRY_PARAMS = [
    pytest.param(e, marks=[requires_export] if e == "export_safetensors" else [])
    for e in ENTRY_POINTS
]


@pytest.mark.parametrize("entry", ENTRY_PARAMS)
@pytest.mark.parametrize("craft", list(CRAFTED))
def test_a_crafted_checkpoint_runs_nothing_and_touches_nothing(
    saved: Path, tmp_path: Path, craft: str, entry: str
) -> None:
    sentinel = tmp_path / "ran"
    damage, message = CRAFTED[craft]
    damage(saved, sentinel)
    model, optimizer = model_and_optimizer(seed=1)
    before = state(model, optimizer)
    with pytest.raises(UnsafeCheckpointError, match=message):
        ENTRY_POINTS[entry](saved, model, optimizer)
    assert not sentinel.exists(), "the payload ran"
    assert same(state(model, optimizer), before), "the model or optimizer was touched"
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("craft", ["metadata", "byte item"])
def test_the_payloads_are_live_under_torchs_own_reader(
    saved: Path, tmp_path: Path, craft: str
) -> None:
    """The negative control: torch's DCP, as it reads by default, runs each payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sentinel = tmp_path / "ran"
    CRAFTED[craft][0](saved, sentinel)
    model, optimizer = model_and_optimizer(seed=1)
    msd, osd = get_state_dict(model, optimizer)
    from torch.distributed.checkpoint.api import CheckpointException

    try:  # it fails after the payload ran: os.system returned an int where DCP wants more
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=saved, no_dist=True)
    except (Exception, CheckpointException):  # noqa: BLE001
        pass
    assert sentinel.exists()


def test_a_truncated_data_file_is_refused_before_loading(saved: Path) -> None:
    data = next(saved.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8])
    model, optimizer = model_and_optimizer(seed=1)
    before = state(model, optimizer)
    with pytest.raises(
        CheckpointReadError, match=r"data file '__0_0\.distcp' holds \d+ bytes, its"
    ):
        load_checkpoint(saved, model, optimizer)
    assert same(state(model, optimizer), before)


def test_an_undamaged_checkpoint_loads(saved: Path) -> None:
    """What every refusal above is measured against: the same checkpoint, untouched, loads."""
    model, optimizer = model_and_optimizer(seed=1)
    want, _ = model_and_optimizer(seed=0)
    assert load_checkpoint(saved, model, optimizer)["step"] == 1
    assert same(model.state_dict(), want.state_dict())
