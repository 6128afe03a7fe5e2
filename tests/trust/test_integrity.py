"""No silent wrong data: checksums recorded at save and verified before anything is loaded, and
a load that races a save to the same directory loads one consistent checkpoint or refuses."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fsdp_precision.checkpoint import (
    METADATA_FILE,
    CheckpointReadError,
    export_safetensors,
    load_checkpoint,
    save_checkpoint,
)

from tests.support import requires_export

pytestmark = [pytest.mark.fast, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))


def flip_a_byte_of_tensor_data(path: Path) -> None:
    """One byte in the middle of the data file: inside a tensor's bytes, not DCP's framing."""
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


def test_a_flipped_byte_is_refused_and_without_checksums_it_loads_wrong(tmp_path: Path) -> None:
    saved = model(0)
    for checksums in (True, False):
        save_checkpoint(tmp_path / str(checksums), saved, checksums=checksums)
        flip_a_byte_of_tensor_data(tmp_path / str(checksums))
    fresh = model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointReadError, match=r"'__0_0\.distcp' does not match the checksum"):
        load_checkpoint(tmp_path / "True", fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # untouched
    if not requires_export.args[0]:  # the offline export checks too (it needs the hf extra)
        with pytest.raises(CheckpointReadError, match=r"does not match the checksum"):
            export_safetensors(tmp_path / "True", tmp_path / "export")
    # The negative control: without checksums the damage loads, silently.
    load_checkpoint(tmp_path / "False", fresh)
    differs = [
        k for k, v in saved.state_dict().items() if not torch.equal(v, fresh.state_dict()[k])
    ]
    assert differs, "the flipped byte should have changed a tensor"


def test_a_file_the_save_did_not_write_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", model(0))
    (tmp_path / "ck" / "__7_0.distcp").write_bytes(b"not ours")
    with pytest.raises(CheckpointReadError, match=r"holds files its save did not write \(\['__7_0"):
        load_checkpoint(tmp_path / "ck", model(1))


def test_the_marker_records_every_file(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", model(0))
    marker = json.loads((tmp_path / "ck" / METADATA_FILE).read_text())
    files = {p.name for p in (tmp_path / "ck").iterdir()} - {METADATA_FILE}
    assert marker["checksums"]["algorithm"] == "xxh3-128"
    assert set(marker["checksums"]["files"]) == files and ".metadata" in files


def test_a_load_racing_a_save_loads_one_checkpoint_or_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save to the same directory lands while the load checks the files: the load refuses
    before touching the model; with the pinning and the check undone (the negative control), the
    same race returns step 1's metadata over step 2's tensors."""
    from fsdp_precision._edges.checkpoint import save_load
    from fsdp_precision._trust import reader

    path = tmp_path / "ck"
    first, second = model(0), model(2)
    save_checkpoint(path, first, step=1)
    real_check = reader.check_files

    def a_save_lands_meanwhile(*args: object) -> None:
        real_check(*args)  # type: ignore[arg-type]
        monkeypatch.setattr(save_load, "check_files", real_check)  # once
        save_checkpoint(path, second, step=2)

    monkeypatch.setattr(save_load, "check_files", a_save_lands_meanwhile)
    fresh = model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointReadError, match=r"was replaced while it was being checked"):
        load_checkpoint(path, fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())

    @contextlib.contextmanager
    def unpinned(directory: Path) -> Iterator[tuple[Path, int]]:
        yield directory, 0

    save_checkpoint(path, first, step=1)
    monkeypatch.setattr(save_load, "check_files", a_save_lands_meanwhile)
    monkeypatch.setattr(save_load, "pinned", unpinned)
    monkeypatch.setattr(save_load, "same_directory", lambda *args: True)
    monkeypatch.setattr(save_load, "verify_checksums", lambda *args, **kwargs: None)
    mixed = load_checkpoint(path, fresh)
    assert mixed["step"] == 1
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in second.state_dict().items())
