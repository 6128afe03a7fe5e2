"""Checkpoints: bitwise round trips with mixed storage dtypes in one unit, resharding across world
sizes and meshes, optimizer resume, atomic saves under SIGKILL, errors, safetensors export.

A 2-rank group saves into a temporary directory (passed to the other groups through the
test-only environment variable ``CKPT_ROOT_ENV``); a 4-rank HSDP 2x2 group, a 1-rank group and a
3-rank group load what it saved. Every case runs on every rank of its group; see ``_harness``.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_precision.checkpoint import (
    METADATA_FILE,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    StateDictMismatchError,
    export_safetensors,
    load_checkpoint,
    load_model_state_dict,
    model_state_dict,
    read_checkpoint_metadata,
    save_checkpoint,
)

from tests.patch.test_parity import wrap_mapped
from tests.support.harness import check, run_cases
from tests.support.models import bf16, fp32, inputs, loss_of, mixed_storage_net, net

#: Test-only: where the saving group writes and the loading groups read. Never read by the library.
CKPT_ROOT_ENV = "FSDP_PRECISION_TEST_CKPT_ROOT"
fp64 = torch.float64


def root() -> Path:
    return Path(os.environ[CKPT_ROOT_ENV])


STORAGE_DTYPES = {bf16, fp32}


def mixed(seed: int = 0) -> nn.Module:
    """Stored in bf16, with norms and routers stored in fp32 inside the same units."""
    return mixed_storage_net(seed=seed)


def wrap(model: nn.Module, mesh: Any = None) -> nn.Module:
    """One unit per block and the root, fp32 kept by FQN map (as test_parity does); with
    param_dtype=None every parameter computes in its own storage dtype."""
    return wrap_mapped(model, param_dtype=None, mesh=mesh)


def make(seed: int = 0, mesh: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = wrap(mixed(seed), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def hsdp_mesh() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def forward(model: nn.Module, step: int) -> torch.Tensor:
    return model(inputs(step).to(bf16))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        loss_of(forward(model, step)).backward()
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Consolidated model and optimizer state on rank 0 ({} elsewhere)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd} if dist.get_rank() == 0 else {}


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists equal; tensors bitwise, dtypes and types (DTensor or not) included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert type(a) is type(b), (where, type(a), type(b))
        assert a.dtype == b.dtype, (where, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def expect_saved(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The consolidated state after a load equals what the saving group recorded."""
    got = full_state(model, opt)
    if dist.get_rank() == 0:
        assert_bitwise(torch.load(root() / f"{name}.expected.pt"), got, name)


def record(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(state, root() / f"{name}.expected.pt")
    dist.barrier()  # no rank looks at the directory before rank 0 has written the file


def fresh_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model_state_dict(model, "full").items()}


# --------------------------------------------------------------------------- 2 ranks


def case_state_dicts_keep_mixed_dtypes() -> None:
    base = mixed(0)
    reference = base.state_dict()
    model = wrap(copy.deepcopy(base))
    full = model_state_dict(model, "full")
    if dist.get_rank() == 0:
        assert_bitwise(dict(reference), full)
        assert {v.dtype for v in full.values()} == STORAGE_DTYPES
        assert all(v.device.type == "cpu" for v in full.values())
    else:
        assert full == {}  # "full" is consolidated on rank 0 only
    sharded = model_state_dict(model, "sharded")
    assert set(sharded) == set(reference)
    for key, value in sharded.items():
        assert isinstance(value, DTensor), key
        assert_bitwise(reference[key], value.full_tensor(), key)


def case_load_model_state_dict_full_and_sharded() -> None:
    source = wrap(mixed(0))
    full = model_state_dict(source, "full")
    target = wrap(mixed(1))
    load_model_state_dict(target, full if dist.get_rank() == 0 else {}, "full")
    assert_bitwise(full, model_state_dict(target, "full"))
    other = wrap(mixed(2))
    load_model_state_dict(other, model_state_dict(source, "sharded"), "sharded")
    assert_bitwise(full, model_state_dict(other, "full"))
    # Both keep training identically.
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (source, target, other)]
    for model, opt in zip((source, target, other), optims):
        train(model, opt, range(2))
    assert_bitwise(model_state_dict(source, "full"), model_state_dict(target, "full"))
    assert_bitwise(model_state_dict(source, "full"), model_state_dict(other, "full"))


def case_load_casts_dtype_in_a_copy() -> None:
    source = wrap(mixed(0))
    full = model_state_dict(source, "full")
    wide = {k: v.to(fp64) for k, v in full.items()}  # every value exactly representable
    before = {k: v.clone() for k, v in wide.items()}
    target = wrap(mixed(1))
    load_model_state_dict(target, wide, "full")
    assert_bitwise(full, model_state_dict(target, "full"))  # destination dtypes kept
    assert_bitwise(before, wide)  # the caller's dict untouched
    sharded = {k: v.to(fp64) for k, v in model_state_dict(source, "sharded").items()}
    other = wrap(mixed(2))
    load_model_state_dict(other, sharded, "sharded")
    assert_bitwise(full, model_state_dict(other, "full"))
    for key, value in sharded.items():
        assert value.dtype == fp64, key


MISMATCH = (
    r"state_dict does not match the model: 1 missing key\(s\): \['blocks\.0\.up\.bias'\]; "
    r"1 unexpected key\(s\): \['extra\.weight'\]; 1 shape mismatch\(es\): 'head\.weight' "
    r"incoming \(16, 8\) vs model \(16, 16\)\. Nothing was loaded"
)


def case_mismatched_keys_and_shapes_listed_before_loading() -> None:
    model = wrap(mixed(0))
    before = fresh_dict(model)
    bad = model_state_dict(wrap(mixed(1)), "full")
    if dist.get_rank() == 0:
        del bad["blocks.0.up.bias"]
        bad["extra.weight"] = torch.zeros(3)
        bad["head.weight"] = torch.zeros(16, 8, dtype=bf16)
    with pytest.raises(StateDictMismatchError, match=MISMATCH) as info:
        load_model_state_dict(model, bad, "full")
    assert info.value.missing == ["blocks.0.up.bias"]
    assert info.value.shape_mismatches == [("head.weight", (16, 8), (16, 16))]
    assert_bitwise(before, fresh_dict(model))
    sharded = model_state_dict(wrap(mixed(1)), "sharded")
    del sharded["blocks.0.up.bias"]
    with pytest.raises(StateDictMismatchError, match=r"1 missing key\(s\): \['blocks\.0\.up"):
        load_model_state_dict(model, sharded, "sharded")
    assert_bitwise(before, fresh_dict(model))


def case_state_dict_type_errors() -> None:
    model = wrap(mixed(0))
    with pytest.raises(
        CheckpointError,
        match=r"state_dict_type='fulll' is not a state dict type; pass state_dict_type='full'",
    ):
        model_state_dict(model, "fulll")  # type: ignore[arg-type]
    sharded = model_state_dict(model, "sharded")
    with pytest.raises(
        CheckpointError,
        match=r"state_dict_type='full' got DTensor shards .* pass state_dict_type='sharded'",
    ):
        load_model_state_dict(model, sharded, "full")
    full = model_state_dict(model, "full")
    with pytest.raises(
        CheckpointError,
        match=r"state_dict_type='sharded' got plain tensors .* this is a full state dict; "
        r"pass state_dict_type='full'",
    ):
        load_model_state_dict(model, full, "sharded")  # rank 0's error, raised on every rank
    with pytest.raises(CheckpointError, match=r"state_dict is a list, not a mapping"):
        load_model_state_dict(model, [], "sharded")  # type: ignore[arg-type]


def case_save_for_other_worlds() -> None:
    model, opt = make(0)
    train(model, opt, range(2))
    for kind in ("sharded", "full"):
        path = save_checkpoint(root() / kind, model, opt, state_dict_type=kind, step=2)
        assert path == (root() / kind).absolute()
    save_checkpoint(root() / "model_only", model, step=2)
    record("two_ranks", model, opt)
    meta = read_checkpoint_metadata(root() / "sharded")
    assert meta["step"] == 2 and meta["world_size"] == 2 and meta["state_dict_type"] == "sharded"
    assert meta["torch_version"] == torch.__version__ and meta["fsdp_precision_version"]
    assert read_checkpoint_metadata(root() / "full")["state_dict_type"] == "full"
    assert sorted(p.name for p in root().iterdir() if ".tmp-" in p.name or ".old-" in p.name) == []


def case_roundtrip_same_world() -> None:
    for kind in ("sharded", "full"):
        model, opt = make(5)
        meta = load_checkpoint(root() / kind, model, opt)
        assert meta["step"] == 2 and meta["state_dict_type"] == kind
        expect_saved("two_ranks", model, opt)


def case_resume_is_bitwise() -> None:
    """Save after 2 of 5 steps, load into fresh objects, finish: equal to an uninterrupted run."""
    whole, whole_opt = make(0)
    train(whole, whole_opt, range(5))
    for kind in ("sharded", "full"):
        first, first_opt = make(0)
        train(first, first_opt, range(2))
        save_checkpoint(root() / f"resume_{kind}", first, first_opt, state_dict_type=kind, step=2)
        resumed, resumed_opt = make(9)
        meta = load_checkpoint(root() / f"resume_{kind}", resumed, resumed_opt)
        train(resumed, resumed_opt, range(meta["step"], 5))
        got, want = full_state(resumed, resumed_opt), full_state(whole, whole_opt)
        assert_bitwise(want, got, kind)
        out = [forward(m, 99) for m in (whole, resumed)]
        assert torch.equal(out[0], out[1])


def case_overwrite_keeps_one_checkpoint() -> None:
    model, opt = make(0)
    for step in (1, 2):
        train(model, opt, range(step - 1, step))
        save_checkpoint(root() / "overwrite", model, opt, step=step)
    record("overwrite", model, opt)
    assert read_checkpoint_metadata(root() / "overwrite")["step"] == 2
    siblings = [p.name for p in root().iterdir() if p.name.startswith("overwrite.")]
    assert siblings == ["overwrite.expected.pt"], siblings  # no .tmp-/.old- directory left
    fresh, fresh_opt = make(3)
    load_checkpoint(root() / "overwrite", fresh, fresh_opt)
    expect_saved("overwrite", fresh, fresh_opt)


def case_checkpoint_errors() -> None:
    model, opt = make(0)
    before = fresh_dict(model)
    missing = root() / "nowhere"
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint directory '{missing}' does not exist .* pass the directory given to "
        r"save_checkpoint\(\)",
    ):
        load_checkpoint(missing, model)
    empty = root() / "not_a_checkpoint"
    if dist.get_rank() == 0:
        empty.mkdir(exist_ok=True)
    dist.barrier()
    with pytest.raises(
        CheckpointError, match=r"is not a complete fsdp_precision checkpoint \(no fsdp_precision"
    ):
        load_checkpoint(empty, model)
    with pytest.raises(
        CheckpointError,
        match=r"is a 'sharded' checkpoint, but state_dict_type='full' was requested; pass "
        r"state_dict_type='sharded' \(or None to accept either\)",
    ):
        load_checkpoint(root() / "sharded", model, state_dict_type="full")
    with pytest.raises(CheckpointError, match=r"is a 'full' checkpoint, but .*='sharded'"):
        load_checkpoint(root() / "full", model, state_dict_type="sharded")
    with pytest.raises(CheckpointError, match=r"has no optimizer state, but an optimizer"):
        load_checkpoint(root() / "model_only", model, opt)
    with pytest.raises(CheckpointError, match=r"state_dict_type='both' is not a state dict type"):
        save_checkpoint(root() / "x", model, state_dict_type="both")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"state_dict_type='shard' is not a state dict"):
        load_checkpoint(root() / "sharded", model, state_dict_type="shard")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"step='3' is not an int; pass the training step"):
        save_checkpoint(root() / "x", model, step="3")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"export_safetensors source is a int; pass an"):
        export_safetensors(3, root() / "x")  # type: ignore[arg-type]
    wider = wrap_mapped(net(0, hidden=32), param_dtype=None)
    with pytest.raises(
        StateDictMismatchError,
        match=r"checkpoint '.*sharded' does not match the model: 6 shape mismatch\(es\): "
        r"'blocks\.0\.down\.weight' incoming \(16, 24\) vs model \(16, 32\)",
    ):
        load_checkpoint(root() / "sharded", wider)
    assert_bitwise(before, fresh_dict(model))
    assert not (root() / "x").exists()


def case_hf_llama_exports_to_from_pretrained() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    model = copy.deepcopy(original)
    from torch.distributed.fsdp import fully_shard

    from fsdp_precision import ParamDtypeMixedPrecisionPolicy

    for layer in model.model.layers:
        keep = {n: fp32 for n, _ in layer.named_parameters() if "norm" in n}
        policy = ParamDtypeMixedPrecisionPolicy(
            param_dtype=bf16, reduce_dtype=fp32, param_dtype_map=keep
        )
        fully_shard(layer, mp_policy=policy)
    fully_shard(model)
    out = root() / "hf_export"
    weights = export_safetensors(model, out)
    save_checkpoint(root() / "hf_ckpt", model, state_dict_type="full")
    if dist.get_rank() == 0:
        from_dir = export_safetensors(root() / "hf_ckpt", root() / "hf_from_ckpt")
        ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = original(ids).logits
            for path in (weights, from_dir):
                assert (path.parent / "config.json").is_file(), path
                reloaded = transformers.LlamaForCausalLM.from_pretrained(
                    path.parent, dtype=torch.float32
                ).eval()
                assert_bitwise(dict(original.state_dict()), dict(reloaded.state_dict()), str(path))
                assert torch.equal(want, reloaded(ids).logits), path


# --------------------------------------------------------------------------- other worlds


def case_hsdp_loads_two_rank_checkpoints() -> None:
    mesh = hsdp_mesh()
    for kind in ("sharded", "full"):
        model, opt = make(4, mesh)
        load_checkpoint(root() / kind, model, opt)
        expect_saved("two_ranks", model, opt)
    train(model, opt, range(2, 3))
    save_checkpoint(root() / "hsdp", model, opt, step=3)
    record("hsdp", model, opt)
    assert read_checkpoint_metadata(root() / "hsdp")["world_size"] == 4


def case_load_at_another_world_size() -> None:
    for kind in ("sharded", "full", "hsdp"):
        model, opt = make(6)
        meta = load_checkpoint(root() / kind, model, opt)
        expect_saved("hsdp" if kind == "hsdp" else "two_ranks", model, opt)
        # Training continues from the loaded state on this world size.
        train(model, opt, range(meta["step"], meta["step"] + 1))


SAVE_CASES = [
    "case_state_dicts_keep_mixed_dtypes",
    "case_load_model_state_dict_full_and_sharded",
    "case_load_casts_dtype_in_a_copy",
    "case_mismatched_keys_and_shapes_listed_before_loading",
    "case_state_dict_type_errors",
    "case_save_for_other_worlds",
    "case_roundtrip_same_world",
    "case_resume_is_bitwise",
    "case_overwrite_keeps_one_checkpoint",
    "case_checkpoint_errors",
    "case_hf_llama_exports_to_from_pretrained",
]
GROUPS = {  # world size -> cases, run in this order (later groups read earlier groups' saves)
    2: SAVE_CASES,
    4: ["case_hsdp_loads_two_rank_checkpoints"],
    1: ["case_load_at_another_world_size"],
    3: ["case_load_at_another_world_size"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    directory = tmp_path_factory.mktemp("ckpt")
    os.environ[CKPT_ROOT_ENV] = str(directory)  # inherited by the spawned ranks
    try:
        return {world: run_cases(world, __name__, cases) for world, cases in GROUPS.items()}
    finally:
        os.environ.pop(CKPT_ROOT_ENV, None)


@pytest.mark.distributed
@pytest.mark.parametrize("case", SAVE_CASES)
def test_two_ranks(results: dict[int, dict[str, str]], case: str) -> None:
    check(results[2][case])


@pytest.mark.distributed
def test_hsdp_2x2_loads_and_saves(results: dict[int, dict[str, str]]) -> None:
    check(results[4]["case_hsdp_loads_two_rank_checkpoints"])


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 3])
def test_load_at_world_size(results: dict[int, dict[str, str]], world: int) -> None:
    check(results[world]["case_load_at_another_world_size"])


# --------------------------------------------------------------------------- SIGKILL mid-save

KILL_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "ckpt_kill.py"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    # In subprocesses: the pytest process itself never applies the patch (test_dispatch relies on it).
    return subprocess.run(
        [sys.executable, str(KILL_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.parametrize(
    ("point", "survivor"),
    [
        ("mid_write", 1),
        # the previous checkpoint survives here too (mid_write covers that outcome by default)
        pytest.param("before_metadata", 1, marks=pytest.mark.slow),
        ("between_renames", 2),
    ],
)
def test_killed_save_leaves_a_loadable_checkpoint(
    tmp_path: Path, point: str, survivor: int
) -> None:
    """A save SIGKILLed at ``point`` leaves the previous (step 1) or the new (step 2) checkpoint,
    complete and bitwise equal to what was saved; the next save cleans up."""
    proc = run_script(str(tmp_path), point)
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)
    target = tmp_path / "ckpt"
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt."))
    assert leftovers, "the kill left nothing behind: the hook fired too late"
    if point == "between_renames":
        assert not target.exists()
    else:
        assert (target / METADATA_FILE).is_file()
        assert not any((tmp_path / n / METADATA_FILE).exists() for n in leftovers)
    check = run_script(str(tmp_path), "verify", str(survivor))
    assert check.returncode == 0 and "verified" in check.stdout, (check.stdout, check.stderr)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]
    assert read_checkpoint_metadata(target)["step"] == survivor + 10


def test_export_without_safetensors_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail as if the package were absent; nothing
    # is written before the error.
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(CheckpointError, match=r"needs the safetensors package.*pip install"):
        export_safetensors(nn.Linear(2, 2), tmp_path / "export")
    assert not (tmp_path / "export").exists()


# --------------------------------------------------------------------------- errors, one process
# A plain module in this process (no process group): DCP saves and loads it as one process, so
# every filesystem failure is cheap to provoke. The pytest process never applies the patch.

single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def linear(seed: int = 0, out_features: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, out_features)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A complete sharded checkpoint at step 1 (model and optimizer), loaded back once."""
    model, opt = linear()
    path = save_checkpoint(tmp_path / "ck", model, opt, step=1)
    assert load_checkpoint(path, *linear(1))["step"] == 1
    return path


def write(path: Path, text: str) -> None:
    path.write_text(text)


def remove_first(path: Path, suffix: str) -> None:
    next(p for p in path.iterdir() if p.name.endswith(suffix)).unlink()


def export(source: nn.Module | Path, out: Path) -> None:
    pytest.importorskip("safetensors")
    export_safetensors(source, out)


def save_over(path: Path) -> None:
    save_checkpoint(path, *linear(), step=2)


def save_below_file(path: Path) -> None:
    save_checkpoint(path / METADATA_FILE / "ck", *linear(), step=2)


# (name, damage done to the saved checkpoint, the failing call, error type, its cause, message)
LOCAL_ERRORS: list[tuple[str, Any, Any, type[Exception], type[BaseException] | None, str]] = [
    (
        "save below a regular file",
        None,
        save_below_file,
        CheckpointWriteError,
        FileExistsError,
        r"cannot create '.*ck/fsdp_precision_checkpoint\.json', the parent of checkpoint "
        r"'.*/ck': \[Errno 17\] File exists: .*; pass a directory whose parent is \(or can "
        r"be made\) a writable directory",
    ),
    (
        "save over a directory that is not a checkpoint",
        lambda p: (p / METADATA_FILE).unlink(),
        save_over,
        CheckpointWriteError,
        None,
        r"'.*/ck' exists and is not an fsdp_precision checkpoint \(a non-empty directory without "
        r"fsdp_precision_checkpoint\.json\); save_checkpoint replaces the directory it is given "
        r"and will not delete one it did not write: pass a new or empty directory, or remove",
    ),
    (
        "load a missing directory",
        lambda p: shutil.rmtree(p),
        lambda p: load_checkpoint(p, linear()[0]),
        CheckpointNotFoundError,
        None,
        r"checkpoint directory '.*/ck' does not exist \(and no complete copy left by an "
        r"interrupted save is next to it\); pass the directory given to save_checkpoint\(\)",
    ),
    (
        "load a directory without metadata",
        lambda p: (p / METADATA_FILE).unlink(),
        lambda p: load_checkpoint(p, linear()[0]),
        CheckpointNotFoundError,
        None,
        r"checkpoint directory '.*/ck' is not a complete fsdp_precision checkpoint \(no "
        r"fsdp_precision_checkpoint\.json\); pass a directory written by save_checkpoint\(\), "
        r"or check that its save finished",
    ),
    (
        "metadata of a file",
        None,
        lambda p: read_checkpoint_metadata(p / METADATA_FILE),
        CheckpointNotFoundError,
        None,
        r"checkpoint directory '.*/ck/fsdp_precision_checkpoint\.json' is a file, not a "
        r"directory; pass the directory given to save_checkpoint\(\)",
    ),
    (
        "load corrupt metadata",
        lambda p: write(p / METADATA_FILE, '{"format": '),
        lambda p: load_checkpoint(p, linear()[0]),
        CheckpointReadError,
        json.JSONDecodeError,
        r"cannot read '.*/ck/fsdp_precision_checkpoint\.json': Expecting value: line 1 column 12 "
        r"\(char 11\); the checkpoint's metadata is damaged: load an earlier checkpoint, or save",
    ),
    (
        "load metadata nested past the recursion limit (hostile)",
        lambda p: write(p / METADATA_FILE, "[" * 100_000 + "]" * 100_000),
        lambda p: load_checkpoint(p, linear()[0]),
        CheckpointReadError,
        RecursionError,
        r"cannot read '.*/ck/fsdp_precision_checkpoint\.json': maximum recursion depth exceeded"
        r".*; the checkpoint's metadata is damaged: load an earlier checkpoint, or save",
    ),
    (
        "load foreign metadata",
        lambda p: write(p / METADATA_FILE, '{"format": "other"}'),
        lambda p: read_checkpoint_metadata(p),
        CheckpointReadError,
        None,
        r"'.*/ck/fsdp_precision_checkpoint\.json' has format 'other', not "
        r"'fsdp_precision\.checkpoint'; pass a directory written by save_checkpoint\(\)",
    ),
    (
        "load metadata without fields",
        lambda p: write(p / METADATA_FILE, '{"format": "fsdp_precision.checkpoint"}'),
        lambda p: load_checkpoint(p, linear()[0]),
        CheckpointReadError,
        None,
        r"'.*/ck/fsdp_precision_checkpoint\.json' lacks the field\(s\) \['state_dict_type', "
        r"'step', 'world_size', 'has_optimizer'\]; the checkpoint's metadata is damaged",
    ),
    (
        "load without DCP's metadata",
        lambda p: (p / ".metadata").unlink(),
        lambda p: load_checkpoint(p, linear()[0]),
        CheckpointReadError,
        FileNotFoundError,
        r"cannot read the DCP metadata '.*/ck/\.metadata' \(FileNotFoundError\(2, 'No such "
        r"file or directory'\)\); the checkpoint is damaged or was not written by "
        r"torch\.distributed\.checkpoint",
    ),
    (
        "load without a data file",
        lambda p: remove_first(p, ".distcp"),
        lambda p: load_checkpoint(p, *linear(1)),
        CheckpointReadError,
        None,  # found before anything is loaded, by reading the metadata's file list
        r"checkpoint '.*/ck' lacks its data file '__0_0\.distcp'; nothing was loaded: load an "
        r"earlier checkpoint, or copy the whole directory again",
    ),
    (
        "load another shape",
        None,
        lambda p: load_checkpoint(p, linear(out_features=4)[0]),
        StateDictMismatchError,
        None,
        r"checkpoint '.*/ck' does not match the model: 2 shape mismatch\(es\): 'bias' incoming "
        r"\(2,\) vs model \(4,\), 'weight' incoming \(2, 3\) vs model \(4, 3\)\. Nothing was",
    ),
    (
        "export below a regular file",
        None,
        lambda p: export(linear()[0], p / METADATA_FILE / "out"),
        CheckpointWriteError,
        FileExistsError,
        r"cannot create '.*/ck/fsdp_precision_checkpoint\.json', the parent of export "
        r"'.*/ck/fsdp_precision_checkpoint\.json/out': \[Errno 17\] File exists: .*; pass a "
        r"directory whose parent is \(or can be made\) a writable directory",
    ),
    (
        "export without a data file",
        lambda p: remove_first(p, ".distcp"),
        lambda p: export(p, p.parent / "out"),
        CheckpointReadError,
        None,
        r"checkpoint '.*/ck' lacks its data file '__0_0\.distcp'; nothing was loaded",
    ),
]


@single_process
@pytest.mark.parametrize(
    ("damage", "call", "error", "cause", "message"),
    [case[1:] for case in LOCAL_ERRORS],
    ids=[case[0] for case in LOCAL_ERRORS],
)
def test_checkpoint_error_names_path_and_fix(
    saved: Path,
    damage: Any,
    call: Any,
    error: type[Exception],
    cause: type[BaseException] | None,
    message: str,
) -> None:
    if damage is not None:
        damage(saved)
    with pytest.raises(error, match=message) as info:
        call(saved)
    assert isinstance(info.value, CheckpointError)
    if error is CheckpointWriteError:
        assert isinstance(info.value, OSError)  # what saves raised before: `except OSError` holds
    if cause is None:
        assert info.value.__cause__ is None
    else:
        assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)


@single_process
def test_save_over_foreign_directory_keeps_its_files(saved: Path) -> None:
    (saved / METADATA_FILE).unlink()
    before = sorted(p.name for p in saved.iterdir())
    with pytest.raises(CheckpointWriteError, match="is not an fsdp_precision checkpoint"):
        save_over(saved)
    assert sorted(p.name for p in saved.iterdir()) == before
    # Negative control: an empty directory, or a checkpoint, is replaced.
    shutil.rmtree(saved)
    saved.mkdir()
    save_over(saved)
    save_over(saved)
    assert read_checkpoint_metadata(saved)["step"] == 2


@single_process
def test_failed_write_keeps_the_previous_checkpoint(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails inside DCP (a full disk) raises CheckpointWriteError naming the
    temporary directory, removes its own partial directory (a full disk does not stay full),
    and the previous checkpoint stays loadable."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(dcp_fs, "_write_item", full_disk)
        with pytest.raises(
            CheckpointWriteError,
            match=r"cannot write checkpoint '.*/ck\.tmp-[0-9a-f]{12}' \(rank 0: OSError\(28, 'No "
            r"space left on device'\)\); the previous checkpoint \(if any\) is unchanged: check "
            r"that the directory is writable and has free space, and save again",
        ) as info:
            save_over(saved)
    assert isinstance(info.value.__cause__, CheckpointException)
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]  # no ck.tmp-<id> left
    assert load_checkpoint(saved, *linear(1))["step"] == 1
    save_over(saved)  # the negative control: the same save, with a disk that works
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]
    assert load_checkpoint(saved, *linear(1))["step"] == 2
