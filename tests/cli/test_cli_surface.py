"""The command line's surface (commands, options, defaults, choices, help) against a snapshot,
and against its documentation.

An intended change: ``UPDATE_SNAPSHOTS=1 pytest tests/cli/test_cli_surface.py``, review the diff of
``tests/cli/snapshots/cli_surface.json``, and update ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_precision._cli import _parser, main

SNAPSHOT = Path(__file__).parent / "snapshots" / "cli_surface.json"
DOCS = Path(__file__).parents[2] / "docs" / "cli.md"


def _action(action: argparse.Action) -> dict[str, Any]:
    return {
        "flags": list(action.option_strings) or [action.dest],
        "default": action.default if action.default is not argparse.SUPPRESS else None,
        "choices": list(action.choices) if action.choices else None,
        "type": getattr(action.type, "__name__", None),
        "metavar": action.metavar,
        "help": action.help,
    }


def surface(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Every command's options, in order, as plain data."""
    commands: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands[name] = {
                    "description": sub.description,
                    "options": [
                        _action(a) for a in sub._actions if not isinstance(a, argparse._HelpAction)
                    ],
                }
    return {"prog": parser.prog, "commands": commands}


def test_surface_matches_the_snapshot() -> None:
    got = surface(_parser())
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    expected = json.loads(SNAPSHOT.read_text())
    changed = sorted(
        name
        for name in set(got["commands"]) | set(expected["commands"])
        if got["commands"].get(name) != expected["commands"].get(name)
    )
    assert got == expected, (
        f"the command line changed ({', '.join(changed) or 'prog'}); if intended, run "
        "UPDATE_SNAPSHOTS=1 pytest tests/cli/test_cli_surface.py and update docs/cli.md"
    )


def test_every_command_and_option_is_documented() -> None:
    docs = DOCS.read_text()
    for name, command in surface(_parser())["commands"].items():
        assert f"## `fsdp-precision {name}" in docs, name
        section = docs.split(f"## `fsdp-precision {name}")[1].split("\n## ")[0]
        for option in command["options"]:
            flag = option["flags"][0]
            if flag.startswith("-"):
                assert flag in section, f"docs/cli.md does not mention {name} {flag}"


@pytest.mark.parametrize("command", [[], *([c] for c in surface(_parser())["commands"])])
def test_help_everywhere(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: fsdp-precision")


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: _verify_options(nproc=0), r"--nproc must be an integer >= 1, got 0"),
        (lambda: _verify_options(nproc=True), r"--nproc must be an integer >= 1, got True"),
        (lambda: _verify_options(min_params=-1), r"--min-params must be >= 0, got -1"),
        (lambda: _plan_options(world_size=0), r"--world-size must be >= 1, got 0"),
        (lambda: _plan_options(min_params=-5), r"--min-params must be >= 0, got -5"),
    ],
)
def test_plan_and_verify_options_are_validated_on_construction(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def _verify_options(**kwargs: Any) -> Any:
    from fsdp_precision._cli.verify import VerifyOptions

    return VerifyOptions(model="hf:llama", **kwargs)


def _plan_options(**kwargs: Any) -> Any:
    from fsdp_precision._cli.plan import PlanOptions

    return PlanOptions(model="hf:llama", **kwargs)
