"""Version dispatch and the source-hash guard (no process group needed)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

import fsdp_precision as fp
from fsdp_precision import PatchIntegrityError, UnsupportedTorchError
from fsdp_precision._patch import _release_module, torch_release, v2_13, v2_14
from fsdp_precision._patch._sources import resolve, source_sha256, verify_sources
from fsdp_precision._patch._targets import RELIED_ON, REPLACED


@pytest.fixture
def restore_patch_state() -> Iterator[None]:
    was = fp.is_param_dtype_map_patch_applied()
    yield
    if was:
        fp.apply_param_dtype_map_patch()
    else:
        fp.remove_param_dtype_map_patch()


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.13.0", "2.13"),
        ("2.13.0+cpu", "2.13"),
        ("2.14.1+cu130", "2.14"),
        ("2.15.0a0+git1", "2.15"),
    ],
)
def test_release_ignores_build_suffix(version: str, release: str) -> None:
    assert torch_release(version) == release


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu126", "2.12.1", "2.15.0", "3.0.0"])
def test_unsupported_release_is_refused_and_nothing_patched(
    version: str, monkeypatch: pytest.MonkeyPatch, restore_patch_state: None
) -> None:
    fp.remove_param_dtype_map_patch()
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(UnsupportedTorchError, match=r"supported releases: 2\.13, 2\.14"):
        fp.apply_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()


def test_supported_release_module_matches_installed_sources() -> None:
    module = _release_module()
    assert set(module.SOURCES) == set(REPLACED + RELIED_ON)
    for target, sha in module.SOURCES.items():
        assert source_sha256(resolve(target)) == sha, target


@pytest.mark.parametrize("module", [v2_13, v2_14], ids=["2.13", "2.14"])
def test_every_release_module_hashes_every_target(module: object) -> None:
    sources = module.SOURCES  # type: ignore[attr-defined]
    assert set(sources) == set(REPLACED + RELIED_ON)
    assert all(len(sha) == 64 for sha in sources.values())


def test_import_touches_no_release_module() -> None:
    code = (
        "import sys, fsdp_precision;"
        "print(sorted(m for m in sys.modules if m.startswith('fsdp_precision._patch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['fsdp_precision._patch._sources']"


def _changed_init_dtype_attrs(self, mp_policy):  # a "new upstream release" of the function
    self.param_dtype = mp_policy.param_dtype
    self.reduce_dtype = mp_policy.reduce_dtype
    self.orig_dtype = self.sharded_param.dtype


@pytest.mark.parametrize(
    ("owner", "name", "target"),
    [
        (_fsdp_param.FSDPParam, "init_dtype_attrs", "FSDPParam.init_dtype_attrs"),  # relied on
        (_fsdp_param_group.FSDPParamGroup, "_init_mp_dtypes", "FSDPParamGroup._init_mp_dtypes"),
    ],
)
def test_tampered_source_is_refused(
    owner: type, name: str, target: str, monkeypatch: pytest.MonkeyPatch, restore_patch_state: None
) -> None:
    fp.remove_param_dtype_map_patch()
    original_init_mp = _fsdp_param_group.FSDPParamGroup.__dict__["_init_mp_dtypes"]
    monkeypatch.setattr(owner, name, _changed_init_dtype_attrs)
    with pytest.raises(PatchIntegrityError, match=rf"{target} differs from the source"):
        fp.apply_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()
    if name != "_init_mp_dtypes":
        assert _fsdp_param_group.FSDPParamGroup.__dict__["_init_mp_dtypes"] is original_init_mp


def test_wrong_recorded_hash_names_function_and_version() -> None:
    target = REPLACED[0]
    with pytest.raises(
        PatchIntegrityError, match=r"refuses to patch torch 9\.9: .*_init_param_group"
    ):
        verify_sources({target: "0" * 64}, torch_version="9.9")
    with pytest.raises(PatchIntegrityError, match=r"cannot find .*no_such_function"):
        verify_sources({REPLACED[0] + "_no_such_function": "0" * 64}, torch_version="9.9")


def test_apply_is_idempotent_and_remove_restores_originals(restore_patch_state: None) -> None:
    fp.remove_param_dtype_map_patch()
    group_cls = _fsdp_param_group.FSDPParamGroup
    before = (group_cls.__dict__["_init_mp_dtypes"], _fsdp_param_group.foreach_reduce)
    fp.apply_param_dtype_map_patch()
    fp.apply_param_dtype_map_patch()
    assert fp.is_param_dtype_map_patch_applied()
    assert group_cls.__dict__["_init_mp_dtypes"] is not before[0]
    fp.remove_param_dtype_map_patch()
    fp.remove_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()
    assert (group_cls.__dict__["_init_mp_dtypes"], _fsdp_param_group.foreach_reduce) == before
