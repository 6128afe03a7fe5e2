"""scripts/compat.py: the pure helpers (no venv is created, nothing is installed)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "compat.py"
_spec = importlib.util.spec_from_file_location("compat_script", _PATH)
assert _spec is not None and _spec.loader is not None
compat = importlib.util.module_from_spec(_spec)
sys.modules["compat_script"] = compat
_spec.loader.exec_module(compat)


def test_parse_version_accepts_only_full_releases() -> None:
    assert compat.parse_version("2.12.1") == (2, 12, 1)
    assert compat.parse_version("2.15.0") > compat.CONSTRAINED_MAX
    for bad in ("2.12", "2.12.1+cu130", "latest"):
        with pytest.raises(
            argparse.ArgumentTypeError, match=re.escape(f"{bad!r} is not of the form")
        ):
            compat.parse_version(bad)


@pytest.mark.parametrize(
    ("log", "summary", "counts"),
    [
        (
            "....\n84 passed in 224.25s (0:03:44)\n",
            "84 passed in 224.25s (0:03:44)",
            {"passed": 84},
        ),
        (
            "FAILED x\n3 failed, 81 passed, 8 skipped in 126.96s (0:02:06)\n",
            "3 failed, 81 passed, 8 skipped in 126.96s (0:02:06)",
            {"failed": 3, "passed": 81, "skipped": 8},
        ),
        ("== 1 error in 0.1s ==\n", "1 error in 0.1s", {"errors": 1}),
        ("pip failed\n", "no pytest summary line (see the log)", {}),
    ],
)
def test_parse_summary(log: str, summary: str, counts: dict[str, int]) -> None:
    assert compat.parse_summary(log) == (summary, counts)


def test_local_wheel_found_in_find_links_dir_and_file_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    index = tmp_path / "simple" / "torch"
    index.mkdir(parents=True)
    (index / "index.html").write_text('<a href="../../files/torch-2.14.1-cp311-none.whl#sha256=0">')
    monkeypatch.setattr(compat, "_pip_locations", lambda: [wheels, tmp_path / "simple"])
    assert compat.has_local_wheel("2.13.0")
    assert compat.has_local_wheel("2.14.1")
    assert not compat.has_local_wheel("2.12.1")
    assert not compat.has_local_wheel("2.13.1")  # no prefix matches


def test_results_merge_one_entry_per_release(tmp_path: Path) -> None:
    def result(release: str, passed: int):
        return compat.Result(
            release, f"{release}+cpu", passed, 0, 0, 0, True, f"{passed} passed", 1.0,
            "2026-11-29", f"python scripts/compat.py {release}", "log",
        )  # fmt: skip

    path = tmp_path / "results.json"
    compat.write_results(path, [result("2.15.0", 80), result("2.11.0", 70)])
    compat.write_results(path, [result("2.15.0", 84)])
    entries = json.loads(path.read_text())
    assert [(e["release"], e["passed"]) for e in entries] == [("2.11.0", 70), ("2.15.0", 84)]


def test_venv_root_inside_the_repository_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        compat.main(["2.12.1", "--venv-root", str(_PATH.parents[1] / "venvs")])
    assert "is inside the repository; choose a path outside it" in capsys.readouterr().err


def test_bad_release_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        compat.main(["2.12", "--venv-root", "/nonexistent/venvs"])
    assert (
        "'2.12' is not of the form MAJOR.MINOR.PATCH; pass e.g. 2.12.1" in capsys.readouterr().err
    )


@pytest.mark.parametrize("extra", compat.EXTRAS)
def test_extras_are_read_from_pyproject(extra: str) -> None:
    """The runner installs the same extras as ``pip install .[hf,integrations]`` (a TOML parse
    agrees), and the integration packages are among them."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((_PATH.parents[1] / "pyproject.toml").read_text())["project"]
    assert compat.extra_packages(extra) == project["optional-dependencies"][extra]


def test_extras_cover_the_hf_and_integration_packages() -> None:
    packages = [p for extra in compat.EXTRAS for p in compat.extra_packages(extra)]
    for name in ("transformers", "diffusers", "peft", "accelerate", "trl", "lightning"):
        assert any(p.startswith(name) for p in packages), name
    with pytest.raises(RuntimeError, match="no one-line 'nope = \\[...\\]'"):
        compat.extra_packages("nope")
