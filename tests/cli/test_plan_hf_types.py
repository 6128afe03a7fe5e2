"""``plan hf:<model_type>`` for architectures the CLI used to fail on: the model class looked up
by model type (causal LM, seq2seq, image-text-to-text, base), a traced copy that cannot be built
leaving the plan standing with one line saying why, and the inputs ``verify`` makes for models
that need more than token ids."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from fsdp_precision._cli import main  # noqa: E402
from fsdp_precision._cli import models as models_module  # noqa: E402
from fsdp_precision._cli.models import load_config, model_classes, one_line  # noqa: E402
from fsdp_precision._cli.spec import resolve  # noqa: E402


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- the model class


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("gemma3n_text", "Gemma3nForCausalLM"),  # no auto class takes its text config
        ("blip", "BlipForConditionalGeneration"),  # image-text-to-text before the base model
        ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
        ("pp_chart2table", "GotOcr2ForConditionalGeneration"),  # another type's class
        ("evolla", "EvollaForProteinText2Text"),
        ("emu3", "Emu3ForCausalLM"),  # a text-only class of a multimodal type: its text config
        ("reformer", "ReformerModelWithLMHead"),  # retried as a decoder, as its LM head asks
    ],
)
def test_the_model_class_is_looked_up_by_model_type(model_type: str, expected: str) -> None:
    assert model_classes(load_config(f"hf:{model_type}"))[0].__name__ == expected
    assert type(resolve(f"hf:{model_type}").build(tiny=True)).__name__ == expected


def test_when_no_class_builds_the_first_class_error_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Fails:
        message = ""

        @classmethod
        def _from_config(cls, config: Any, **kwargs: Any) -> Any:
            raise RuntimeError(cls.message)

    class First(Fails):
        message = "the causal LM's error"

    class Second(Fails):
        message = "the base model's error"

    monkeypatch.setattr(models_module, "model_classes", lambda config: [First, Second])
    with pytest.raises(RuntimeError, match="^the causal LM's error$"):
        resolve("hf:llama").build()


def test_one_line_keeps_what_a_validation_heading_introduces() -> None:
    exc = ValueError("Class validation error for validator 'x':\n    ValueError: a must equal b")
    assert one_line(exc) == (
        "ValueError: Class validation error for validator 'x': ValueError: a must equal b"
    )
    assert one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"


# --------------------------------------------------------------------------- the fallback


def test_a_tiny_copy_that_cannot_be_built_leaves_the_plan_standing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def rejected(config: Any) -> Any:
        raise ValueError("Class validation error for validator 'v':\n  ValueError: a != b")

    monkeypatch.setattr(models_module, "tiny_config", rejected)
    data = plan_json(capsys, "hf:llama", "--world-size", "8")
    assert data["units"]  # the full-size plan
    assert data["first_forward"] == {
        "how": "not traced: a tiny CPU build of the same config cannot be built (ValueError: "
        "Class validation error for validator 'v': ValueError: a != b)"
    }
    assert main(["plan", "hf:llama"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("first forward:")] == [
        "first forward: not traced: a tiny CPU build of the same config cannot be built "
        "(ValueError: Class validation error for validator 'v': ValueError: a != b)"
    ]


def test_a_tiny_copy_that_is_not_tiny_is_not_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models_module, "TINY_MAX_PARAMS", 1000)
    built: list[str] = []
    original = models_module._from_config

    def recorded(config: Any, device: torch.device, dtype: Any) -> Any:
        built.append(device.type)
        return original(config, device, dtype)

    monkeypatch.setattr(models_module, "_from_config", recorded)
    how = plan_json(capsys, "hf:llama")["first_forward"]["how"]
    assert how.startswith("not traced: a tiny CPU build of the same config cannot be built (")
    assert "parameters (over 1,000): sizes fsdp_precision.testing.tiny_config" in how
    assert "cpu" not in built  # counted on meta, never built on the CPU


def test_mamba2_plans_with_its_log_space_advice(capsys: pytest.CaptureFixture[str]) -> None:
    """It failed outright (its tiny config was invalid); the advice is the CLI's own."""
    data = plan_json(capsys, "hf:mamba2", "--world-size", "8")
    assert data["first_forward"]["ok"] is True
    kinds = {a["pattern"]: a["kind"] for a in data["advice"]["advice"]}
    assert kinds["*.mixer.A_log"] == "log_space"
    assert kinds["*.mixer.dt_bias"] == "log_space"
    assert "stopped early" not in data["advice"]["traced"]


# --------------------------------------------------------------------------- inputs


def test_inputs_for_a_model_that_needs_pixel_values() -> None:
    model = resolve("hf:blip").build(device="cpu", tiny=True, dtype=torch.float32)
    inputs = resolve("hf:blip").inputs(model, torch.Generator().manual_seed(0))
    vision = model.config.vision_config
    assert inputs["pixel_values"].shape == (2, 3, vision.image_size, vision.image_size)
    model(**inputs)  # it ran without them: "missing 1 required positional argument"


def test_inputs_avoid_special_tokens_and_shift_decoder_labels() -> None:
    model = resolve("hf:fsmt").build(device="cpu", tiny=True, dtype=torch.float32)
    inputs = resolve("hf:fsmt").inputs(model, torch.Generator().manual_seed(0))
    labels, decoder = inputs["labels"], inputs["decoder_input_ids"]
    assert decoder.shape == labels.shape
    assert torch.equal(decoder[:, 1:], labels[:, :-1])
    assert (decoder[:, 0] == model.config.decoder_start_token_id).all()
    special = {model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id}
    assert not set(inputs["input_ids"].flatten().tolist()) & special
    model(**inputs)  # FSMT took its decoder inputs from input_ids: "batch_size (16) ... (12)"


def test_inputs_a_model_code_requires() -> None:
    model = resolve("hf:xmod").build(device="cpu", tiny=True, dtype=torch.float32)
    inputs = resolve("hf:xmod").inputs(model, torch.Generator().manual_seed(0))
    assert inputs["lang_ids"].tolist() == [0, 0]
    model(**inputs)  # "Input language unknown" without them
    model = resolve("hf:udop").build(device="meta", tiny=True)
    box = resolve("hf:udop").inputs(model, torch.Generator().manual_seed(0))["bbox"]
    assert box.dtype == torch.float32 and box.shape == (2, 8, 4)  # normalised, as UDOP reads them
    assert 0 <= box.min() and box.max() <= 1
    assert (box[..., 0] <= box[..., 2]).all() and (box[..., 1] <= box[..., 3]).all()


#: model type -> the arguments its forward needs beyond token ids, and the error without them.
BEYOND_TOKENS = {
    "pix2struct": ("flattened_patches", "You have to specify flattened_patches"),
    "vision-encoder-decoder": ("pixel_values", "You have to specify pixel_values"),
    "pi0": ("state", "missing 1 required positional argument: 'state'"),
    "voxtral_realtime": ("input_features", "exactly one of input_features"),
    "kosmos-2": ("image_embeds_position_mask", ""),
}


@pytest.mark.parametrize("model_type", list(BEYOND_TOKENS))
def test_inputs_beyond_token_ids_run_the_forward(model_type: str) -> None:
    spec = f"hf:{model_type}"
    torch.manual_seed(0)
    model = resolve(spec).build(device="cpu", tiny=True, dtype=torch.float32)
    inputs = resolve(spec).inputs(model, torch.Generator().manual_seed(0))
    name, without = BEYOND_TOKENS[model_type]
    assert name in inputs
    model(**inputs)
    if without:  # the negative control: the forward refuses to run without them
        with pytest.raises((ValueError, TypeError), match=without):
            model(**{k: v for k, v in inputs.items() if k != name})


def test_a_config_without_a_vocabulary_is_a_one_line_reason() -> None:
    class NoVocab(torch.nn.Module):
        class config:  # noqa: N801 - a stand-in for a transformers config
            model_type = "x"

        def forward(self, input_ids: Any = None) -> Any:
            return input_ids

    from fsdp_precision._cli.hf_inputs import transformers_inputs

    with pytest.raises(ValueError, match="its config names no vocab_size"):
        transformers_inputs("hf:x", NoVocab(), torch.Generator())
