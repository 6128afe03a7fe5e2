"""Every transformers architecture that planned still plans: ``scripts/screen_hf_plan.py``
against its record, ``tests/hf/plan_screen.json`` (written by
``python scripts/screen_hf_plan.py --record tests/hf/plan_screen.json``; the table is in
docs/model-families.md).

The default tier plans every model type on the meta device without any forward
(``--plans-only``: about 50 s on 2 cores) and the full screen (the tiny traced copy, the
advisor's meta forward) of one type per kind of fix; ``-m slow`` runs the full screen of every
type. A type recorded as planning must still plan; one that does not must fail for the recorded
reason (never in the library); what reached its end must still reach it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import load_script

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

screen = load_script("scripts/screen_hf_plan.py")
RECORD: dict[str, Any] = json.loads(Path(__file__).with_name("plan_screen.json").read_text())
TYPES: dict[str, dict[str, str]] = RECORD["types"]
#: The full screen in the default tier: one type per kind of fix. Mamba2's tiny config (derived
#: head count) and its log-space advice; Gemma 4's per-layer overrides; Qwen2-VL's rotary
#: sections its code defaults; BLIP's class (image-text-to-text) and pixel values; T5's meta
#: trace past a padding-mask shortcut; Switch Transformers' advice from the tiny build where its
#: MoE dispatch stops the meta forward.
TRACED = ("mamba2", "gemma4_text", "qwen2_vl", "blip", "t5", "switch_transformers")

same_release = pytest.mark.skipif(
    transformers.__version__ != RECORD["transformers"],
    reason=f"the record is of transformers {RECORD['transformers']}, not "
    f"{transformers.__version__}: rerun {RECORD['command']}",
)


def _regressions(rows: list[Any], column: str) -> dict[str, str]:
    """Types whose ``column`` was ``yes`` in the record and is not now."""
    return {
        r.name: getattr(r, column)
        for r in rows
        if TYPES[r.name][column].startswith("yes") and not getattr(r, column).startswith("yes")
    }


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    rows = screen.run(sorted(TYPES), trace=False, advice=False, units="transformer_block")
    return {r.name: r for r in rows}


@same_release
def test_the_record_covers_every_model_type() -> None:
    assert sorted(TYPES) == screen.model_types()


@same_release
def test_every_type_plans_as_recorded(quick: dict[str, Any]) -> None:
    """On the meta device, no forward: what planned still plans; the others fail for the
    recorded reason."""
    changed = {
        name: (row["plans_only"], quick[name].plans)
        for name, row in TYPES.items()
        if quick[name].plans != row["plans_only"]
    }
    assert not changed, changed


def test_no_type_fails_in_the_library(quick: dict[str, Any]) -> None:
    assert not {n: r.plans for n, r in quick.items() if r.plans.startswith("library:")}


def test_every_type_the_default_screen_planned_builds_and_plans_here() -> None:
    """What the record's full screen planned, the quick one plans too, or refuses the one
    layout it uses (a tied parameter across transformer blocks) with its named error."""
    for name, row in TYPES.items():
        if row["plans"] == "yes":
            assert row["plans_only"] == "yes" or row["plans_only"].startswith("refused: "), name


@same_release
@pytest.mark.parametrize("name", TRACED)
def test_one_type_per_fix_is_traced_and_advised_to_the_end(name: str) -> None:
    row = screen.screen(name)
    recorded = TYPES[name]
    assert (row.plans, row.traced, row.advice) == ("yes", "yes", "yes")
    assert (recorded["plans"], recorded["traced"], recorded["advice"]) == ("yes", "yes", "yes")


def test_the_advice_reaches_the_end_wherever_the_models_own_forward_runs() -> None:
    """In the record, every type that plans has advice from a forward that reached its end,
    unless the model's own forward fails on a tiny fp32 build without any plan (its default
    config leaves a token id or a size unset), and the record names why."""
    stopped = {
        name: row["advice"]
        for name, row in TYPES.items()
        if row["plans"] == "yes" and row["advice"] != "yes" and not row.get("own_forward")
    }
    assert not stopped, stopped


@pytest.mark.slow
@same_release
def test_the_whole_screen_keeps_what_reached_its_end() -> None:
    rows = screen.run(sorted(TYPES))
    assert not _regressions(rows, "plans")
    assert not _regressions(rows, "traced")
    assert not _regressions(rows, "advice")
    assert not [r.name for r in rows if r.plans.startswith("library:")]
