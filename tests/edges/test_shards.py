"""Sharded safetensors written as the tensors arrive: what safetensors reads back, aligned as
safetensors aligns, split and indexed as Hugging Face splits and indexes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_precision._edges.shards import ShardWriter, check_shard_size, plan_shards

pytestmark = pytest.mark.fast
pytest.importorskip("safetensors")
pytest.importorskip("huggingface_hub")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    found = {
        "odd.bf16": torch.randn(3, generator=g).bfloat16(),  # 6 bytes: would misalign what follows
        "matrix.f32": torch.randn(2, 3, generator=g),
        "scalar.f64": torch.tensor(1.5, dtype=torch.float64),
        "mask.bool": torch.tensor([True, False, True]),
        "half.f16": torch.randn(5, generator=g).half(),
        "empty.f32": torch.empty(0, 4),
        "ids.i64": torch.arange(7),
        "t.f32": torch.randn(4, 3, generator=g).t(),  # not contiguous
    }
    if hasattr(torch, "float8_e4m3fn"):
        found["f8"] = torch.randn(6, generator=g).to(torch.float8_e4m3fn)
    return found


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def write(directory: Path, order: list[str], max_shard_size: int) -> list[str]:
    source = tensors()
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in source.items()]
    plan = plan_shards(meta, "model.safetensors", max_shard_size)
    writer = ShardWriter(directory, plan, {n: (d, s) for n, d, s in meta})
    for name in order:
        writer.add(name, source[name])
    return writer.close()


@pytest.mark.parametrize("max_shard_size", [10**9, 40], ids=["one file", "sharded"])
@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "reversed"])
def test_safetensors_reads_back_every_tensor_aligned(
    tmp_path: Path, max_shard_size: int, reverse: bool
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    source = tensors()
    order = list(source)[::-1] if reverse else list(source)
    files = write(tmp_path, order, max_shard_size)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert (len(shards) > 1) == (max_shard_size == 40), files
    got: dict[str, torch.Tensor] = {}
    for file in shards:
        got.update(load_file(str(tmp_path / file)))
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # mapped, not copied: the pointer shows the file's alignment
                tensor = f.get_tensor(name)
                if tensor.numel():
                    assert tensor.data_ptr() % tensor.element_size() == 0, name
    assert got.keys() == source.keys()
    for name, tensor in source.items():  # bit for bit (float8 and bool compared as bytes)
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(as_bytes(got[name]), as_bytes(tensor)), name
    if max_shard_size == 40:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(source)
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in source.values()
        )


def test_the_split_is_hugging_faces(tmp_path: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    source = tensors()
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in source.items()]
    plan = plan_shards(meta, "model.safetensors", 40)
    theirs = split_torch_state_dict_into_shards(
        source, filename_pattern="model{suffix}.safetensors", max_shard_size=40
    )
    assert plan.files == {f: list(n) for f, n in theirs.filename_to_tensors.items()}
    assert plan.entry == "model.safetensors.index.json"


def test_what_the_plan_does_not_hold_is_refused(tmp_path: Path) -> None:
    source = tensors()
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in source.items()]
    writer = ShardWriter(tmp_path, plan_shards(meta, "model.safetensors", 10**9), {
        n: (d, s) for n, d, s in meta
    })  # fmt: skip
    with pytest.raises(RuntimeError, match=r"'odd\.bf16' torch\.float32 \(3,\) is not in the plan"):
        writer.add("odd.bf16", torch.zeros(3))
    writer.add("odd.bf16", source["odd.bf16"])
    with pytest.raises(RuntimeError, match=r"tensors never arrived for \{'model\.safetensors'"):
        writer.close()


SIZES = [
    (5, 5),
    ("5GB", 5 * 10**9),
    ("500 MB", 500 * 10**6),
    ("2GiB", 2 * 2**30),
    ("1.5kb", 1500),
]


@pytest.mark.parametrize(("size", "expected"), SIZES, ids=[str(s[0]) for s in SIZES])
def test_shard_sizes(size: object, expected: int) -> None:
    assert check_shard_size(size) == expected
