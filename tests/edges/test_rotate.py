"""A run's checkpoints in one directory (``checkpoint.save_step`` / ``latest_checkpoint`` /
``resume_from_latest``), in one process: the last ``keep_last`` kept, an incomplete or damaged
step skipped (and the previous one resumed), pruning that deletes only what it wrote, a step
that links out of the root ignored, the marker's fields checked, the metadata's ``extra``
round-tripped, bad input refused before anything is written."""

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


def nested(depth: int) -> dict[str, object]:
    """``{"a": {"a": ... {}}}``, ``depth`` dicts deep, built without recursing."""
    value: dict[str, object] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, r"step=-1; pass an integer >= 0"),
        ({"step": 1, "keep_last": 0}, r"keep_last=0; pass an integer >= 1"),
        ({"step": True}, r"step=True; pass an integer >= 0"),
        ({"step": 1, "extra": {"t": torch.ones(1)}}, r"extra is not JSON-serialisable"),
        ({"step": 1, "extra": [1]}, r"extra=\[1\] is not a mapping"),
        (
            {"step": 1, "extra": nested(3000)},
            r"extra=\{'a': \{'a': \{.*\}\}\} nests deeper than 100 ",
        ),
        ({"step": 1, "extra": nested(101)}, r"nests deeper than 100 levels; flatten it"),
        ({"step": 1, "extra": [nested(3000)]}, r"extra=\[\{'a': \{.*\}\}\] is not a mapping"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save_step(tmp_path / "run", net(), **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_extra_as_deep_as_the_limit_round_trips(tmp_path: Path) -> None:
    """Control for the depth refusal: 100 levels are written and read back."""
    checkpoint.save_step(tmp_path, net(), step=0, extra=nested(100))
    meta = checkpoint.read_checkpoint_metadata(tmp_path / "step-000000000")
    assert meta["extra"] == nested(100)


def test_save_checkpoint_refuses_a_deep_extra_untouched(tmp_path: Path) -> None:
    """A dict nested 3,000 deep is a ``CheckpointError`` naming ``extra`` (it was the JSON
    encoder's ``RecursionError``), and nothing is written."""
    with pytest.raises(CheckpointError, match=r"^extra=.* nests deeper than 100 levels"):
        checkpoint.save_checkpoint(tmp_path / "ck", net(), extra=nested(3000))
    assert list(tmp_path.iterdir()) == []


def test_pruning_deletes_only_what_it_wrote(tmp_path: Path) -> None:
    """Older steps and the leftovers of their interrupted saves go; a user's export or backup
    named after a step, and anything else beside them, stays."""
    model = net()
    checkpoint.save_step(tmp_path, model, step=1)
    theirs = ["step-000000001.hf", "step-000000001.backup", "step-000000001.tmp-mine", "notes"]
    for name in theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("mine")
    leftover = tmp_path / "step-000000001.tmp-0123456789ab"  # what a killed save leaves
    leftover.mkdir()
    for step in (2, 3):
        checkpoint.save_step(tmp_path, model, step=step, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*theirs, "step-000000003"])
    assert all((tmp_path / name / "file").read_text() == "mine" for name in theirs)


def damage_data_file(path: Path) -> None:
    next(path.glob("*.distcp")).unlink()


def test_a_damaged_newest_step_is_skipped_and_the_previous_one_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        checkpoint.save_step(tmp_path, model, opt, step=step)
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-000000001"  # control
    damage_data_file(tmp_path / "step-000000001")
    with caplog.at_level("WARNING", logger="fsdp_precision"):
        assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step-000000000"
    assert "skipping step checkpoint" in caplog.text and "lacks its data file" in caplog.text
    fresh = net(seed=1)
    meta = checkpoint.resume_from_latest(tmp_path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert meta is not None and meta["step"] == 0
    # Every step damaged: the newest one's error, never a fresh start over them.
    damage_data_file(tmp_path / "step-000000000")
    with pytest.raises(CheckpointError, match=r"step-000000001' lacks its data file"):
        checkpoint.resume_from_latest(tmp_path, net())


def test_a_step_that_links_out_of_the_root_is_skipped(tmp_path: Path) -> None:
    model = net()
    checkpoint.save_step(tmp_path / "elsewhere", model, step=7)
    checkpoint.save_step(tmp_path / "run", model, step=1)
    (tmp_path / "run" / "step-000000009").symlink_to(tmp_path / "elsewhere" / "step-000000007")
    assert checkpoint.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "step-000000001"


MARKER_DAMAGE = [
    ("step", "3"),
    ("step", -1),
    ("step", float("nan")),
    ("world_size", -2),
    ("world_size", True),
    ("has_optimizer", "no"),
    ("format_version", 999),
    ("state_dict_type", "both"),
    ("extra", [1]),
]


@pytest.mark.parametrize(
    ("field", "value"), MARKER_DAMAGE, ids=[f"{f}={v!r}" for f, v in MARKER_DAMAGE]
)
def test_a_marker_field_of_the_wrong_type_is_refused(
    tmp_path: Path, field: str, value: object
) -> None:
    import json

    model = net()
    checkpoint.save_step(tmp_path, model, step=1)
    path = tmp_path / "step-000000001"
    assert checkpoint.read_checkpoint_metadata(path)["step"] == 1  # control: undamaged, it reads
    marker = path / METADATA_FILE
    data = json.loads(marker.read_text())
    data[field] = value
    marker.write_text(json.dumps(data))
    fresh = net(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=rf"has field\(s\) of the wrong type or range: {field}="
    ):
        checkpoint.load_checkpoint(path, fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
