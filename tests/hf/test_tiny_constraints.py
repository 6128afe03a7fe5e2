"""``tiny_config`` keeps the relations the architectures' own validators check, so that the
traced copy of ``plan hf:<type>`` and ``verify hf:<type>`` is built from the same config, small.

Each case is a model type whose default config the shrink used to make invalid (or not tiny),
with the relation it must keep, checked on the shrunk config and on a model built from it on
the meta device. Without the constraint it names, each case fails: the architecture's validator
rejects the config, the model does not build, or the relation does not hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from fsdp_precision._cli.models import load_config  # noqa: E402
from fsdp_precision._cli.spec import resolve  # noqa: E402
from fsdp_precision.testing import tiny_config  # noqa: E402
from fsdp_precision.testing._tiny_constraints import _split  # noqa: E402


def _text(config: Any) -> Any:
    return config.get_text_config()


def _layer_types(config: Any) -> list[str]:
    return list(_text(config).layer_types)


#: model type -> (what must hold of the tiny config, what it checks).
CASES: dict[str, Callable[[Any], bool]] = {
    # Mamba2: hidden_size * expand == num_heads * head_dim (num_heads derived)
    "mamba2": lambda c: c.hidden_size * c.expand == c.num_heads * c.head_dim,
    # Bamba: mamba_d_head ("auto") derived again from the shrunk sizes
    "bamba": lambda c: c.mamba_d_head * c.mamba_n_heads == c.mamba_expand * c.hidden_size,
    "granitemoehybrid": lambda c: (
        c.mamba_d_head * c.mamba_n_heads == c.mamba_expand * c.hidden_size
    ),
    # XLNet: d_head == d_model // n_head
    "xlnet": lambda c: c.d_head == c.d_model // c.n_head,
    # LongCat-Flash: qk_head_dim == qk_nope_head_dim + qk_rope_head_dim
    "longcat_flash": lambda c: c.qk_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim,
    # Cosmos 3, HY-V4-VL: rotary sections sum to half the rotary head size
    "cosmos3_edge": lambda c: (
        sum(_text(c).rope_parameters["mrope_section"]) == _text(c).head_dim // 2
    ),
    "hy_v4_vl": lambda c: (
        sum(_text(c).rope_parameters["mrope_section"]) == _text(c).qk_rope_head_dim // 2
    ),
    # Qwen2-VL: the sections its code defaults to where the config has none, rescaled
    "qwen2_vl": lambda c: (
        sum(_text(c).rope_parameters["mrope_section"])
        == _text(c).hidden_size // _text(c).num_attention_heads // 2
    ),
    # Gemma 4: per-layer overrides name kept layers; a full-attention layer is kept
    "gemma4_text": lambda c: set(_layer_types(c)) == {"sliding_attention", "full_attention"},
    # Dots 3: per-layer overrides are shrunk too; widths the adapter takes from the text model
    "dots3_note": lambda c: all(
        v.num_attention_heads <= 4 and v.kv_lora_rank <= 16 for v in _text(c).per_layer_config
    ),
    # Olmo-Hybrid: at least one attention layer among the kept ones
    "olmo_hybrid": lambda c: "full_attention" in _layer_types(c),
    # Dory: n_input_layers + n_recurrent_layers + n_output_layers == num_hidden_layers
    "dory": lambda c: (
        c.n_input_layers + c.n_recurrent_layers + c.n_output_layers == c.num_hidden_layers
    ),
    # GPT-Neo: attention_types expands to one entry per layer
    "gpt_neo": lambda c: len(c.attention_layers) == c.num_layers,
    # Zamba: two hybrid layers (their shared transformer is tied to the first one's)
    "zamba": lambda c: c.layers_block_type.count("hybrid") == 2,
    # Reformer: axial position embedding sizes sum to hidden_size
    "reformer": lambda c: sum(c.axial_pos_embds_dim) == c.hidden_size,
    # widths one config takes from another
    "granite_docling": lambda c: c.vision_config.out_hidden_size == c.text_config.hidden_size,
    "inkling2": lambda c: c.vision_config.text_hidden_size == c.text_config.hidden_size,
    "muse_spark": lambda c: c.audio_config.out_hidden_size == c.text_config.hidden_size,
    "nemo_speechlm": lambda c: (
        c.audio_config.diarization_config.head_config.audio_hidden_size
        == c.audio_config.diarization_config.audio_config.hidden_size
    ),
    # Molmo 2: the adapter's vision layer indices index the tiny vision tower
    "molmo2": lambda c: all(
        0 <= i < c.vision_config.num_hidden_layers for i in c.adapter_config.vision_feature_layer
    ),
    # T5Gemma: nested configs named encoder / decoder are shrunk too (5.6 billion parameters)
    "t5gemma": lambda c: c.encoder.hidden_size == c.decoder.hidden_size == 32,
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_the_tiny_config_keeps_the_architecture_valid(model_type: str) -> None:
    full = load_config(f"hf:{model_type}")
    tiny = tiny_config(full)  # the architecture's validators run in from_dict
    assert CASES[model_type](tiny)
    model = resolve(f"hf:{model_type}").build("meta", tiny=True)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


def test_the_input_config_is_untouched() -> None:
    full = load_config("hf:gemma4_text")
    before = full.to_dict()
    tiny_config(full)
    assert full.to_dict() == before


@pytest.mark.parametrize(
    ("sections", "target", "expected"),
    [
        ([16, 24, 24], 4, [2, 1, 1]),  # the equal spatial sections stay equal
        ([22, 22, 20], 4, [1, 1, 2]),  # ERNIE-4.5-VL stacks its two spatial sections
        ([24, 20, 20], 4, [2, 1, 1]),
        ([12, 10, 10], 2, [1, 1, 0]),  # too few to keep them all: largest remainders
    ],
)
def test_rotary_sections_are_split_by_largest_remainder(sections, target, expected) -> None:
    assert _split(sections, target) == expected
    assert sum(_split(sections, target)) == target


def test_a_tiny_mamba2_traces_its_log_space_parameters() -> None:
    """The traced copy is the architecture itself: Mamba2's A_log reaches an exp."""
    from fsdp_precision import advise

    torch.manual_seed(0)
    model = resolve("hf:mamba2").build("cpu", tiny=True, dtype=torch.float32)
    advice = advise(model)
    assert "stopped early" not in advice.traced
    assert {a.pattern: a.kind for a in advice.advice}["*.mixer.A_log"] == "log_space"
