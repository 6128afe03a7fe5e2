"""The MoE screen (``scripts/screen_hf_keep.py``): every one of transformers' 32 screened MoE
architectures trains on two ranks with its routers, its norms, or both kept in fp32 inside bf16
FSDP units under the default ``boundary="auto"``, with no hook or ``.float()`` of its own:
bitwise the nested-unit layout with the same casts, and the uniform policy's collectives.
(MiniMax fails under the uniform bf16 policy too, keeping nothing: it is checked to, below.) The
table with ``boundary="none"`` as well is in docs/rules.md."""

from __future__ import annotations

import pytest

from tests.support import load_script

pytest.importorskip("transformers", reason="transformers is not installed")

screen = load_script("scripts/screen_hf_keep.py")


def _known(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


#: Architectures that fail under the uniform bf16 policy too, keeping nothing: not a keep's
#: failure, and no boundary cast can help (the model's own fp32 tensors meet bf16 activations).
UNIFORM_FAILS = {
    "minimax": "its lightning attention's fp32 decay tensors meet bf16 values in a matmul",
}


#: The default tier: one architecture per kind of router and norm code (a biased router, a
#: sigmoid router with a correction bias, softmax top-k, shared experts, hybrid attention, a
#: router that returns the mixing weights, MiniMax's uniform failure); ``-m slow`` runs all 32
#: (about 110 s on 2 cores, CI's budget holds the default tier).
DEFAULT = (
    "gpt_oss deepseek_v3 qwen3_moe mixtral qwen2_moe qwen3_next llama4_text granitemoe "
    "jetmoe minimax longcat_flash"
).split()


@pytest.fixture(scope="module")
def rows(request: pytest.FixtureRequest) -> dict[str, object]:
    everything = "slow" in (request.config.getoption("-m") or "")
    chosen = screen.ARCHITECTURES if everything else DEFAULT
    present = [m for m in chosen if _known(m)]
    return {r.model_type: r for r in screen.run(present, ("auto",))}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model_type",
    [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.slow) for m in screen.ARCHITECTURES],
)
def test_every_architecture_trains_with_routers_and_norms_kept(rows, model_type: str) -> None:
    if not _known(model_type):
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {model_type}")
    row = rows[model_type]
    if model_type in UNIFORM_FAILS:  # known, and checked to still be so
        assert "same dtype" in row.uniform_error, row.uniform_error or "it trains now"
        return
    assert not row.note, row.note
    for kind in screen.KINDS:
        cell = row.cells[f"{kind}/auto"]
        assert cell.kept > 0, f"{kind}: the screen's patterns kept nothing"
        assert cell.ok, f"{kind}: {cell.error}"
        assert cell.bitwise, f"{kind}: not bitwise the nested-unit layout"
        assert cell.uniform_collectives, f"{kind}: collectives differ from the uniform policy's"


@pytest.mark.distributed
def test_without_boundary_casts_the_router_fails_and_the_error_names_the_fix() -> None:
    """Negative control: Qwen3-MoE's router does not cast its input; with boundary='none' the
    first forward fails, and the error names the parameter, the module and the fix."""
    (row,) = screen.run(["qwen3_moe"], ("none",))
    cell = row.cells["routers/none"]
    assert not cell.ok and "same dtype" in cell.error
    (note,) = cell.notes
    assert "'mlp.gate' (Qwen3MoeTopKRouter) holds kept 'mlp.gate.weight' (float32)" in note
    assert "boundary='auto'" in note
    assert not row.cells["norms/none"].ok  # its RMSNorm returns weight * x: fp32 activations
