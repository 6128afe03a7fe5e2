"""SGLang holds what training kept where it has a setting for it, and is refused by name where it
has none, before anything starts.

Pure: SGLang is never imported (it does not run on CPU-only machines: docs/after-training.md,
"SGLang"). What SGLang allocates in which dtype, and which setting changes that, was read from
its source (:data:`READ_SGLANG`) and is kept as data (:data:`ARCHITECTURES`): router gates in
fp32 by themselves (GLM-4 MoE, MiniMax-M2) or under the model-config attribute ``router_fp32``
(DeepSeek's ``MoEGate``, through ``--json-model-override-args``); Qwen2/Qwen3 norms under
``--rl-on-policy-target fsdp``; every other kept tensor in the model dtype, which no setting
changes. Its weight updates: :mod:`.sglang_update`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from fsdp_precision._base.dtypes import dtype_name
from fsdp_precision._base.errors import EngineDtypeError
from fsdp_precision._edges.layouts import unwrapped_class
from fsdp_precision._engines.kept import EngineKept, kept_of_export, kept_of_stream

__all__ = [
    "ARCHITECTURES",
    "READ_SGLANG",
    "Hold",
    "SGLangSettings",
    "sglang_settings",
]

logger = logging.getLogger(__name__)

#: The SGLang releases whose source :data:`ARCHITECTURES` and the update format were read from
#: (``sglang/srt/models/*.py``, ``sglang/srt/weight_sync/tensor_bucket.py``); not run here.
READ_SGLANG = ("0.5.23",)

#: A setting of SGLang: the model-config attribute ``router_fp32``, ``--rl-on-policy-target
#: fsdp``, ``--enable-fp32-lm-head``.
Knob = Literal["router_fp32", "rl_on_policy_target", "fp32_lm_head"]

fp32 = torch.float32


@dataclass(frozen=True)
class Hold:
    """How SGLang holds the checkpoint tensors whose names match ``pattern``.

    Attributes:
        pattern: A regular expression over a Hugging Face checkpoint name (whole name).
        dtype: What SGLang allocates them in (``None``: the model dtype, ``--dtype``).
        knob: The setting that makes it so (``None``: SGLang does it by itself).
        where: The SGLang source that does it (file: class).
        config: ``(attribute, value)``: SGLang holds them only where the model's config has it
            (``None``: always).
        tied_head: The tensor is the LM head too where the config ties the embeddings
            (``tie_word_embeddings``): its logits then need ``--enable-fp32-lm-head``.
    """

    pattern: str
    dtype: torch.dtype | None
    knob: Knob | None
    where: str
    config: tuple[str, object] | None = None
    tied_head: bool = False


_L = r"model\.layers\.\d+\."
_NORMS = _L + r"(input_layernorm|post_attention_layernorm)\.weight"
_RL: Knob = "rl_on_policy_target"
# fmt: off
_HEAD = Hold(r"lm_head\.weight", None, None, "ParallelLMHead; --enable-fp32-lm-head computes "
             "the logits in fp32 from it, it does not hold the weight in fp32")
_DEEPSEEK = (
    Hold(_L + r"mlp\.gate\.weight", fp32, "router_fp32", "deepseek_v2.py: MoEGate"),
    Hold(_L + r"mlp\.gate\.e_score_correction_bias", fp32, None, "deepseek_v2.py: MoEGate",
         ("topk_method", "noaux_tc")),
    _HEAD,
)
_QWEN2 = (
    Hold(r"model\.embed_tokens\.weight", fp32, _RL, "qwen2.py: Qwen2Model", tied_head=True),
    Hold(r"model\.norm\.weight", fp32, _RL, "qwen2.py: Qwen2Model"),
)

#: Architectures (``config.json``'s ``architectures``) and how SGLang holds the tensors training
#: may keep: in another dtype than the model's, by itself or with a knob, or in the model dtype
#: (listed where the reason is worth naming). A kept tensor no entry matches is held in the
#: model dtype; an architecture not listed holds nothing kept (refused).
ARCHITECTURES: dict[str, tuple[Hold, ...]] = {
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "DeepseekV32ForCausalLM": _DEEPSEEK,
    "GlmMoeDsaForCausalLM": _DEEPSEEK,  # glm4_moe.py: a DeepseekV2ForCausalLM
    "Glm4MoeForCausalLM": (
        Hold(_L + r"mlp\.gate\.(weight|e_score_correction_bias)", fp32, None,
             "glm4_moe.py: Glm4MoeGate"),
        _HEAD,
    ),
    "MiniMaxM2ForCausalLM": (
        Hold(_L + r"block_sparse_moe\.gate\.weight", fp32, None, "minimax_m2.py: MiniMaxM2MoE"),
        Hold(_L + r"block_sparse_moe\.e_score_correction_bias", fp32, None,
             "minimax_m2.py: MiniMaxM2MoE", ("use_routing_bias", True)),
        _HEAD,
    ),
    "Qwen2ForCausalLM": (
        *_QWEN2,
        Hold(_NORMS, None, None, "qwen2.py: Qwen2DecoderLayer, --rl-on-policy-target or not"),
        _HEAD,
    ),
    "Qwen3ForCausalLM": (
        *_QWEN2,
        Hold(_NORMS, fp32, _RL, "qwen3.py: Qwen3DecoderLayer"),
        Hold(_L + r"self_attn\.(q_norm|k_norm)\.weight", fp32, _RL, "qwen3.py: Qwen3Attention"),
        _HEAD,
    ),
    "Qwen3MoeForCausalLM": (
        Hold(_L + r"mlp\.gate\.weight", None, None, "qwen3_moe.py: Qwen3MoeSparseMoeBlock"),
        _HEAD,
    ),
    "Qwen2MoeForCausalLM": (
        Hold(_L + r"mlp\.(shared_expert_)?gate\.weight", None, None,
             "qwen2_moe.py: Qwen2MoeSparseMoeBlock"),
        _HEAD,
    ),
    "MixtralForCausalLM": (
        Hold(_L + r"block_sparse_moe\.gate\.weight", None, None, "mixtral.py: MixtralMoE"),
        _HEAD,
    ),
    "OlmoeForCausalLM": (Hold(_L + r"mlp\.gate\.weight", None, None, "olmoe.py: OlmoeMoE"), _HEAD),
    "GptOssForCausalLM": (
        Hold(_L + r"mlp\.router\.(weight|bias)", None, None, "gpt_oss.py: GptOssSparseMoeBlock"),
        _HEAD,
    ),
    "LlamaForCausalLM": (Hold(_NORMS, None, None, "llama.py: LlamaDecoderLayer"), _HEAD),
}
# fmt: on

#: What each knob changes besides the kept tensors (read in :data:`READ_SGLANG`).
KNOB_EFFECTS: dict[Knob, str] = {
    "router_fp32": (
        "router_fp32 (a model-config attribute) changes MoEGate only: its weight allocated in "
        "fp32, its logits computed from fp32 inputs (deepseek_v2.py: MoEGate.forward)"
    ),
    "rl_on_policy_target": (
        "--rl-on-policy-target fsdp also turns on deterministic inference (batch-invariant "
        "kernels, the 'pytorch' sampling backend, an attention backend among fa3, fa4, "
        "flashinfer and triton, no radix cache with flashinfer; arg_groups/attention_hook.py: "
        "handle_deterministic_inference); allocates Qwen2/Qwen3's embed_tokens in fp32 (and a "
        "tied LM head with it); keeps Qwen3's residual stream and the final norm's output in "
        "fp32 (training's kept norms cast their outputs back to the bulk dtype); casts attention "
        "and MLP inputs to bfloat16; computes the logits bfloat16 x bfloat16 unless "
        "--enable-fp32-lm-head; and logprobs by log_softmax of bfloat16 logits (sampler.py)"
    ),
    "fp32_lm_head": (
        "--enable-fp32-lm-head computes the logits in fp32 (hidden states and LM head weight "
        "upcast: layers/logits_processor.py); the weight stays in the dtype it is held in"
    ),
}

_FIX = (
    "Export the model without keeping these tensors, or serve it with vLLM, whose "
    "fsdp-precision plugin builds kept routers and norms in their dtype (docs/after-training.md)"
)


@dataclass(frozen=True)
class SGLangSettings:
    """The SGLang launch settings that make it hold what training kept.

    Attributes:
        architecture: The model's architecture (``config.json``'s ``architectures[0]``).
        dtype: ``--dtype``: the bulk's dtype (``None``: no record, SGLang's default).
        model_override: ``--json-model-override-args``: model-config attributes to set.
        rl_on_policy_target: ``--rl-on-policy-target`` (``None``: not set).
        enable_fp32_lm_head: ``--enable-fp32-lm-head``.
        held: Each kept tensor -> the dtype SGLang holds it in and what makes it so.
        notes: What the settings change besides the kept tensors.
    """

    architecture: str
    dtype: str | None = None
    model_override: Mapping[str, Any] = field(default_factory=dict)
    rl_on_policy_target: str | None = None
    enable_fp32_lm_head: bool = False
    held: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``sglang.Engine(model_path=..., **kwargs)``."""
        kwargs: dict[str, Any] = {}
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if self.model_override:
            kwargs["json_model_override_args"] = json.dumps(dict(self.model_override))
        if self.rl_on_policy_target is not None:
            kwargs["rl_on_policy_target"] = self.rl_on_policy_target
        if self.enable_fp32_lm_head:
            kwargs["enable_fp32_lm_head"] = True
        return kwargs

    def server_args(self) -> list[str]:
        """Arguments of ``python -m sglang.launch_server --model-path DIR ...``."""
        args: list[str] = []
        for key, value in self.engine_kwargs().items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args


def sglang_settings(
    source: str | os.PathLike[str] | EngineKept | Any, *, config: object = None
) -> SGLangSettings:
    """The SGLang settings that hold every tensor ``source`` keeps as training kept it.

    ``source``: an export directory (its record and ``config.json`` are read; one without the
    record needs no setting), an :class:`EngineKept`, or a :class:`~fsdp_precision.WeightStream`
    (then ``config`` is required: the model itself, whose class names the architecture,
    ``model.config``, ``config.json`` as a dict, or the architecture's name). Raises
    :class:`~fsdp_precision.EngineDtypeError` naming every kept tensor SGLang would hold in
    another dtype, before anything starts."""
    if isinstance(source, (str, os.PathLike)):
        found = kept_of_export(source)
        cfg = _config_of(config if config is not None else Path(source) / "config.json")
        if found is None:
            return SGLangSettings(_architecture(cfg))
        return _settings(found, cfg)
    if config is None:
        raise TypeError("config=None; pass the model, model.config, config.json or its name")
    kept = source if isinstance(source, EngineKept) else kept_of_stream(source)
    return _settings(kept, _config_of(config))


def _config_of(config: object) -> dict[str, Any]:
    if isinstance(config, Path):
        try:
            config = json.loads(config.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"'{config}' cannot be read as JSON ({err}); pass config=") from err
    if isinstance(config, str):
        return {"architectures": [config]}
    if isinstance(config, nn.Module):  # the model: its class is the architecture
        inner = _config_of(getattr(config, "config", {}))
        return {**inner, "architectures": [unwrapped_class(config).__name__]}
    to_dict = getattr(config, "to_dict", None)
    found = dict(config) if isinstance(config, Mapping) else to_dict() if callable(to_dict) else 0
    if not isinstance(found, dict):
        raise TypeError(f"config={config!r}; pass the model, model.config, config.json or a name")
    return dict(found)


def _architecture(cfg: Mapping[str, Any]) -> str:
    names = cfg.get("architectures")
    if not (isinstance(names, list) and names and isinstance(names[0], str)):
        raise ValueError(
            f"the config's architectures is {names!r}; pass config=model or config='ArchName'"
        )
    return names[0]


def _settings(kept: EngineKept, cfg: Mapping[str, Any]) -> SGLangSettings:
    architecture = _architecture(cfg)
    refused: dict[str, list[str]] = {}
    held: dict[str, str] = {}
    knobs: set[Knob] = set()
    for name, dtype in kept.tensors.items():
        if dtype == kept.bulk:  # kept, but in the bulk's dtype (a stream with cast_kept=True)
            held[name] = f"{dtype_name(dtype)}, the model dtype"
            continue
        holds = ARCHITECTURES.get(architecture)
        hold = next((h for h in holds or () if re.fullmatch(h.pattern, name)), None)
        why = _refusal(hold, dtype, kept.bulk, cfg, architecture, known=holds is not None)
        if why is not None or hold is None or hold.dtype is None:
            refused.setdefault(str(why), []).append(name)
            continue
        held[name] = f"{dtype_name(dtype)}, {_SETTING[hold.knob]} ({hold.where})"
        knobs.update([hold.knob] if hold.knob else [])
        if hold.tied_head and cfg.get("tie_word_embeddings") is True:
            knobs.add("fp32_lm_head")  # the head is this tensor: its logits from it in fp32
            held[name] += "; the tied LM head's logits in float32 (--enable-fp32-lm-head)"
    if refused:
        shown = "; ".join(f"{', '.join(names)}: {why}" for why, names in refused.items())
        where = f"SGLang cannot hold what training kept ({kept.source})"
        raise EngineDtypeError(f"{where}: {shown}. {_FIX}")
    settings = SGLangSettings(
        architecture=architecture,
        dtype=dtype_name(kept.bulk),
        model_override={"router_fp32": True} if "router_fp32" in knobs else {},
        rl_on_policy_target="fsdp" if "rl_on_policy_target" in knobs else None,
        enable_fp32_lm_head="fp32_lm_head" in knobs,
        held=held,
        notes=tuple(KNOB_EFFECTS[k] for k in sorted(knobs)),
    )
    if kept.tensors:
        args = " ".join(settings.server_args())
        logger.info("fsdp-precision: %s, held by SGLang with %s", kept.describe(), args)
    return settings


_SETTING: dict[Knob | None, str] = {
    None: "by itself",
    "router_fp32": "with --json-model-override-args '{\"router_fp32\": true}'",
    "rl_on_policy_target": "with --rl-on-policy-target fsdp",
    "fp32_lm_head": "with --enable-fp32-lm-head",
}


def _refusal(
    hold: Hold | None,
    dtype: torch.dtype,
    bulk: torch.dtype,
    cfg: Mapping[str, Any],
    architecture: str,
    known: bool,
) -> str | None:
    """Why SGLang cannot hold a tensor kept in ``dtype`` as ``hold`` says (``None``: it can)."""
    kept = dtype_name(dtype)
    if not known:
        return (
            f"fsdp-precision does not know how SGLang's {architecture} holds tensors "
            f"(ARCHITECTURES, read in SGLang {', '.join(READ_SGLANG)})"
        )
    if hold is None or hold.dtype is None:
        where = f" ({hold.where})" if hold is not None else ""
        return (
            f"SGLang's {architecture} allocates them in the model dtype, {dtype_name(bulk)}"
            f"{where}, training kept them in {kept}; no SGLang setting changes that"
        )
    if hold.config is not None and cfg.get(hold.config[0], hold.config[1]) != hold.config[1]:
        key, value = hold.config
        return f"SGLang's {hold.where} has them only with {key}={value!r}, not {cfg[key]!r}"
    if hold.dtype != dtype:
        return f"SGLang's {hold.where} holds them in {dtype_name(hold.dtype)}, training in {kept}"
    if hold.knob == "rl_on_policy_target" and bulk != torch.bfloat16:
        return (
            f"SGLang holds them in {kept} only under --rl-on-policy-target, which casts "
            f"activations to bfloat16 (qwen2.py, qwen3.py); the bulk is {dtype_name(bulk)}"
        )
    return None
