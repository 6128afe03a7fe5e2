"""Run the test suite against a torch release in an isolated venv, one release at a time.

    python scripts/compat.py 2.12.1                    # one release
    python scripts/compat.py 2.11.0 2.12.1 2.15.0      # several, one after the other
    python scripts/compat.py 2.15.0 --results compat-results.json   # record for the docs

For each release: create (or reuse) ``VENV_ROOT/torch-X.Y.Z``, install ``torch==X.Y.Z`` (from
the local wheel when the pip configuration has one, else from PyPI), then ``numpy``, ``pytest``
and ``pytest-timeout``, the ``hf`` and ``integrations`` extras (transformers, diffusers,
safetensors; peft, accelerate, trl, lightning) with the installed torch pinned, then this
project, editable and without dependencies (so that pip never swaps the torch under test), and
run ``python -m pytest -q`` in the repository root. Prints one line per release; exits non-zero
if any release failed.

On machines whose pip configuration caps torch with a constraint file, the torch install of a
release that is above the cap, or that no local wheel provides, runs with
``PIP_CONFIG_FILE=/dev/null``, and so does the extras install of a release above the cap (those
commands only; nothing is changed on disk).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[1]
#: The highest torch the constraint file on the development machines allows.
CONSTRAINED_MAX = (2, 14, 1)
DEFAULT_VENV_ROOT = Path("/work/venvs")
TEST_PACKAGES = ("numpy", "pytest", "pytest-timeout", "hypothesis")
#: The extras every release is tested with: without them the Hugging Face and integration tests
#: would skip on every release but the CI one (torchtitan keeps its own venv, as in CI).
EXTRAS = ("hf", "integrations")


def extra_packages(extra: str) -> list[str]:
    """The requirements of the project's optional dependency ``extra``, read from pyproject."""
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(rf"^{re.escape(extra)} = \[(.*)\]$", text, re.MULTILINE)
    if line is None:
        raise RuntimeError(f"pyproject.toml has no one-line '{extra} = [...]' optional dependency")
    return re.findall(r'"([^"]+)"', line.group(1))


@dataclass
class Result:
    """The outcome of one release's run, as recorded by ``--results``."""

    release: str
    torch_version: str
    passed: int
    failed: int
    skipped: int
    errors: int
    ok: bool
    summary: str
    seconds: float
    date: str
    command: str
    log: str


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.12.1"`` -> ``(2, 12, 1)``; anything else is rejected with the accepted form."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"torch release {text!r} is not of the form MAJOR.MINOR.PATCH; pass e.g. 2.12.1"
        )
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def _pip_locations() -> list[Path]:
    """Local directories the ambient pip configuration reads packages from."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except OSError:
        return []
    found: list[Path] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if not key.endswith(("find-links", "index-url", "extra-index-url")):
            continue
        for item in value.strip().strip("'\"").split():
            url = urlparse(item)
            if url.scheme in ("", "file"):
                found.append(Path(unquote(url.path)))
    return found


def has_local_wheel(version: str) -> bool:
    """Whether a configured local wheel directory or file index holds ``torch==version``."""
    pattern = re.compile(rf"torch-{re.escape(version)}(\+[\w.]+)?-")
    for location in _pip_locations():
        candidates = [location, location / "torch"]
        for place in candidates:
            if place.is_dir():
                names = [p.name for p in place.iterdir()]
                index = place / "index.html"
                if index.is_file():
                    names += re.findall(r'href="([^"]+)"', index.read_text(errors="replace"))
                if any(pattern.search(Path(n).name) for n in names):
                    return True
    return False


def _run(
    cmd: list[str], log: TextIO, env: dict[str, str] | None = None, cwd: Path | None = None
) -> int:
    prefix = "PIP_CONFIG_FILE=/dev/null " if env and env.get("PIP_CONFIG_FILE") else ""
    log.write(f"$ {prefix}{shlex.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, check=False)
    return proc.returncode


def _installed_torch(python: Path) -> str | None:
    proc = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout else None


def prepare_venv(version: str, venv: Path, log: TextIO) -> Path:
    """Create ``venv`` (if needed) with ``torch==version``, the test tools and the project."""
    python = venv / "bin" / "python"
    if not python.exists():
        if _run([sys.executable, "-m", "venv", str(venv)], log) != 0:
            raise RuntimeError(f"could not create the venv {venv}; see the log")
    current = _installed_torch(python)
    env = dict(os.environ)
    if parse_version(version) > CONSTRAINED_MAX:
        # Above the machine's constraint file: the installs that resolve torch (torch itself,
        # and the extras that depend on it) ignore the ambient pip configuration (the
        # constraint file itself is left alone).
        env["PIP_CONFIG_FILE"] = "/dev/null"
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if current is None or current.split("+")[0] != version:
        torch_env = dict(env)
        if not has_local_wheel(version):
            torch_env["PIP_CONFIG_FILE"] = "/dev/null"  # only on PyPI
        if _run(cmd + [f"torch=={version}"], log, env=torch_env) != 0:
            raise RuntimeError(f"pip could not install torch=={version}; see the log")
    if _run(cmd + list(TEST_PACKAGES), log) != 0:
        raise RuntimeError("pip could not install the test tools; see the log")
    # The extras, with the installed torch pinned: their dependencies never swap the torch. The
    # pin is the release without a local label (``2.11.0``, not ``2.11.0+cu130``): pip accepts
    # the installed build for it, where a local label makes it search the indexes.
    packages = [package for extra in EXTRAS for package in extra_packages(extra)]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pin:
        pin.write(f"torch=={version}\n")
        pin.flush()
        if _run(cmd + ["-c", pin.name, *packages], log, env=env) != 0:
            raise RuntimeError(f"pip could not install the extras {', '.join(EXTRAS)}; see the log")
    if _run(cmd + ["--no-deps", "-e", str(ROOT)], log) != 0:
        raise RuntimeError(f"pip could not install {ROOT} (editable); see the log")
    installed = _installed_torch(python)
    if installed is None or installed.split("+")[0] != version:
        raise RuntimeError(f"the venv {venv} holds torch {installed}, not {version}")
    return python


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def parse_summary(text: str) -> tuple[str, dict[str, int]]:
    """pytest's closing line (``== 79 passed in 312.4s ==``) and its counts."""
    for line in reversed(text.splitlines()):
        if _COUNT.search(line) and (" in " in line or line.startswith("=")):
            counts: dict[str, int] = {}
            for number, kind in _COUNT.findall(line):
                counts["errors" if kind.startswith("error") else kind] = int(number)
            return line.strip("= ").strip(), counts
    return "no pytest summary line (see the log)", {}


def run_release(version: str, venv_root: Path, pytest_args: list[str]) -> Result:
    """Prepare the venv for ``version`` and run the suite there."""
    venv = venv_root / f"torch-{version}"
    venv_root.mkdir(parents=True, exist_ok=True)
    log_path = venv_root / f"torch-{version}.log"
    start = time.monotonic()
    command = f"python scripts/compat.py {version}"
    with log_path.open("w") as log:
        try:
            python = prepare_venv(version, venv, log)
        except RuntimeError as exc:
            return Result(
                version, "?", 0, 0, 0, 0, False, f"setup failed: {exc}",
                round(time.monotonic() - start, 1), dt.date.today().isoformat(), command,
                str(log_path),
            )  # fmt: skip
        torch_version = _installed_torch(python) or "?"
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
        code = _run(cmd, log, cwd=ROOT)
    summary, counts = parse_summary(log_path.read_text(errors="replace"))
    ok = code == 0 and counts.get("passed", 0) > 0
    return Result(
        release=version,
        torch_version=torch_version,
        passed=counts.get("passed", 0),
        failed=counts.get("failed", 0),
        skipped=counts.get("skipped", 0),
        errors=counts.get("errors", 0),
        ok=ok,
        summary=summary if code != 5 else "pytest collected no tests",
        seconds=round(time.monotonic() - start, 1),
        date=dt.date.today().isoformat(),
        command=command + (" -- " + shlex.join(pytest_args) if pytest_args else ""),
        log=str(log_path),
    )


def write_results(path: Path, results: list[Result]) -> None:
    """Merge ``results`` into the JSON file at ``path`` (one entry per release, newest wins)."""
    existing: dict[str, dict[str, object]] = {}
    if path.exists():
        existing = {r["release"]: r for r in json.loads(path.read_text())}
    for result in results:
        existing[result.release] = asdict(result)
    ordered = [existing[k] for k in sorted(existing, key=lambda v: parse_version(v))]
    path.write_text(json.dumps(ordered, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Arguments after -- go to pytest, e.g. -- -m 'not distributed'.",
    )
    parser.add_argument("releases", nargs="+", type=str, help="torch releases, e.g. 2.12.1")
    parser.add_argument(
        "--venv-root",
        type=Path,
        default=DEFAULT_VENV_ROOT,
        help=f"where the venvs go, outside the repository (default: {DEFAULT_VENV_ROOT})",
    )
    parser.add_argument("--results", type=Path, help="merge the results into this JSON file")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, pytest_args = argv[:split], argv[split + 1 :]
    args = parser.parse_args(argv)
    for release in args.releases:
        try:
            parse_version(release)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    root = args.venv_root.resolve()
    if root == ROOT or ROOT in root.parents:
        parser.error(f"--venv-root {root} is inside the repository; choose a path outside it")
    results = []
    for release in args.releases:
        result = run_release(release, root, pytest_args)
        results.append(result)
        status = "PASS" if result.ok else "FAIL"
        print(
            f"torch {release} ({result.torch_version}): {status}: {result.summary} "
            f"[{result.seconds:.0f}s, log {result.log}]",
            flush=True,
        )
    if args.results is not None:
        write_results(args.results, results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
