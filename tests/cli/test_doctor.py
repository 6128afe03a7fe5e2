"""``fsdp-precision doctor`` on this torch, on a simulated unknown release and on one with a
changed upstream function: it names exactly what differs, and exits 1 where the patch cannot
run. The unknown release's output is snapshot-tested (versions normalised)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from fsdp_precision._cli import doctor as doctor_module
from fsdp_precision._cli import main
from fsdp_precision._releases import release_module

SNAPSHOT = Path(__file__).parent / "snapshots" / "doctor_unknown_release.txt"
CHANGED = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup._init_mp_dtypes"


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def normalised(text: str) -> str:
    """Versions of python and the packages replaced, and whether each installed version was
    tested (a registry release changes it): the snapshot holds the structure."""
    text = re.sub(r"fsdp-precision \S+, python \S+", "fsdp-precision X, python X", text)
    text = re.sub(r"accelerator: .*", "accelerator: X", text)
    text = re.sub(r"(param_dtype_override_fn\)): .*", r"\1: X", text)  # 2.15+ has it
    text = re.sub(r"backends: .*", "backends: X", text)
    head, _, packages = text.partition("packages (installed, tested with):\n")
    rows = [re.sub(r"^  (\w+)\s+(?:not installed|\S+)\s+(.*?)(?:  \(untested\))?$", r"  \1 X \2", row)
            for row in packages.splitlines()]  # fmt: skip
    return head + "packages (installed, tested with):\n" + "\n".join(rows) + "\n"


def test_on_this_torch_every_function_matches(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = doctor(capsys)
    count = len(release_module().SOURCES)
    assert code == 0
    assert f"  patch: {count} of {count} upstream functions match" in out
    assert "  patch can run: yes" in out and "NO " not in out
    assert "layout here: in-unit maps through the patch" in out
    code, raw = doctor(capsys, "--json")
    data = json.loads(raw)
    assert data["torch"]["patch_can_run"] and set(data["upstream_functions"].values()) == {
        "matches"
    }
    assert data["packages"]["transformers"]["tested"] == ["5.24.0", "4.56.2"]


def test_with_the_patch_installed_every_function_still_matches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The check reads torch's functions, not the replacements standing in their place (a
    process that patched, then asks: a notebook, a test session). Negative control: without
    ``__wrapped__`` on the replacements, the replaced ones read as changed."""
    import fsdp_precision as fp
    from fsdp_precision._patch.registry import _registry as registry

    count = len(release_module().SOURCES)
    was_applied = fp.is_param_dtype_map_patch_applied()
    fp.apply_param_dtype_map_patch()
    try:
        code, out = doctor(capsys)
        assert code == 0 and f"  patch: {count} of {count} upstream functions match" in out
        saved = [(r, r.__dict__.pop("__wrapped__")) for _, _, r in registry.installed]
        try:
            code, out = doctor(capsys)
            assert code == 1 and f"  patch: {count} of {count} upstream" not in out
        finally:
            for replacement, original in saved:
                replacement.__wrapped__ = original
    finally:
        if not was_applied:
            fp.remove_param_dtype_map_patch()


def test_a_changed_function_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(release_module().SOURCES, CHANGED, "0" * 64)
    code, out = doctor(capsys)
    count = len(release_module().SOURCES)
    assert code == 1
    assert f"  patch: {count - 1} of {count} upstream functions match" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("    NO")]
    assert line.startswith("    NO  _fsdp_param_group:FSDPParamGroup._init_mp_dtypes: differs")
    assert "layout here: refused by default" in out and "unknown_torch='public_api'" in out


def test_an_unknown_release_matches_the_snapshot(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.16.0.dev20261009+cpu")
    code, out = doctor(capsys)
    assert code == 1
    got = normalised(out)
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(got)
    assert got == SNAPSHOT.read_text(), (
        "doctor's output changed: UPDATE_SNAPSHOTS=1 and docs/cli.md"
    )


@pytest.mark.parametrize(
    ("installed", "marked"),
    [("1.15.0", False), ("1.15.0+local", False), ("1.16.0", True), (None, False)],
)
def test_an_installed_version_outside_the_tested_ones_is_marked(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    installed: str | None,
    marked: bool,
) -> None:
    monkeypatch.setattr(doctor_module, "TESTED_WITH", {"accelerate": ("1.15.0",)})
    monkeypatch.setattr(doctor_module, "_installed", lambda package: installed)
    _, out = doctor(capsys)
    (row,) = [ln for ln in out.splitlines() if ln.startswith("  accelerate ")]
    assert row.endswith("  (untested)") is marked
    assert ("not installed" in row) is (installed is None)


def test_dev_and_ci_install_the_first_tested_version_of_each_package() -> None:
    """``.ci/constraints.txt`` (what ``./dev`` and CI install) pins every package doctor lists,
    torch aside (each venv pins its own), to the first version in ``TESTED_WITH``."""
    path = Path(__file__).parents[2] / ".ci" / "constraints.txt"
    pins = dict(
        line.split("==")
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    expected = {name: tested[0] for name, tested in doctor_module.TESTED_WITH.items()}
    del expected["torch"]
    assert pins == expected
