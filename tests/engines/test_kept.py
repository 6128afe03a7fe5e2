"""What an engine must hold, from the one description the library writes: an export's record
(``kept_of_export``) and a weight stream's metadata (``kept_of_stream``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_precision import EngineDtypeError, full_weights
from fsdp_precision._engines.kept import kept_of_export, kept_of_stream
from fsdp_precision.checkpoint import CheckpointReadError, export_safetensors

from tests.edges.test_export import GATES, mixed_qwen

pytestmark = pytest.mark.fast
bf16, fp32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kept") / "export"
    export_safetensors(mixed_qwen(), out, dtype=bf16)
    return out


def test_an_export_names_its_kept_tensors_and_bulk(export: Path) -> None:
    kept = kept_of_export(export)
    assert kept is not None
    assert dict(kept.tensors) == dict.fromkeys(GATES, fp32) and kept.bulk == bf16
    assert kept.source.endswith("fsdp_precision_export.json")
    assert kept.describe().startswith("2 kept tensors (2 in float32) from ")


def test_a_directory_without_the_record_is_not_a_trigger(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert kept_of_export(tmp_path) is None
    assert kept_of_export(tmp_path / "missing") is None


def test_the_record_is_read_again_when_it_changes(export: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    record = json.loads((export / "fsdp_precision_export.json").read_text())
    (copy / "fsdp_precision_export.json").write_text(json.dumps(record))
    first = kept_of_export(copy)
    assert first is not None and len(first.tensors) == 2
    record["kept"].pop(GATES[0])
    (copy / "fsdp_precision_export.json").write_text(json.dumps(record, indent=1))
    second = kept_of_export(copy)
    assert second is not None and list(second.tensors) == [GATES[1]]


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (
            lambda r: r.update(layout="plain"),
            EngineDtypeError,
            r"is a 'plain' export: inference engines load Hugging Face",
        ),
        (lambda r: r.update(kept={"x": {"dtype": "int4"}}), CheckpointReadError, r"kept entry 'x'"),
        (lambda r: r.update(format="other"), CheckpointReadError, r"its format is not"),
    ],
    ids=["plain layout", "bad dtype", "foreign"],
)
def test_a_record_engines_cannot_use_is_refused_by_name(
    export: Path, tmp_path: Path, edit: object, error: type[Exception], match: str
) -> None:
    record = json.loads((export / "fsdp_precision_export.json").read_text())
    edit(record)  # type: ignore[operator]
    (tmp_path / "fsdp_precision_export.json").write_text(json.dumps(record))
    with pytest.raises(error, match=match):
        kept_of_export(tmp_path)


def test_a_stream_describes_the_same_kept_tensors(export: Path) -> None:
    stream = full_weights(mixed_qwen(), dtype=bf16)
    from_stream, from_record = kept_of_stream(stream), kept_of_export(export)
    assert from_record is not None
    assert dict(from_stream.tensors) == dict(from_record.tensors)
    assert from_stream.bulk == from_record.bulk and from_stream.source == "stream"


def test_a_stream_in_another_layout_is_refused() -> None:
    stream = full_weights(mixed_qwen(), dtype=bf16, layout="plain")
    with pytest.raises(EngineDtypeError, match=r"the stream's layout is 'plain'"):
        kept_of_stream(stream)
