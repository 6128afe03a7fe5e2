"""``export_safetensors``: what transformers and Diffusers load, kept tensors in their kept dtype,
sharded as Hugging Face shards, atomic, never touching what it did not write; ``restore_kept``.

Local cases run in the test process (an unwrapped model exports alone); the FSDP2 cases run on
two gloo ranks: a trained Qwen3-MoE, exported in bf16 with fp32 router gates, reloaded by
``from_pretrained`` and restored, computes the trained model's logits bit for bit.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_precision import Glob, PrecisionRules, model_policy
from fsdp_precision.checkpoint import (
    EXPORT_RECORD,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    export_safetensors,
    read_export_record,
    restore_kept,
    save_checkpoint,
)

from tests.support import requires_export
from tests.support.harness import check, run_cases
from tests.support.hf_models import tiny_qwen3_moe, wan

bf16, fp32 = torch.bfloat16, torch.float32
GATES = ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight")


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def mixed_qwen() -> nn.Module:
    """A bf16 Qwen3-MoE whose router gates are stored in fp32, with values bf16 cannot hold
    (unwrapped, it computes each parameter in its storage dtype: the gates are kept)."""
    pytest.importorskip("transformers")
    model = tiny_qwen3_moe(bf16)
    g = torch.Generator().manual_seed(3)
    for name in GATES:
        param = model.get_parameter(name)
        param.data = torch.randn(param.shape, generator=g) * 0.02
    return model


# ------------------------------------------------------------------ layouts (local)


@pytest.mark.fast
@requires_export
def test_transformers_layout_shards_loads_and_restores(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = mixed_qwen()
    entry = export_safetensors(model, tmp_path / "out", dtype=bf16, max_shard_size="60KB")
    out = tmp_path / "out"
    assert entry == out / "model.safetensors.index.json"
    index = json.loads(entry.read_text())
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["dtype"] == "bfloat16"
    assert (out / "generation_config.json").is_file()
    files = safetensors_of(out)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in files  # per expert, as on the Hub
    assert {n for n, t in files.items() if t.dtype == fp32} == set(GATES)
    record = read_export_record(out)
    assert [(k.name, k.dtype, k.param) for k in record.kept] == [(g, fp32, g) for g in GATES]
    assert record.weights == entry.name and set(record.files) >= {*shards, "config.json"}

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=bf16)
    gate = model.get_parameter(GATES[0])
    assert loaded.get_parameter(GATES[0]).dtype == bf16  # from_pretrained rounds them ...
    assert not torch.equal(loaded.get_parameter(GATES[0]).float(), gate)
    assert restore_kept(loaded, out) == list(GATES)  # ... restore_kept puts them back
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.fast
@requires_export
def test_diffusers_layout_loads(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = wan()
    for size, files in ((None, ["diffusion_pytorch_model.safetensors"]), ("4KB", None)):
        out = tmp_path / f"wan-{size}"
        entry = export_safetensors(model, out, **({"max_shard_size": size} if size else {}))
        written = sorted(p.name for p in out.glob("*.safetensors"))
        assert written == files if files else len(written) > 1, written
        assert entry.name.startswith("diffusion_pytorch_model.safetensors")
        assert (
            json.loads((out / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
        )
        loaded = WanTransformer3DModel.from_pretrained(out)
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.fast
@requires_export
def test_plain_layout_and_a_layout_the_model_is_not(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    export_safetensors(model, tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
        EXPORT_RECORD,
        "model.safetensors",
    ]
    assert safetensors_of(tmp_path / "plain").keys() == model.state_dict().keys()
    with pytest.raises(ValueError, match=r"layout='transformers' but the model is a Sequential"):
        export_safetensors(model, tmp_path / "x", layout="transformers")
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ bad input, nothing written

BAD = [
    ({"dtype": torch.int8}, r"dtype=torch\.int8 is not an export dtype; pass 'stored'"),
    ({"dtype": "fp32"}, r"dtype='fp32' is not an export dtype"),
    ({"max_shard_size": 0}, r"max_shard_size=0 is not a size; pass a positive number"),
    ({"max_shard_size": "5XB"}, r"max_shard_size='5XB' is not a size"),
    ({"max_shard_size": True}, r"max_shard_size=True is not a size"),
    ({"step": "3"}, r"step='3' is not an int"),
    ({"layout": "onnx"}, r"layout='onnx' is not a layout; pass one of"),
]


@pytest.mark.fast
@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_arguments_are_refused_before_anything(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        export_safetensors(nn.Linear(2, 2), tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ what is on disk


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.fast
@requires_export
def test_a_foreign_directory_is_refused_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointWriteError, match=r"is not an fsdp_precision export \(a non-emp"):
        export_safetensors(nn.Linear(2, 2), out)
    assert snapshot(out) == {"notes.txt": b"mine"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.fast
@requires_export
def test_an_earlier_export_is_replaced_and_files_others_added_are_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_safetensors(nn.Linear(2, 2), out)
    (out / "tokenizer.json").write_text("{}")  # what a user saves beside the weights
    (out / "extra").mkdir()
    (out / "extra" / "a.txt").write_text("a")
    model = nn.Linear(2, 2)
    export_safetensors(model, out)
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "extra" / "a.txt").is_file()
    assert torch.equal(safetensors_of(out)["weight"], model.weight.detach())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left


@pytest.mark.fast
@requires_export
def test_a_user_file_the_export_would_overwrite_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_safetensors(nn.Linear(2, 2), out, layout="plain")
    pytest.importorskip("transformers")
    (out / "config.json").write_text("user's own")  # the next (transformers) export writes one
    before = snapshot(out)
    with pytest.raises(CheckpointWriteError, match=r"config\.json' was not written by the earli"):
        export_safetensors(mixed_qwen(), out)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.fast
@requires_export
def test_a_failed_export_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    export_safetensors(nn.Linear(4, 4), out)
    before = snapshot(out)
    from fsdp_precision._edges import shards

    calls = {"n": 0}

    def full_disk_at_the_second_file(path: Any, mode: str) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return open(path, mode)

    monkeypatch.setattr(shards, "open", full_disk_at_the_second_file, raising=False)
    with pytest.raises(CheckpointWriteError, match=r"cannot export to '.*out' \(OSError\(28"):
        export_safetensors(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), out, max_shard_size=64)
    assert calls["n"] == 2 and snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # its own partial directory removed


# ------------------------------------------------------------------ records


RECORD_DAMAGE = [
    ("format", "other", r"its format is not 'fsdp_precision\.export'"),
    ("format_version", 9, r"format_version 9 is not 1"),
    ("tensors", "3", r"field 'tensors' is '3', not a int"),
    ("bulk", "int8", r"field 'bulk' is 'int8', not a floating dtype name"),
    ("files", ["../evil.safetensors"], r"file name '\.\./evil\.safetensors' is not a plain name"),
    ("kept", {"w": {"dtype": "float32", "reason": 3, "param": "w"}}, r"kept entry 'w' is"),
    ("casts", {"m": {"inputs": "float32", "outputs": "yes"}}, r"cast entry 'm' is"),
]


@pytest.mark.fast
@requires_export
@pytest.mark.parametrize(
    ("field", "value", "message"), RECORD_DAMAGE, ids=[d[0] for d in RECORD_DAMAGE]
)
def test_a_damaged_record_is_refused(tmp_path: Path, field: str, value: Any, message: str) -> None:
    export_safetensors(nn.Linear(2, 2), tmp_path)
    read_export_record(tmp_path)  # the negative control: undamaged, it reads
    data = json.loads((tmp_path / EXPORT_RECORD).read_text())
    data[field] = value
    (tmp_path / EXPORT_RECORD).write_text(json.dumps(data))
    with pytest.raises(CheckpointReadError, match=message):
        read_export_record(tmp_path)


@pytest.mark.fast
@requires_export
def test_restore_refuses_before_touching_the_model(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"holds no fsdp_precision_export\.json"):
        restore_kept(nn.Linear(2, 2), tmp_path)
    model = mixed_qwen()
    export_safetensors(model, tmp_path / "out", dtype=bf16)
    other = tiny_qwen3_moe(bf16, num_hidden_layers=1)  # lacks layer 1's gate
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(CheckpointError, match=r"the model has no tensor named \['model\.layers\.1"):
        restore_kept(other, tmp_path / "out")
    narrow = tiny_qwen3_moe(bf16, num_experts=2)  # gates of another shape
    with pytest.raises(CheckpointError, match=r"has shape \(4, 64\), the model's 'model\.layers"):
        restore_kept(narrow, tmp_path / "out")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert narrow.get_parameter(GATES[0]).dtype == bf16


# ------------------------------------------------------------------ FSDP2, two ranks


def root() -> Path:
    return Path(os.environ["FSDP_PRECISION_EXPORT_ROOT"])


def trained() -> tuple[nn.Module, torch.Tensor]:
    """A Qwen3-MoE (fp32 master weights, gates kept fp32) after two AdamW steps on 2 ranks, and
    its logits for one batch."""
    model = tiny_qwen3_moe(fp32)
    rules = PrecisionRules(
        param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("*.mlp.gate.weight"),), advice="off"
    )
    policy = model_policy(model, rules)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        batch = torch.randint(0, 128, (2, 12), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=batch_ids()).logits
    return model, logits


def batch_ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def case_exported_bf16_reloads_and_computes_as_trained() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model, logits = trained()
    gates = {n: model.get_parameter(n).full_tensor() for n in GATES}
    out = root() / "online"
    export_safetensors(model, out, dtype=bf16, max_shard_size="60KB", step=2)
    save_checkpoint(root() / "ckpt", model, step=2)
    if dist.get_rank() != 0:
        return
    assert read_export_record(out).step == 2
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=bf16).eval()
    with torch.no_grad():
        rounded = loaded(input_ids=batch_ids()).logits
    assert not torch.equal(rounded, logits)  # the negative control: gates rounded to bf16
    restore_kept(loaded, out)
    assert all(torch.equal(loaded.get_parameter(n), g) for n, g in gates.items())
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=batch_ids()).logits, logits)


def case_offline_export_equals_the_online_one() -> None:
    if dist.get_rank() != 0:
        return
    offline = root() / "offline"
    export_safetensors(root() / "ckpt", offline, dtype=bf16, max_shard_size="60KB")
    online = root() / "online"
    a, b = safetensors_of(online), safetensors_of(offline)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {p.name for p in online.glob("*.safetensors")} == {
        p.name for p in offline.glob("*.safetensors")
    }
    ra, rb = read_export_record(online), read_export_record(offline)
    assert (ra.kept, ra.casts, ra.bulk) == (rb.kept, rb.casts, rb.bulk)


CASES = [
    "case_exported_bf16_reloads_and_computes_as_trained",
    "case_offline_export_equals_the_online_one",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    os.environ["FSDP_PRECISION_EXPORT_ROOT"] = str(tmp_path_factory.mktemp("export"))
    return run_cases(2, __name__, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_two_ranks(results: dict[str, str], case: str) -> None:
    check(results[case])


@pytest.mark.fast
@requires_export
def test_weights_files_are_readable_as_the_umask_says(tmp_path: Path) -> None:
    export_safetensors(nn.Linear(2, 2), tmp_path / "out")
    config_mode = (tmp_path / "out" / EXPORT_RECORD).stat().st_mode & 0o777  # made by open()
    weights_mode = (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777
    assert weights_mode == config_mode  # safetensors alone makes them 0600


@pytest.mark.fast
def test_rules_and_policies_load_with_weights_only_and_the_allow_list(tmp_path: Path) -> None:
    """What the Trainer and Lightning pickle (rules, a model_policy with boundary casts) loads
    under ``torch.load``'s default ``weights_only=True`` given ``SAFE_GLOBALS``, and only so."""
    import pickle

    from fsdp_precision import ParamDtypeMixedPrecisionPolicy
    from fsdp_precision.checkpoint import SAFE_GLOBALS

    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    rules = PrecisionRules(param_dtype=bf16, rules=(Glob("1.*"),), advice="off")
    torch.save({"rules": rules, "policy": model_policy(model, rules)}, tmp_path / "h.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"Unsupported global: .*fsdp_precision"):
        torch.load(tmp_path / "h.pt")  # the negative control: refused without the list
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        loaded = torch.load(tmp_path / "h.pt")
    assert loaded["rules"] == rules
    assert type(loaded["policy"]) is ParamDtypeMixedPrecisionPolicy
    assert dict(loaded["policy"].param_dtype_map) == {"1.weight": fp32, "1.bias": fp32}
    assert set(loaded["policy"].module_casts) == {"1"}


@pytest.mark.fast
def test_rules_pickled_under_their_former_path_still_load(tmp_path: Path) -> None:
    """``data/rules_0_1.pt`` was saved before the rules moved below the advisor (its pickle names
    ``fsdp_precision._plan.rules``): it loads under ``weights_only=True`` with ``SAFE_GLOBALS``
    and under a plain pickle, as the rules it held."""
    import pickle

    from fsdp_precision.checkpoint import SAFE_GLOBALS

    old = Path(__file__).parent / "data" / "rules_0_1.pt"
    expected = PrecisionRules(
        param_dtype=bf16,
        rules=(Glob("*.mlp.gate.weight"), Glob("*norm.weight", boundary="inputs")),
        advice="off",
    )
    with pytest.raises(pickle.UnpicklingError, match=r"fsdp_precision\._plan\.rules"):
        torch.load(old)  # the negative control: the old path is refused without the list
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        assert torch.load(old)["rules"] == expected
    assert torch.load(old, weights_only=False)["rules"] == expected
