"""The load screen (``scripts/screen_hf_load.py``) on a sample of its architectures: for each,
``hf.cast_keeping_fp32`` of the fp32 model equals ``from_pretrained(save_pretrained(it), dtype)``
in the dtype of every parameter and buffer, at fp16 and bf16. The whole screen's table is in
docs/rules.md."""

from __future__ import annotations

import pytest

from tests.support import load_script

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("diffusers", reason="diffusers is not installed")

screen = load_script("scripts/screen_hf_load.py")

#: Each with a kind of declaration: ``wo`` (T5), strict router lists and rotary buffers
#: (DeepSeek-V3), norms (GPT-OSS), a whole sub-model (BLIP-2's ``qformer``, at fp16).
TRANSFORMERS = ["t5", "deepseek_v3", "gpt_oss", "blip-2"]
#: Root-level and per-block ``scale_shift_table`` and non-persistent rope buffers (Wan).
DIFFUSERS = ["WanTransformer3DModel"]


@pytest.mark.parametrize("name", TRANSFORMERS + DIFFUSERS)
def test_the_cast_equals_from_pretrained_tensor_by_tensor(name: str) -> None:
    found = list(screen.transformers_architectures([name])) if name in TRANSFORMERS else []
    found += list(screen.diffusers_architectures([name])) if name in DIFFUSERS else []
    if not found:
        pytest.skip(f"{name} declares no keep list in the installed release")
    (arch,) = found
    row = screen.screen(*arch)
    assert not row.note, row.note
    assert row.differences == []
    assert sum(row.kept.values()) > 0  # something was kept: the comparison had content


def test_the_screen_reports_a_difference() -> None:
    """Negative control: a cast that undoes the declarations (``.to``) is caught."""
    arch = next(iter(screen.transformers_architectures(["t5"])))
    from fsdp_precision import hf

    original = hf.cast_keeping_fp32
    try:
        hf.cast_keeping_fp32 = lambda model, dtype: model.to(dtype)  # type: ignore[assignment]
        row = screen.screen(*arch)
    finally:
        hf.cast_keeping_fp32 = original
    assert any("wo.weight" in fqn for _, fqn, _, _ in row.differences)
