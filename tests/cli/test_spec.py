"""``MODEL`` is resolved in one place (``_cli/spec.py``): each command reads a spec's config once,
and the pieces that build models and make inputs never call back into the commands (issue 48:
``plan`` went from ``advise`` to ``verify`` and back for its inputs)."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_precision._cli import main
from fsdp_precision._cli import models as models_module

from tests.project.test_architecture import read_imports

COMMANDS = {"fsdp_precision._cli.plan", "fsdp_precision._cli.verify", "fsdp_precision._cli.advise"}


def test_only_the_dispatcher_imports_a_command() -> None:
    """Function-level imports included: inputs, tiny builds and weights come from the resolver,
    not from another command's module."""
    found = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in read_imports()
        if i.target in COMMANDS - {"fsdp_precision._cli.advise"}
        or (i.target == "fsdp_precision._cli.advise" and i.source != "fsdp_precision._cli.plan")
        if i.source.startswith("fsdp_precision._cli.") and i.source != "fsdp_precision._cli"
    ]
    assert found == []


def test_the_library_pieces_are_read_through_the_resolver() -> None:
    """The commands never import the transformers and Diffusers pieces that build a model or
    make its inputs; the resolver does (``one_line``, a message formatter, aside)."""
    pieces = {
        "fsdp_precision._cli.diffusers_models",
        "fsdp_precision._cli.hf_inputs",
    }
    found = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in read_imports()
        if i.source in COMMANDS | {"fsdp_precision._cli.calibration"} and i.target in pieces
    ]
    assert found == []


def test_plan_reads_a_config_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The meta build, its inputs, the traced advice's and the first forward's tiny builds all
    come from one resolved spec: ``hf:llama``'s config is read once."""
    pytest.importorskip("transformers")
    calls: list[str] = []
    load = models_module.load_config

    def counted(spec: str) -> Any:
        calls.append(spec)
        return load(spec)

    monkeypatch.setattr(models_module, "load_config", counted)
    assert main(["plan", "hf:llama", "--json"]) == 0, capsys.readouterr().err
    assert calls == ["hf:llama"]
