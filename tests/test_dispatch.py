"""Version dispatch and the source-hash guard (no process group needed)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fully_shard

import fsdp_precision as fp
from fsdp_precision import PatchIntegrityError, UnsupportedTorchError
from fsdp_precision._patch import (
    SUPPORTED_RELEASES,
    _release_module,
    torch_release,
    v2_11,
    v2_12,
    v2_13,
    v2_14,
    v2_15,
)
from fsdp_precision._patch._sources import resolve, source_sha256, verify_sources
from fsdp_precision._patch._targets import REPLACED, TARGETS, targets

RELEASE_MODULES = [v2_11, v2_12, v2_13, v2_14, v2_15]
SUPPORTED = r"2\.11, 2\.12, 2\.13, 2\.14, 2\.15"  # what the error must name, in order


@pytest.fixture
def restore_patch_state() -> Iterator[pytest.MonkeyPatch]:
    """A monkeypatch undone *before* the patch state is restored (so a patched
    ``torch.__version__`` or tampered function is gone by then)."""
    was = fp.is_param_dtype_map_patch_applied()
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield monkeypatch
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


@pytest.mark.parametrize("version", ["2.9.1", "2.10.0+cu126", "2.16.0", "2.16.0a0+git1", "3.0.0"])
def test_unsupported_release_is_refused_and_nothing_patched(
    version: str, restore_patch_state: pytest.MonkeyPatch
) -> None:
    monkeypatch = restore_patch_state
    fp.remove_param_dtype_map_patch()
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(
        UnsupportedTorchError,
        match=rf"torch {re.escape(version)} .*supported releases: {SUPPORTED}\.",
    ):
        fp.apply_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()


def test_supported_release_module_matches_installed_sources(
    restore_patch_state: pytest.MonkeyPatch,
) -> None:
    fp.remove_param_dtype_map_patch()  # hash torch's functions, not the installed replacements
    module = _release_module()
    assert list(module.SOURCES) == list(targets(module.IMPLEMENTATION))
    for target, sha in module.SOURCES.items():
        assert source_sha256(resolve(target)) == sha, target


def test_every_supported_release_has_a_module() -> None:
    assert SUPPORTED_RELEASES == {
        m.TORCH_RELEASE: m.__name__.rsplit(".", 1)[1] for m in RELEASE_MODULES
    }


@pytest.mark.parametrize("module", RELEASE_MODULES, ids=lambda m: m.TORCH_RELEASE)
def test_every_release_module_hashes_every_target(module: object) -> None:
    sources = module.SOURCES  # type: ignore[attr-defined]
    implementation = module.IMPLEMENTATION  # type: ignore[attr-defined]
    assert implementation in TARGETS
    assert list(sources) == list(targets(implementation))
    assert all(re.fullmatch(r"[0-9a-f]{64}", sha) for sha in sources.values())


def test_unknown_implementation_has_no_targets() -> None:
    with pytest.raises(ValueError, match=r"no target list for implementation '_impl_v9_9'"):
        targets("_impl_v9_9")


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
    owner: type, name: str, target: str, restore_patch_state: pytest.MonkeyPatch
) -> None:
    monkeypatch = restore_patch_state
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


def test_apply_is_idempotent_and_remove_restores_originals(
    restore_patch_state: pytest.MonkeyPatch,
) -> None:
    fp.remove_param_dtype_map_patch()
    group_cls = _fsdp_param_group.FSDPParamGroup
    watched = (
        (_fully_shard, "_init_param_group"),  # wrapped on every release
        (group_cls, "_init_mp_dtypes"),  # replaced on 2.11-2.14; torch's own on 2.15
        (_fsdp_param_group, "foreach_reduce"),  # likewise
    )
    before = [owner.__dict__[name] for owner, name in watched]
    fp.apply_param_dtype_map_patch()
    fp.apply_param_dtype_map_patch()
    assert fp.is_param_dtype_map_patch_applied()
    after = [owner.__dict__[name] for owner, name in watched]
    assert after[0] is not before[0]
    # 2.15 replaces nothing of FSDP's precision machinery (its native override is used).
    native = torch_release() == "2.15"
    assert [a is b for a, b in zip(after[1:], before[1:])] == [native, native]
    fp.remove_param_dtype_map_patch()
    fp.remove_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()
    assert [owner.__dict__[name] for owner, name in watched] == before
