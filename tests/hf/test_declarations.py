"""Keep declarations with the semantics of the systems users migrate from (transformers, PEFT,
verl): read through wrappers, matched on the keys ``from_pretrained`` loads (tie targets and
non-persistent buffers excluded), and ``_no_split_modules`` names that resolve to no class named.
"""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_precision as fp
from fsdp_precision import hf
from fsdp_precision.testing import GatherProbe

from tests.support.hf_models import (
    _transformers_major,
    deepseek_v3,
    requires_transformers_5,
    t5,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


class Wrapper(nn.Module):
    """A plain module holding a Hugging Face model (what a training framework often adds)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: torch.Tensor) -> object:
        return self.inner(**kwargs)


def _peft(model: nn.Module, targets: list[str]) -> nn.Module:
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install '.[peft]')")
    config = peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, config, autocast_adapter_dtype=True)


def _under_peft(name: str, targets: list[str]) -> str:
    """``name`` in a PeftModel: under ``base_model.model``, a LoRA target's tensors in its
    ``base_layer``."""
    for target in targets:
        name = name.replace(f".{target}.", f".{target}.base_layer.")
    return f"base_model.model.{name}"


def _kept_params(model: nn.Module, dtype: torch.dtype) -> set[str]:
    return {p for d in hf.keep_in_fp32_declarations(model, dtype) for p in d.params}


# ------------------------------------------------------------------ declarations through wrappers

# (builder of the bare model, dtype at which it keeps something, LoRA targets, a kept FQN)
WRAPPED = {
    "t5_fp16": (t5, fp16, ["wo"], "encoder.block.0.layer.1.DenseReluDense.wo.weight"),
    "deepseek_v3_bf16": (deepseek_v3, bf16, ["q_a_proj"], "model.layers.1.mlp.gate.weight"),
}


@pytest.mark.parametrize("case", WRAPPED)
def test_a_plain_wrapper_keeps_the_declarations_of_the_model_it_holds(case: str) -> None:
    build, dtype, _, kept = WRAPPED[case]
    bare = _kept_params(build(), dtype)
    if kept not in bare:
        pytest.skip(f"this transformers release declares nothing for {kept}")
    assert _kept_params(Wrapper(build()), dtype) == {f"inner.{n}" for n in bare}
    assert hf.library_of(Wrapper(build())) == "transformers"
    assert hf.library_of(Wrapper(nn.Linear(2, 2))) is None


@pytest.mark.parametrize("case", WRAPPED)
def test_peft_layers_are_seen_through_and_adapters_are_never_declared(case: str) -> None:
    build, dtype, targets, kept = WRAPPED[case]
    bare = _kept_params(build(), dtype)
    if kept not in bare:
        pytest.skip(f"this transformers release declares nothing for {kept}")
    wrapped = _peft(build(), targets)
    found = _kept_params(wrapped, dtype)
    assert found == {_under_peft(n, targets) for n in bare}
    assert not any("lora_" in n for n in found)  # adapters were never loaded: never declared


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("entry", ["wrap_model_for_training", "model_policy"])
@pytest.mark.parametrize("how", ["bare", "wrapper", "peft"])
@pytest.mark.parametrize("case", WRAPPED)
def test_wrapped_models_gather_their_kept_parameters_in_fp32(
    case: str, how: str, entry: str
) -> None:
    """The bare model is the control: a wrapper or a PeftModel must not change what is kept."""
    build, dtype, targets, kept = WRAPPED[case]
    model = hf.cast_keeping_fp32(build(), dtype)  # what from_pretrained(dtype=...) stores
    if model.get_parameter(kept).dtype != fp32:
        pytest.skip(f"this transformers release declares nothing for {kept}")
    name = {"bare": kept, "wrapper": f"inner.{kept}", "peft": _under_peft(kept, targets)}[how]
    wrapped = {"bare": lambda m: m, "wrapper": Wrapper, "peft": lambda m: _peft(m, targets)}[how]
    root = wrapped(model)
    preset = "fp16" if dtype == fp16 else "bf16"
    config = fp.DistributedConfig(fsdp_mixed_precision=preset, fsdp_auto_wrap_min_params=0)
    if entry == "wrap_model_for_training":
        fp.wrap_model_for_training(root, config)
    else:  # as a framework calling fully_shard itself would: blocks, then the root
        policy = fp.model_policy(root, config.precision())
        for block in fp.default_units(root)[:-1]:  # the _no_split_modules blocks
            fully_shard(block, mp_policy=policy)
        fully_shard(root, mp_policy=policy)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    with GatherProbe(root) as probe:
        root(input_ids=ids, labels=ids)
    assert probe.seen[name].dtype == fp32
    others = [g for f, g in probe.seen.items() if "lora_" not in f and g.dtype != fp32]
    assert others and all(g.dtype == dtype for g in others)


# ------------------------------------------------------------------ what from_pretrained loads


def _tied_llama(*, tie: bool) -> nn.Module:
    class KeptHead(transformers.LlamaForCausalLM):
        _keep_in_fp32_modules_strict = ["lm_head"]

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    return KeptHead(config)


def _dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    out = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b.dtype for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def _loaded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
        return type(model).from_pretrained(directory, dtype=dtype)


@requires_transformers_5  # 4.x refuses this layout when the model is built
@pytest.mark.parametrize("tie", [True, False])
def test_a_declaration_matching_only_a_tie_target_keeps_what_from_pretrained_keeps(tie) -> None:
    """transformers saves one name per tied group and applies keep lists to the saved keys: a
    tied head loads as the embedding does. Untied is the control: there the head is kept."""
    model = _tied_llama(tie=tie)
    loaded = _loaded(model, bf16)
    cast = hf.cast_keeping_fp32(copy.deepcopy(model), bf16)
    assert _dtypes(cast) == _dtypes(loaded)
    head = fp32 if not tie else bf16
    assert loaded.lm_head.weight.dtype == head and cast.lm_head.weight.dtype == head
    plan = fp.compile_param_dtype_maps(loaded, fp.PrecisionRules(), [loaded])  # accepted
    (unit,) = plan.units
    assert unit.param_dtype_map == ({} if tie else {"lm_head.weight": fp32})


def test_non_persistent_buffers_keep_their_dtype_as_from_pretrained_leaves_them() -> None:
    """Rotary ``inv_freq`` is never loaded: from_pretrained leaves it in fp32; so does the cast."""
    model = deepseek_v3()
    (name,) = [n for n, _ in model.named_buffers() if n.endswith("rotary_emb.inv_freq")]
    for dtype in (fp16, bf16):
        cast = hf.cast_keeping_fp32(copy.deepcopy(model), dtype)
        assert cast.get_buffer(name).dtype == fp32
        assert _dtypes(cast) == _dtypes(_loaded(model, dtype))
    # Control: a blanket cast rounds the rotary angles.
    assert copy.deepcopy(model).to(bf16).get_buffer(name).dtype == bf16


class _NormWithBuffers(nn.Module):
    """A norm with two non-persistent buffers: one built in the default dtype (``torch.ones``),
    one in fp32 whatever the default (``.float()``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("gain", torch.ones(dim), persistent=False)
        self.register_buffer("angles", torch.ones(dim).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _llama_keeping_a_norm_with_buffers() -> nn.Module:
    class Keeping(transformers.LlamaForCausalLM):
        _keep_in_fp32_modules = ["norm"]
        _keep_in_fp32_modules_strict = ["norm"]

        def __init__(self, config: object) -> None:
            super().__init__(config)
            self.model.norm = _NormWithBuffers(config.hidden_size)  # type: ignore[attr-defined]

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return Keeping(config)


def test_non_persistent_buffers_of_a_declared_module_are_what_from_pretrained_builds() -> None:
    """A buffer made with ``torch.ones`` in a module of ``_keep_in_fp32_modules`` is built in the
    load dtype by ``from_pretrained`` and never loaded: the cast gives it that dtype too (it
    kept fp32), and the ``.float()`` one stays fp32 in both (issue 48)."""
    model = _llama_keeping_a_norm_with_buffers()
    for dtype in (fp16, bf16):
        loaded = _loaded(model, dtype)
        cast = hf.cast_keeping_fp32(copy.deepcopy(model), dtype)
        assert _dtypes(cast) == _dtypes(loaded)
        assert cast.get_buffer("model.norm.gain").dtype == dtype
        assert cast.get_buffer("model.norm.angles").dtype == fp32


# ------------------------------------------------------------------ _no_split_modules names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _declaring(*names: str) -> nn.Module:
    model = nn.Sequential(Block(), Block())
    model._no_split_modules = list(names)  # type: ignore[assignment]
    return model


TRANSFORMER_BLOCK = fp.DistributedConfig(fsdp_auto_wrap_policy="transformer_block")


def test_unresolvable_block_names_are_named_in_a_warning() -> None:
    model = _declaring("Block", "VisionBlock")
    with pytest.warns(
        UserWarning,
        match=r"the class of none of its modules: \['VisionBlock'\]; the units are the blocks that are: \['Block'\]",
    ):
        plan = fp.plan_model_for_training(model, TRANSFORMER_BLOCK)
    assert [u.name for u in plan.units] == ["0", "1", "<root>"]
    with pytest.warns(UserWarning, match=r"\['VisionBlock'\]"):
        assert fp.default_units(model) == [model[0], model[1], model]


def test_every_block_name_resolving_warns_nothing() -> None:
    """The control of the warning above."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = fp.plan_model_for_training(_declaring("Block"), TRANSFORMER_BLOCK)
    assert [u.name for u in plan.units] == ["0", "1", "<root>"]


def test_no_block_name_resolving_is_an_error_not_a_root_only_plan() -> None:
    message = (
        r"declares the blocks \['DecoderLayer', 'VisionBlock'\] in _no_split_modules, but none "
        r"of them is the class of one of its modules.*fsdp_transformer_block_classes"
    )
    model = _declaring("DecoderLayer", "VisionBlock")
    with pytest.raises(ValueError, match=message):
        fp.plan_model_for_training(model, TRANSFORMER_BLOCK)
    with pytest.raises(ValueError, match=message):
        fp.compile_param_dtype_maps(model, fp.PrecisionRules())  # default units: the same
    # The size policy never needed the names: it still plans.
    assert fp.plan_model_for_training(model, fp.DistributedConfig()).units


# --------------------------------------------- nested, overlapping and duplicate declarations


def _overlapping_llama() -> nn.Module:
    class Overlapping(transformers.LlamaForCausalLM):
        # nested and overlapping (mlp holds gate_proj), duplicate (mlp twice), and a name
        # several modules end in (norm); 4.x refuses dotted entries ("not part of the modules")
        _keep_in_fp32_modules_strict = ["mlp", "gate_proj", "mlp", "norm"]

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return Overlapping(config)


def test_nested_overlapping_and_duplicate_declarations_keep_what_from_pretrained_keeps() -> None:
    model = _overlapping_llama()
    loaded = _loaded(model, bf16)
    cast = hf.cast_keeping_fp32(copy.deepcopy(model), bf16)
    assert _dtypes(cast) == _dtypes(loaded)
    kept = {n for n, p in loaded.named_parameters() if p.dtype == fp32}
    assert any(".mlp.gate_proj." in n for n in kept) and any(".mlp.up_proj." in n for n in kept)
    # "norm": whole dotted segments on transformers 4.x (model.norm), an unanchored search on
    # 5.x (the layer norms too), as each release's from_pretrained matches
    assert "model.norm.weight" in kept
    assert any("layernorm" in n for n in kept) == ((_transformers_major() or 5) >= 5)
    assert not any("self_attn" in n for n in kept)  # the negative control: not declared
    plan = fp.compile_param_dtype_maps(loaded, fp.PrecisionRules(param_dtype=bf16), [loaded])
    (unit,) = plan.units
    assert set(unit.param_dtype_map) == kept  # overlapping declarations: one claim each
    assert all(dtype == fp32 for dtype in unit.param_dtype_map.values())


def _gemma3() -> nn.Module:
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config)


@pytest.mark.skipif(
    not hasattr(transformers, "Gemma3TextConfig"), reason="this transformers has no Gemma 3"
)
def test_non_persistent_buffers_take_the_dtype_from_pretrained_builds_them_in() -> None:
    """Gemma's ``embed_scale`` is made with ``torch.tensor(...)`` in ``__init__``: under
    ``from_pretrained(dtype=bf16)`` it is bf16 (the load dtype is the default dtype then), while
    the rotary ``inv_freq`` buffers, made with ``.float()``, stay fp32. The cast gives both."""
    model = _gemma3()
    scale = "model.embed_tokens.embed_scale"
    assert model.get_buffer(scale).dtype == fp32  # built in fp32 here
    for dtype in (fp16, bf16):
        cast = hf.cast_keeping_fp32(copy.deepcopy(model), dtype)
        assert cast.get_buffer(scale).dtype == dtype
        assert _dtypes(cast) == _dtypes(_loaded(model, dtype))
        # the embedding's output promotes to fp32 when embed_scale stays fp32
        ids = torch.tensor([[1, 2, 3]])
        assert cast.model.embed_tokens(ids).dtype == dtype
    # A buffer of a module whose parameters are kept stays as it is.
    rules = fp.PrecisionRules(rules=(fp.Glob("model.embed_tokens.weight"),))
    kept = hf.cast_keeping_fp32(copy.deepcopy(model), bf16, rules=rules)
    assert kept.model.embed_tokens.weight.dtype == fp32
    assert kept.get_buffer(scale).dtype == fp32


def test_a_model_whose_class_cannot_be_rebuilt_keeps_its_buffers() -> None:
    """Control: without a config to rebuild from, non-persistent buffers keep their dtype."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_buffer("scale", torch.ones(4), persistent=False)
    cast = hf.cast_keeping_fp32(model, bf16)
    assert cast.get_buffer("scale").dtype == fp32 and cast[0].weight.dtype == bf16
