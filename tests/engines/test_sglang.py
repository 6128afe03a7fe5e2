"""SGLang holds what training kept where it has a setting for it, and is refused by name where it
has none; its distributed updates carry the kept dtypes, in buckets it can lay out.

SGLang does not run on these machines (docs/after-training.md, "SGLang"), so these tests check
what the library computes for it against SGLang's source, read in 0.5.23: the settings per
architecture (``sglang/srt/models/*.py``), and the flattened-bucket layout its receiver computes
from names, dtypes and shapes alone (``sglang/srt/weight_sync/tensor_bucket.py:
FlattenedTensorBucket.empty`` and ``reconstruct_tensors``, restated below as
:func:`sglang_receive`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_precision import EngineDtypeError, WeightMeta, full_weights
from fsdp_precision._engines.kept import EngineKept
from fsdp_precision.checkpoint import EXPORT_RECORD, export_safetensors
from fsdp_precision.integrations.sglang import (
    ARCHITECTURES,
    READ_SGLANG,
    DistributedUpdate,
    distributed_updates,
    sglang_settings,
    update_payloads,
)

from tests.edges.test_export import GATES, mixed_qwen
from tests.support.hf_models import deepseek_v3

pytestmark = pytest.mark.fast
bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
L0, L1 = "model.layers.0.", "model.layers.1."
OVERRIDE = ["--json-model-override-args", '{"router_fp32": true}']
RL = ["--rl-on-policy-target", "fsdp"]


def kept(*names: str, dtype: torch.dtype = fp32, bulk: torch.dtype = bf16) -> EngineKept:
    return EngineKept(dict.fromkeys(names, dtype), bulk=bulk, source="test")


# ------------------------------------------------------------------ settings per architecture

# (architecture, config beyond it, kept names, the launch arguments beyond --dtype)
HELD = [
    ("DeepseekV3ForCausalLM", {}, [L1 + "mlp.gate.weight"], OVERRIDE),
    (
        "DeepseekV3ForCausalLM", {"topk_method": "noaux_tc"},
        [L1 + "mlp.gate.weight", L1 + "mlp.gate.e_score_correction_bias"], OVERRIDE,
    ),
    ("DeepseekV2ForCausalLM", {}, [L1 + "mlp.gate.weight"], OVERRIDE),
    ("DeepseekV32ForCausalLM", {}, [L1 + "mlp.gate.weight"], OVERRIDE),
    ("GlmMoeDsaForCausalLM", {}, [L1 + "mlp.gate.weight"], OVERRIDE),
    ("DeepseekV3ForCausalLM", {}, [L1 + "mlp.gate.e_score_correction_bias"], []),
    ("Glm4MoeForCausalLM", {}, [L1 + "mlp.gate.weight", L1 + "mlp.gate.e_score_correction_bias"], []),
    (
        "MiniMaxM2ForCausalLM", {"use_routing_bias": True},
        [L0 + "block_sparse_moe.gate.weight", L0 + "block_sparse_moe.e_score_correction_bias"], [],
    ),
    (
        "Qwen3ForCausalLM", {},
        [L0 + "input_layernorm.weight", L0 + "post_attention_layernorm.weight",
         L0 + "self_attn.q_norm.weight", L0 + "self_attn.k_norm.weight", "model.norm.weight"],
        RL,
    ),
    ("Qwen3ForCausalLM", {"tie_word_embeddings": False}, ["model.embed_tokens.weight"], RL),
    (
        "Qwen3ForCausalLM", {"tie_word_embeddings": True}, ["model.embed_tokens.weight"],
        [*RL, "--enable-fp32-lm-head"],
    ),
    ("Qwen2ForCausalLM", {}, ["model.norm.weight", "model.embed_tokens.weight"], RL),
]  # fmt: skip


@pytest.mark.parametrize(
    ("architecture", "extra", "names", "args"), HELD, ids=[f"{a}-{n[-1]}" for a, _, n, _ in HELD]
)
def test_each_kept_tensor_sglang_can_hold_gets_its_setting(
    architecture: str, extra: dict[str, Any], names: list[str], args: list[str]
) -> None:
    settings = sglang_settings(kept(*names), config={"architectures": [architecture], **extra})
    assert settings.server_args() == ["--dtype", "bfloat16", *args]
    assert list(settings.held) == names
    assert all(h.startswith("float32, ") for h in settings.held.values())
    assert ("router_fp32" in json.dumps(settings.engine_kwargs())) == (args == OVERRIDE)
    assert len(settings.notes) == len([a for a in args if a.startswith("--")])


def test_the_settings_read_as_sglang_takes_them() -> None:
    """``sgl.Engine(**engine_kwargs())`` takes ServerArgs' field names; the server's flags are
    those names with dashes (``arg_groups/arg_utils.py: _field_to_cli_name``), a bool a bare
    flag (``store_true``); the override is the JSON string ``get_config`` loads."""
    config = {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True}
    settings = sglang_settings(kept("model.embed_tokens.weight"), config=config)
    assert settings.engine_kwargs() == {
        "dtype": "bfloat16", "rl_on_policy_target": "fsdp", "enable_fp32_lm_head": True,
    }  # fmt: skip
    assert "the tied LM head's logits in float32" in settings.held["model.embed_tokens.weight"]
    deepseek = sglang_settings(kept(L1 + "mlp.gate.weight"), config="DeepseekV3ForCausalLM")
    assert json.loads(deepseek.engine_kwargs()["json_model_override_args"]) == {"router_fp32": True}
    assert "MoEGate" in deepseek.notes[0] and READ_SGLANG == ("0.5.23",)


def test_a_record_keeping_nothing_needs_no_knob() -> None:
    for architecture in ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "SomethingNewForCausalLM"):
        settings = sglang_settings(kept(), config=architecture)
        assert settings.server_args() == ["--dtype", "bfloat16"]
        assert settings.held == {} and settings.notes == ()


# ------------------------------------------------------------------ refusals, by name

# (architecture, config beyond it, kept names, bulk, kept dtype, what the message says)
REFUSED = [
    ("Qwen3MoeForCausalLM", {}, [L0 + "mlp.gate.weight", L1 + "mlp.gate.weight"], bf16, fp32,
     r"qwen3_moe\.py: Qwen3MoeSparseMoeBlock\), training kept them in float32; no SGLang setting"),
    ("Qwen2MoeForCausalLM", {}, [L0 + "mlp.gate.weight", L0 + "mlp.shared_expert_gate.weight"],
     bf16, fp32, r"qwen2_moe\.py: Qwen2MoeSparseMoeBlock"),
    ("MixtralForCausalLM", {}, [L0 + "block_sparse_moe.gate.weight"], bf16, fp32,
     r"mixtral\.py: MixtralMoE"),
    ("OlmoeForCausalLM", {}, [L0 + "mlp.gate.weight"], bf16, fp32, r"olmoe\.py: OlmoeMoE"),
    ("GptOssForCausalLM", {}, [L0 + "mlp.router.weight", L0 + "mlp.router.bias"], bf16, fp32,
     r"gpt_oss\.py: GptOssSparseMoeBlock"),
    ("Qwen2ForCausalLM", {}, [L0 + "input_layernorm.weight"], bf16, fp32,
     r"qwen2\.py: Qwen2DecoderLayer, --rl-on-policy-target or not"),
    ("LlamaForCausalLM", {}, [L0 + "post_attention_layernorm.weight"], bf16, fp32,
     r"llama\.py: LlamaDecoderLayer"),
    ("Qwen3ForCausalLM", {}, ["lm_head.weight"], bf16, fp32,
     r"--enable-fp32-lm-head computes the logits in fp32 from it, it does not hold the weight"),
    ("Qwen3ForCausalLM", {}, [L0 + "self_attn.q_proj.weight"], bf16, fp32,
     r"allocates them in the model dtype, bfloat16, training kept them in float32"),
    ("Qwen3ForCausalLM", {}, [L0 + "input_layernorm.weight"], fp16, fp32,
     r"only under --rl-on-policy-target, which casts activations to bfloat16 .* is float16"),
    ("DeepseekV3ForCausalLM", {"topk_method": "greedy"}, [L1 + "mlp.gate.e_score_correction_bias"],
     bf16, fp32, r"only with topk_method='noaux_tc', not 'greedy'"),
    ("MiniMaxM2ForCausalLM", {"use_routing_bias": False},
     [L0 + "block_sparse_moe.e_score_correction_bias"], bf16, fp32,
     r"only with use_routing_bias=True, not False"),
    ("Glm4MoeForCausalLM", {}, [L1 + "mlp.gate.weight"], bf16, fp64,
     r"glm4_moe\.py: Glm4MoeGate holds them in float32, training in float64"),
    ("PhiMoEForCausalLM", {}, [L0 + "block_sparse_moe.gate.weight"], bf16, fp32,
     r"does not know how SGLang's PhiMoEForCausalLM holds tensors \(ARCHITECTURES, read in "
     r"SGLang 0\.5\.23\)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("architecture", "extra", "names", "bulk", "dtype", "says"),
    REFUSED,
    ids=[f"{a}-{n[-1]}-{b}-{d}" for a, _, n, b, d, _ in REFUSED],
)
def test_a_kept_tensor_sglang_cannot_hold_is_refused_by_name(
    architecture: str,
    extra: dict[str, Any],
    names: list[str],
    bulk: torch.dtype,
    dtype: torch.dtype,
    says: str,
) -> None:
    config = {"architectures": [architecture], **extra}
    named = ", ".join(re.escape(n) for n in names)
    with pytest.raises(EngineDtypeError, match=rf"\(test\): {named}: .*{says}.*Export the model"):
        sglang_settings(kept(*names, dtype=dtype, bulk=bulk), config=config)


def test_every_refused_tensor_is_named_whatever_the_reasons() -> None:
    names = [*(f"model.layers.{i}.mlp.gate.weight" for i in range(12)), "lm_head.weight"]
    with pytest.raises(EngineDtypeError) as err:
        sglang_settings(kept(*names), config="Qwen3MoeForCausalLM")
    assert all(name in str(err.value) for name in names) and "more" not in str(err.value)


def test_one_refused_tensor_refuses_the_whole_launch() -> None:
    """What SGLang can hold does not hide what it cannot."""
    names = [L0 + "self_attn.q_norm.weight", "lm_head.weight"]
    with pytest.raises(EngineDtypeError, match=r": lm_head\.weight: ") as err:
        sglang_settings(kept(*names), config="Qwen3ForCausalLM")
    assert "q_norm" not in str(err.value)


# ------------------------------------------------------------------ from what the library writes


@pytest.fixture(scope="module")
def qwen_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sglang") / "qwen3_moe"
    export_safetensors(mixed_qwen(), out, dtype=bf16)
    return out


def test_a_qwen3_moe_export_is_refused_and_without_its_gates_it_is_not(
    qwen_export: Path, tmp_path: Path
) -> None:
    named = re.escape(f"{GATES[0]}, {GATES[1]}")
    with pytest.raises(EngineDtypeError, match=rf"fsdp_precision_export\.json\): {named}: "):
        sglang_settings(qwen_export)
    # the same record without the gates: nothing kept, no refusal, no knob
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(qwen_export / "config.json", copy)
    record = json.loads((qwen_export / EXPORT_RECORD).read_text())
    for name in GATES:
        record["kept"].pop(name)
    (copy / EXPORT_RECORD).write_text(json.dumps(record))
    settings = sglang_settings(copy)
    assert settings.server_args() == ["--dtype", "bfloat16"] and settings.held == {}


def test_a_directory_without_the_record_changes_nothing(qwen_export: Path, tmp_path: Path) -> None:
    shutil.copy(qwen_export / "config.json", tmp_path)
    settings = sglang_settings(tmp_path)
    assert settings.architecture == "Qwen3MoeForCausalLM"
    assert settings.engine_kwargs() == {} and settings.server_args() == []


def test_a_stream_is_judged_with_the_models_config() -> None:
    model = mixed_qwen()
    stream = full_weights(model, dtype=bf16)
    with pytest.raises(EngineDtypeError, match=rf"\(stream\): {re.escape(GATES[0])}, "):
        sglang_settings(stream, config=model)
    with pytest.raises(TypeError, match=r"config=None; pass the model, model\.config"):
        sglang_settings(stream)
    # a model built from_config has no architectures in its config; its class says it
    with pytest.raises(ValueError, match=r"architectures is None; pass config=model"):
        sglang_settings(stream, config=model.config)
    cast = full_weights(model, dtype=bf16, cast_kept=True)  # kept in the bulk's dtype
    settings = sglang_settings(cast, config=model)
    assert settings.held == dict.fromkeys(GATES, "bfloat16, the model dtype")
    assert settings.server_args() == ["--dtype", "bfloat16"]


def test_a_deepseek_v3_export_gets_router_fp32(tmp_path: Path) -> None:
    """A bf16 DeepSeek-V3 whose gate weight and correction bias are fp32: MoEGate holds the
    weight in fp32 under ``router_fp32`` and the bias in fp32 by itself."""
    pytest.importorskip("transformers")
    model = deepseek_v3().to(bf16)
    g = torch.Generator().manual_seed(0)
    gate = model.get_submodule("model.layers.1.mlp.gate")
    gate.weight.data = torch.randn(gate.weight.shape, generator=g) * 0.02
    gate.e_score_correction_bias = torch.randn(gate.e_score_correction_bias.shape, generator=g)
    export_safetensors(model, tmp_path / "out", dtype=bf16)
    settings = sglang_settings(tmp_path / "out")
    assert settings.server_args() == ["--dtype", "bfloat16", *OVERRIDE]
    assert sorted(settings.held) == [
        L1 + "mlp.gate.e_score_correction_bias",
        L1 + "mlp.gate.weight",
    ]


def test_a_config_that_names_no_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the config's architectures is None"):
        sglang_settings(kept(), config={})
    with pytest.raises(ValueError, match=r"config\.json' cannot be read as JSON"):
        sglang_settings(tmp_path)
    with pytest.raises(TypeError, match=r"config=3; pass the model, model\.config"):
        sglang_settings(kept(), config=3)


# Tiny configs of the architectures transformers has, to check the table's names against the
# checkpoint names a stream yields (a typo in a pattern would never match).
_SIZE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "intermediate_size": 32,
}
_MLA = {
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "n_group": 2,
    "topk_group": 1,
}
CONFIGS = {
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", _MLA),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", _MLA),
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", _MLA),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", {"moe_intermediate_size": 16, "n_routed_experts": 4,
                           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 2,
                           "topk_group": 1, "head_dim": 16}),
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", {"num_local_experts": 4, "num_experts_per_tok": 2,
                             "head_dim": 16, "use_routing_bias": True}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": 16}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"moe_intermediate_size": 16, "num_experts": 4,
                            "num_experts_per_tok": 2, "head_dim": 16}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {"moe_intermediate_size": 16, "num_experts": 4,
                            "shared_expert_intermediate_size": 16, "num_experts_per_tok": 2}),
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "OlmoeForCausalLM": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "GptOssForCausalLM": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                          "head_dim": 16, "layer_types": ["full_attention"] * 2}),
    "LlamaForCausalLM": ("LlamaConfig", {}),
}  # fmt: skip
#: Names the table holds that transformers' class does not have (SGLang's MoEGate has a
#: correction bias with topk_method="noaux_tc"; transformers' DeepSeek-V2 has none).
ABSENT = {("DeepseekV2ForCausalLM", r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias")}


@pytest.mark.parametrize("architecture", sorted(set(ARCHITECTURES) - {"DeepseekV32ForCausalLM"}))
def test_the_tables_names_are_the_checkpoints(architecture: str) -> None:
    transformers = pytest.importorskip("transformers")
    kind, extra = CONFIGS[architecture]
    config = getattr(transformers, kind)(**_SIZE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == architecture
    names = [m.name for m in full_weights(model).metadata]
    for hold in ARCHITECTURES[architecture]:
        matched = [n for n in names if re.fullmatch(hold.pattern, n)]
        assert bool(matched) != ((architecture, hold.pattern) in ABSENT), hold.pattern


# ------------------------------------------------------------------ distributed updates


def sglang_receive(update: dict[str, Any], payload: Sequence[torch.Tensor]) -> list[Any]:
    """What SGLang 0.5.23's receiver does with one call's JSON arguments and the bytes
    broadcast to it (``weight_updater.py: receive_weights_from_distributed``; with
    ``flattened_bucket``, ``FlattenedTensorBucket.empty`` then ``reconstruct_tensors``)."""
    names, dtypes, shapes = update["names"], update["dtypes"], update["shapes"]
    if update["load_format"] != "flattened_bucket":
        out = []
        for name, dtype, shape, sent in zip(names, dtypes, shapes, payload, strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            weight.copy_(sent)  # the broadcast
            out.append((name, weight))
        return out
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype)
        shape = torch.Size(shape)
        if offset % dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
            )
        size = shape.numel() * dtype.itemsize
        metadata.append((name, shape, dtype, offset, offset + size, size))
        offset += size
    flattened = torch.empty(offset, dtype=torch.uint8)
    if payload:
        flattened.copy_(payload[0])  # the broadcast
    return [(m[0], flattened[m[3] : m[4]].view(m[2]).reshape(m[1]), m) for m in metadata]


def expected() -> dict[str, torch.Tensor]:
    return dict(full_weights(mixed_qwen(), dtype=bf16))


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_a_stream_reaches_sglangs_receiver_bitwise_kept_dtypes_included(
    load_format: Any,
) -> None:
    stream = full_weights(mixed_qwen(), dtype=bf16)
    updates = distributed_updates(stream, bucket_bytes=40_000, load_format=load_format)
    assert len(updates) > 2
    listed = {n: d for u in updates for n, d in zip(u.names, u.dtypes, strict=True)}
    assert [n for u in updates for n in u.names if n in GATES] == list(GATES)
    assert {listed[g] for g in GATES} == {"float32"} and set(listed.values()) == {
        "bfloat16", "float32",
    }  # fmt: skip
    want = expected()
    received = {}
    for update, payload in update_payloads(stream, updates):
        call = json.loads(json.dumps(update.kwargs(group_name="g")))  # the server's JSON body
        assert call["group_name"] == "g" and call["load_format"] == load_format
        for name, tensor, *layout in sglang_receive(call, payload):
            received[name] = tensor
            if layout:  # SGLang's FlattenedTensorMetadata is what the update lists
                flat = {f.name: f for f in update.flat}[name]
                assert (flat.name, torch.Size(flat.shape), flat.dtype, flat.start_idx,
                        flat.end_idx, flat.numel) == layout[0]  # fmt: skip
    assert list(received) == [n for u in updates for n in u.names]
    assert sorted(received) == sorted(want)
    for name, tensor in want.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def metas(*specs: tuple[str, torch.dtype, tuple[int, ...]]) -> list[WeightMeta]:
    return [WeightMeta(name, dtype, shape, None, name) for name, dtype, shape in specs]


ODD = metas(("bias", bf16, (3,)), ("gate", fp32, (4, 2)), ("norm", bf16, (5,)), ("x", fp16, (1,)))


def test_a_flattened_bucket_lists_widest_first_so_sglang_accepts_every_offset() -> None:
    """An odd-sized bf16 tensor ahead of an fp32 one, as a stream orders them: in that order
    SGLang's receiver refuses the bucket; as listed, every offset is aligned, no padding."""
    (update,) = distributed_updates(ODD)
    assert update.names == ("gate", "bias", "norm", "x")  # stable within one element size
    assert [(f.start_idx, f.end_idx, f.numel) for f in update.flat] == [
        (0, 32, 32), (32, 38, 6), (38, 48, 10), (48, 50, 2),
    ]  # fmt: skip
    tensors = [
        torch.arange(3).to(bf16),
        torch.randn(4, 2),
        torch.arange(5).to(bf16),
        torch.ones(1, dtype=fp16),
    ]
    stream = list(zip([m.name for m in ODD], tensors, strict=True))
    ((_, payload),) = update_payloads(stream, [update])
    out = {name: t for name, t, _ in sglang_receive(update.kwargs(), payload)}
    assert all(torch.equal(out[name], t) for name, t in stream)
    # the negative control: the stream's own order, as an unsorted bucket would list it
    as_streamed = distributed_updates(ODD, load_format=None)[0].kwargs()
    with pytest.raises(ValueError, match=r"Unaligned received tensor gate: byte offset 6"):
        sglang_receive({**as_streamed, "load_format": "flattened_bucket"}, [])


def test_buckets_are_consecutive_and_a_large_tensor_travels_alone() -> None:
    specs = metas(("a", bf16, (10,)), ("b", fp32, (100,)), ("c", bf16, (10,)), ("d", bf16, (10,)))
    updates = distributed_updates(specs, bucket_bytes=64)
    assert [u.names for u in updates] == [("a",), ("b",), ("c", "d")]
    assert [u.load_format for u in updates] == ["flattened_bucket"] * 3
    per_tensor = distributed_updates(specs, bucket_bytes=64, load_format=None)
    assert per_tensor[2].names == ("c", "d") and per_tensor[2].flat == ()


def test_a_stream_other_than_the_updates_is_refused_by_name() -> None:
    model = mixed_qwen()
    updates = distributed_updates(full_weights(model, dtype=bf16))  # gates fp32
    cast = full_weights(model, dtype=bf16, cast_kept=True)  # gates bf16
    with pytest.raises(ValueError, match=rf"{re.escape(GATES[0])}: the stream yields \('bfloat16'"):
        list(update_payloads(cast, updates))
    first: tuple[DistributedUpdate, ...] = distributed_updates(
        full_weights(model, dtype=bf16).metadata[:3]
    )
    with pytest.raises(ValueError, match=r"the stream yields it, no update lists it"):
        list(update_payloads(full_weights(model, dtype=bf16), first))


def test_bad_update_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"bucket_bytes=0; pass a positive"):
        distributed_updates(ODD, bucket_bytes=0)
    with pytest.raises(ValueError, match=r"load_format='direct'; pass 'flattened_bucket' or None"):
        distributed_updates(ODD, load_format="direct")  # type: ignore[arg-type]
