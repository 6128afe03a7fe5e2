"""The diffusion screen (``scripts/screen_diffusion.py``): Wan, Flux, SD3, HunyuanVideo,
LTX-Video, CogVideoX, QwenImage and an SD-style UNet, built as the CLI builds a Diffusers model
directory (tiny), with their declared keeps and the precision advisor's applied, trained two
steps on two gloo ranks against the separate-units layout (or, where that cannot express the
plan, the unsharded reference).

Each model's outcome is asserted, the known failures included, so that a regression fails here
and a fix shows (update docs/model-families.md's table with the screen's output then). The
advised timestep-feature Linears are kept with ``boundary="inputs_outputs"`` (their outputs
back to bf16 for the next layer; at ``"auto"`` they stayed fp32, as a router's logits do, and
HunyuanVideo, CogVideoX, QwenImage and the UNet failed their first forward). LTX-Video fails
either way, on the advised ``scale_shift_table``: its block adds the fp32 table to its
activations and hands them to bf16 layers, with no module boundary to cast at (the error's note
says so). Its ``AdaLayerNormSingle``, which rounds the timestep features to the activations'
dtype inside the kept ``time_embed``, runs now: the kept linears inside a cast module cast
their inputs too.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import load_script

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install '.[hf]')")

screen = load_script("scripts/screen_diffusion.py")

#: model -> (with the advice applied, with the advised rules at boundary="inputs_outputs"):
#: "bitwise" against separate units, "reference" (separate units cannot express the plan:
#: bitwise against the unsharded reference), "dtype" (fails on a dtype mismatch), None (not run).
EXPECTED: dict[str, tuple[str, str | None]] = {
    "wan": ("reference", None),
    "flux": ("bitwise", None),
    "sd3": ("bitwise", None),
    "hunyuan_video": ("bitwise", None),
    "ltx_video": ("dtype", "dtype"),
    "cogvideox": ("bitwise", None),
    "qwenimage": ("bitwise", None),
    "unet": ("bitwise", None),
}
DTYPE_ERRORS = ("must have the same dtype", "mixed dtype")
#: The default tier: one model per outcome and kind of model (Wan: the reference, LTX-Video: the
#: dtype failure, Flux: a transformer bitwise with separate units, the UNet: an advised Linear at
#: ``boundary="inputs_outputs"``); ``-m slow`` screens all eight.
DEFAULT = ["wan", "flux", "ltx_video", "unet"]


@pytest.fixture(scope="module")
def rows(request: pytest.FixtureRequest) -> dict[str, Any]:
    everything = "slow" in (request.config.getoption("-m") or "")
    chosen = [m for m in screen.MODELS if everything or m in DEFAULT]
    return {r.name: r for r in screen.run(chosen)}


def _check(attempt: Any, expected: str | None) -> None:
    if expected is None:
        assert attempt is None
        return
    assert attempt is not None
    if expected == "dtype":
        assert not attempt.trains, "it trains now: update EXPECTED and docs/model-families.md"
        assert any(e in attempt.error for e in DTYPE_ERRORS), attempt.error
        return
    assert attempt.trains, f"{attempt.error} {attempt.notes}"
    if expected == "reference":
        assert attempt.separate.startswith("cannot express: "), attempt.separate
        assert attempt.reference == "bitwise", attempt.reference
        return
    assert attempt.separate == "bitwise", attempt.separate
    (ours, ours_rs), (theirs, theirs_rs) = attempt.collectives, attempt.separate_collectives
    assert ours < theirs and ours_rs < theirs_rs  # one unit holds its kept parameters


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.slow) for m in EXPECTED]
)
def test_each_model_trains_or_fails_as_recorded(rows: dict[str, Any], name: str) -> None:
    row = rows[name]
    assert not row.error, row.error
    assert row.kept > 0 and row.units > 1
    advised, inputs_outputs = EXPECTED[name]
    _check(row.attempts["advised"], advised)
    _check(row.attempts.get("inputs_outputs"), inputs_outputs)


@pytest.mark.distributed
def test_wan_keeps_its_declarations_and_the_rest_computes_in_bf16(rows: dict[str, Any]) -> None:
    wan = rows["wan"]
    assert wan.declared == ["norm2", "scale_shift_table", "time_embedder"]
    assert wan.advised == []  # what the advisor finds, the declarations keep already
    assert wan.attempts["advised"].separate.startswith(
        "cannot express: `blocks.0` holds kept `blocks.0.scale_shift_table` beside parameters"
    )


def test_every_screened_model_has_an_expectation() -> None:
    assert set(EXPECTED) == set(screen.MODELS)


def test_the_comparison_sees_one_bit() -> None:
    """Negative control of the screen's check: one gradient element one ulp apart differs."""
    import torch

    grad = torch.ones(3)
    ours = [(torch.tensor(1.0), {"w": grad}, {"w": grad})]
    nudged = grad.clone()
    nudged[1] = torch.nextafter(nudged[1], torch.tensor(2.0))
    assert screen.differences(ours, ours) == []
    assert screen.differences(ours, [(torch.tensor(1.0), {"w": nudged}, {"w": grad})]) == [
        "step 0 grad w"
    ]


def test_ltx_videos_failure_names_the_table_its_block_mixes_in(rows: dict[str, Any]) -> None:
    (note,) = rows["ltx_video"].attempts["advised"].notes
    assert "the LTXVideoTransformerBlock holds kept 'scale_shift_table' (float32) itself" in note
    assert "time_embed" not in note  # the embedder, once blamed, runs
