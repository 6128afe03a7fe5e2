"""A run's checkpoints in one directory (``checkpoint.save_step`` / ``latest_checkpoint`` /
``resume_from_latest``), in one process: the last ``keep_last`` kept, an incomplete step
skipped, the metadata's ``extra`` round-tripped, bad input refused before anything is written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from fsdp_precision import checkpoint
from fsdp_precision.checkpoint import METADATA_FILE, CheckpointError

from tests.support.models import net

pytestmark = pytest.mark.usefixtures("world1")


def test_keeps_the_last_and_resumes_from_the_newest(tmp_path: Path) -> None:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        checkpoint.save_step(tmp_path, model, opt, step=step, keep_last=2, extra={"n": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002", "step-000000003"]
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-000000003"
    fresh = net(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    meta = checkpoint.resume_from_latest(tmp_path, fresh, fresh_opt)
    assert meta is not None and meta["step"] == 3 and meta["extra"] == {"n": 3}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_an_incomplete_step_is_skipped(tmp_path: Path) -> None:
    model = net()
    for step in range(2):
        checkpoint.save_step(tmp_path, model, step=step)
    # what a save killed before its metadata leaves: the step's files without the marker
    (tmp_path / "step-000000001" / METADATA_FILE).unlink()
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-000000000"
    assert checkpoint.resume_from_latest(tmp_path, net())["step"] == 0  # type: ignore[index]
    shutil.rmtree(tmp_path / "step-000000000")
    assert checkpoint.resume_from_latest(tmp_path, net()) is None  # nothing complete: a start
    assert checkpoint.latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, r"step=-1; pass an integer >= 0"),
        ({"step": 1, "keep_last": 0}, r"keep_last=0; pass an integer >= 1"),
        ({"step": True}, r"step=True; pass an integer >= 0"),
        ({"step": 1, "extra": {"t": torch.ones(1)}}, r"extra is not JSON-serialisable"),
        ({"step": 1, "extra": [1]}, r"extra=\[1\] is not a mapping"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save_step(tmp_path / "run", net(), **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
