"""The advisor's calibration (``scripts/screen_advice.py``) on tiny configs: recall of what
transformers and Diffusers declare and of every MoE router, precision on dense decoders. The
table is in docs/advice.md."""

from __future__ import annotations

import pytest

from tests.support import load_script

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("diffusers", reason="diffusers is not installed")

screen = load_script("scripts/screen_advice.py")


@pytest.fixture(scope="module")
def rows() -> dict[str, object]:
    return {r.name: r for r in screen.run(list(screen.ARCHITECTURES))}


@pytest.mark.parametrize("name", screen.ARCHITECTURES)
def test_each_architecture_is_traced_to_its_end(rows, name: str) -> None:
    row = rows[name]
    assert not row.error, row.error
    assert "stopped early" not in row.traced, row.traced


@pytest.mark.parametrize("name", [*screen.MOE, "jamba", "nemotron_h"])
def test_recall_every_router(rows, name: str) -> None:
    row = rows[name]
    assert row.routers, "the ground truth found no router"
    assert set(row.routers) <= set(row.found), sorted(set(row.routers) - set(row.found))
    kinds = {p: a["kind"] for a in row.advice for p in a["params"]}
    assert {kinds[r] for r in row.routers} == {"router"}


@pytest.mark.parametrize("name", screen.ARCHITECTURES)
def test_recall_every_declaration_the_trace_can_see(rows, name: str) -> None:
    row = rows[name]
    unexplained = [fqn for fqn, why in row.missed.items() if not why]
    assert not unexplained, unexplained


def test_what_the_trace_cannot_see_is_still_missed(rows) -> None:
    # WHY's entries are facts about the advisor: if it found T5's wo, the docs would be stale.
    assert rows["t5"].missed and all(".wo.weight" in fqn for fqn in rows["t5"].missed)


@pytest.mark.parametrize("name", screen.DENSE)
def test_precision_no_projection_or_mlp_weight_in_a_dense_decoder(rows, name: str) -> None:
    row = rows[name]
    assert row.dense_flags == [] and row.extra == []
    assert row.norms > 0  # the weaker class is still reported


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mamba2", {"A_log": "log_space", "dt_bias": "log_space", "D": "gain"}),
        ("rwkv", {"time_decay": "log_space", "time_first": "log_space"}),
        ("clip", {"logit_scale": "log_space"}),
        ("gpt_oss", {"sinks": "log_space"}),
        ("wan", {"scale_shift_table": "gain"}),
    ],
)
def test_the_non_router_kinds_on_the_models_that_have_them(rows, name: str, expected) -> None:
    kinds = {p.rpartition(".")[2]: a["kind"] for a in rows[name].advice for p in a["params"]}
    assert {k: kinds.get(k) for k in expected} == expected
    for advice in rows[name].advice:  # every flag says what the trace saw
        assert " in " in advice["reason"] and ": " in advice["reason"]
