"""The family screen (``scripts/screen_replay.py``): every transformers MoE family replays
(built tiny: its own live routes bitwise, other routes reaching every router's experts with
finite, non-zero gate gradients) or is refused by name. ``replay_screen.json`` records which,
``docs/replay-families.md`` shows it; these tests keep both true.

The default tier screens one family per kind of router code; ``-m slow`` screens every type in
the JSON (about 4 minutes on one core)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.support import ROOT, load_script

pytest.importorskip("transformers", reason="transformers is not installed")

screen = load_script("scripts/screen_replay.py")
RECORD: dict[str, Any] = json.loads(screen.JSON.read_text())

#: One family per kind of router code: its status and the router class that decides it.
DEFAULT = {
    "qwen3_moe": ("replays", "Qwen3MoeTopKRouter"),  # softmax, then top-k
    "deepseek_v3": ("replays", "DeepseekV3TopkRouter"),  # sigmoid, correction bias, group top-k
    "gpt_oss": ("replays", "GptOssTopKRouter"),  # top-k over logits, then softmax
    "llama4_text": ("replays", "Llama4Router"),  # top-k scattered into -inf, then sigmoid
    "ernie4_5_moe": ("replays", "Ernie4_5_MoeTopKRouter"),  # its moe_statics bias
    "phimoe": ("refused", "PhimoeTopKRouter"),  # sparsemixer: masked argmax
}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    import transformers.utils.logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)


@pytest.mark.parametrize("model_type", DEFAULT)
def test_one_family_per_kind_of_router(model_type: str) -> None:
    status, router = DEFAULT[model_type]
    row = screen.screen(model_type, RECORD["types"][model_type]["family"])
    assert (row["status"], row["router"]) == (status, router), row["why"]
    assert row == RECORD["types"][model_type], "replay_screen.json is stale: rerun the screen"
    if status == "refused":
        assert f"routing replay cannot drive 'model.layers.0.mlp.router' ({router}):" in row["why"]
    else:
        assert "live routes replay bitwise" in row["why"]


def test_a_model_without_routers_is_refused() -> None:
    row = screen.screen("llama")
    assert row["status"] == "refused", row["why"]
    assert row["why"].startswith("LlamaForCausalLM has no router routing replay can drive")


def _answer_live(mech: Any, detach: bool) -> Any:
    """A broken replay: the router's own top-k instead of the routes (or the routes' values
    detached from the gate)."""
    original = mech._Select.__torch_function__

    def broken(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        hits = self.hits
        out = original(self, func, types, args, kwargs)
        if self.hits == hits:
            return out
        if detach:
            return torch.return_types.topk((out.values.detach(), out.indices))
        return func(*args, **(kwargs or {}))

    return broken


@pytest.mark.parametrize(
    "detach, failure",
    [
        (False, "mlp.gate handed its experts other ids"),
        (True, "model.layers.0.mlp.gate.weight: grad"),  # no gradient reaches the gate
    ],
)
def test_the_screen_fails_a_replay_that_does_not_drive_the_router(
    monkeypatch: pytest.MonkeyPatch, detach: bool, failure: str
) -> None:
    """Negative controls: a replay that leaves the router's own pick, or that cuts the combine
    weights from the gate, is screened ``fails``."""
    from fsdp_precision._replay import replay as mech

    monkeypatch.setattr(mech._Select, "__torch_function__", _answer_live(mech, detach))
    row = screen.screen("qwen3_moe")
    assert row["status"] == "fails"
    assert failure in row["why"]


def test_the_record_covers_every_router_class_in_transformers() -> None:
    """A new transformers router class or MoE family fails here, by name, until screened."""
    scanned = {c: f for c, f in screen.router_classes().items() if c not in screen.NOT_ROUTERS}
    new = sorted(set(scanned) - set(RECORD["classes"]))
    assert not new, f"router classes not screened: {new}; run python scripts/screen_replay.py"
    gone = sorted(set(RECORD["classes"]) - set(scanned))
    assert not gone, f"router classes gone from transformers: {gone}; rerun the screen"
    types = screen.model_types()
    assert sorted(types) == sorted(RECORD["types"]), "rerun python scripts/screen_replay.py"
    assert all(r["status"] in ("replays", "refused") for r in RECORD["types"].values())


def test_every_refused_router_class_is_screened_refused() -> None:
    from fsdp_precision._replay.routers import REFUSED

    refused = {r["router"] for r in RECORD["types"].values() if r["status"] == "refused"}
    assert set(REFUSED) <= refused, (
        f"REFUSED classes no screened family refuses by: {set(REFUSED) - refused}"
    )


def test_the_docs_table_is_the_record() -> None:
    page = (ROOT / "docs" / "replay-families.md").read_text()
    assert page == screen.markdown(RECORD), "regenerate: scripts/screen_replay.py --markdown"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(RECORD["types"]))
def test_every_family_still_screens_as_recorded(model_type: str) -> None:
    recorded = RECORD["types"][model_type]
    row = screen.screen(model_type, recorded["family"])
    assert row == recorded, row["why"]
