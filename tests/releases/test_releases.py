"""Version dispatch and the source-hash guard (no process group needed)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fully_shard

import fsdp_precision as fp
from fsdp_precision import PatchIntegrityError, UnsupportedTorchError
from fsdp_precision._base.sources import lookup, source_sha256, verify_sources
from fsdp_precision._releases import (
    SUPPORTED_RELEASES,
    release_module,
    release_module_name,
    torch_release,
    v2_11,
    v2_12,
    v2_13,
    v2_14,
    v2_15,
)
from fsdp_precision._releases.traits import CONSTRUCTION_REPLACED, ReleaseTraits, hashed_functions

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
    module = release_module()
    assert list(module.SOURCES) == list(hashed_functions(module.TRAITS))
    for target, sha in module.SOURCES.items():
        assert source_sha256(lookup(target)) == sha, target


def test_every_supported_release_has_a_module() -> None:
    assert isinstance(SUPPORTED_RELEASES, tuple)  # immutable: public
    assert SUPPORTED_RELEASES == tuple(m.TORCH_RELEASE for m in RELEASE_MODULES)
    for module in RELEASE_MODULES:
        assert module.__name__.rsplit(".", 1)[1] == release_module_name(module.TORCH_RELEASE)


@pytest.mark.parametrize("module", RELEASE_MODULES, ids=lambda m: m.TORCH_RELEASE)
def test_every_release_module_hashes_every_target(module: object) -> None:
    sources = module.SOURCES  # type: ignore[attr-defined]
    traits = module.TRAITS  # type: ignore[attr-defined]
    assert isinstance(traits, ReleaseTraits)
    assert list(sources) == list(hashed_functions(traits))
    assert all(re.fullmatch(r"[0-9a-f]{64}", sha) for sha in sources.values())


# How many functions each release hashes: the targets computed from the traits must stay those
# the release modules were generated with (2.11 also hashes its compiled-autograd switch; 2.15
# hashes its native override, its mixed-dtype reduction, what its two replacements rely on, and
# the pre-backward call that defers the gradient upcast; 2.11-2.14 hash the partial-gradient
# function they replace, which 2.15 fixed itself).
HASHED = {"2.11": 31, "2.12": 30, "2.13": 30, "2.14": 30, "2.15": 34}


@pytest.mark.parametrize("module", RELEASE_MODULES, ids=lambda m: m.TORCH_RELEASE)
def test_targets_follow_the_traits(module: object) -> None:
    traits = module.TRAITS  # type: ignore[attr-defined]
    release = module.TORCH_RELEASE  # type: ignore[attr-defined]
    hashed = hashed_functions(traits)
    assert len(hashed) == HASHED[release]
    assert hashed[0] == CONSTRUCTION_REPLACED[0]
    compiled = any(t.endswith(":compiled_autograd_enabled") for t in hashed)
    assert compiled == traits.compiled_autograd_branches
    native = any(t.endswith(":MixedPrecisionPolicy._resolve_for_param") for t in hashed)
    assert native == traits.native_override
    lazy_init = any(t.endswith(":FSDPParamGroup.lazy_init") for t in hashed)
    assert lazy_init == traits.patches_precision
    # foreach_reduce is replaced (listed among the first four) unless the release reduces mixed
    # gradient dtypes itself; it is hashed either way.
    reduce_index = hashed.index(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce"
    )
    assert (reduce_index < 4) == (not traits.mixed_dtype_reduce)
    deferred = any(t.endswith(":FSDPParamGroup.pre_backward") for t in hashed)
    assert deferred == traits.defers_grad_upcast
    partial = any(t.endswith(":FSDPParam._get_grad_inner_tensor") for t in hashed)
    assert partial == (not traits.reduces_partial_grads)


# Every trait of every release, as docs/how-it-works.md tables them (the release modules name
# only where they differ from the defaults, so a changed default shows here).
TRAIT_TABLE = {
    # groups list, requires_grad, clamp, compiled, results, native, patches, mixed reduce, defers,
    # keeps grad_dtype, reduces partial grads, spmd meshes
    "2.11": (False, False, False, True, 6, False, True, False, False, False, False, False),
    "2.12": (True, True, True, False, 6, False, True, False, False, False, False, True),
    "2.13": (True, True, True, False, 7, False, True, False, False, False, False, True),
    "2.14": (True, True, True, False, 7, False, True, False, False, False, False, True),
    "2.15": (True, True, True, False, 7, True, True, True, True, True, True, True),
}


@pytest.mark.parametrize("module", RELEASE_MODULES, ids=lambda m: m.TORCH_RELEASE)
def test_release_traits_are_the_documented_ones(module: object) -> None:
    traits = module.TRAITS  # type: ignore[attr-defined]
    values = tuple(getattr(traits, f.name) for f in dataclasses.fields(traits))
    assert values == TRAIT_TABLE[module.TORCH_RELEASE]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"foreach_reduce_results": 8}, r"foreach_reduce_results is 8; .*6 values .* or 7"),
        ({"native_override": False, "patches_precision": False}, r"native_override or patches"),
        (
            {"foreach_reduce_results": 6},
            r"mixed_dtype_reduce \(2\.15\) needs foreach_reduce_results=7",
        ),
        (
            {"mixed_dtype_reduce": False},
            r"defers_grad_upcast \(2\.15\) needs mixed_dtype_reduce",
        ),
    ],
)
def test_inconsistent_traits_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(v2_15.TRAITS, **change)  # type: ignore[arg-type]


def test_import_touches_no_release_module_and_no_replacement() -> None:
    """Importing the package (and planning) loads no release module and no module of the patch
    that imports FSDP2 internals: those come only after the source hashes matched."""
    code = (
        "import sys, fsdp_precision;"
        "print(sorted(m for m in sys.modules if m.startswith(('fsdp_precision._patch.', "
        "'fsdp_precision._releases.v'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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
    with pytest.raises(PatchIntegrityError, match=rf"{target} \(sha256 .*unknown_torch="):
        fp.apply_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()
    if name != "_init_mp_dtypes":
        assert _fsdp_param_group.FSDPParamGroup.__dict__["_init_mp_dtypes"] is original_init_mp


def test_wrong_recorded_hash_names_function_and_version() -> None:
    target = CONSTRUCTION_REPLACED[0]
    with pytest.raises(
        PatchIntegrityError, match=r"refuses to patch torch 9\.9: .*_init_param_group"
    ):
        verify_sources({target: "0" * 64}, torch_version="9.9")
    with pytest.raises(
        PatchIntegrityError, match=r"no_such_function \(not found: AttributeError\).*unknown_torch"
    ):
        verify_sources({target + "_no_such_function": "0" * 64}, torch_version="9.9")


def test_apply_is_idempotent_and_remove_restores_originals(
    restore_patch_state: pytest.MonkeyPatch,
) -> None:
    fp.remove_param_dtype_map_patch()
    group_cls = _fsdp_param_group.FSDPParamGroup
    watched = (
        (_fully_shard, "_init_param_group"),  # wrapped on every release
        (group_cls, "_init_mp_dtypes"),  # replaced on every release
        (_fsdp_param_group, "foreach_reduce"),  # replaced on 2.11-2.14; wrapped on 2.15
    )
    before = [owner.__dict__[name] for owner, name in watched]
    fp.apply_param_dtype_map_patch()
    fp.apply_param_dtype_map_patch()
    assert fp.is_param_dtype_map_patch_applied()
    after = [owner.__dict__[name] for owner, name in watched]
    assert all(a is not b for a, b in zip(after, before, strict=True))
    # 2.15's own foreach_reduce reduces mixed gradient dtypes: there it is only wrapped, to
    # leave the 0-size gradients of mapped calls out (Miles' semantics), and still called.
    wrapped = after[2].__name__ == "foreach_reduce_without_empty"
    assert wrapped == (torch_release() == "2.15"), after[2]
    fp.remove_param_dtype_map_patch()
    fp.remove_param_dtype_map_patch()
    assert not fp.is_param_dtype_map_patch_applied()
    assert [owner.__dict__[name] for owner, name in watched] == before
