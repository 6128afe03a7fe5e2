"""What the vLLM integration knows, as data: the architectures it builds, the releases it was
run against, and the builds' expert kernels whose update path it repairs.

Every MoE family vLLM implements builds its router as a ``GateLinear`` (read in vLLM 0.32:
``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``, ``deepseek_v2``, ``gpt_oss``, ``phimoe``,
``granitemoe``, ``jamba``, ``dbrx``, ``llama4``, ``qwen3_next``, ``glm4_moe``, ``minimax_m2``,
``ernie45_moe``, ...), so one replacement of that layer keeps every family's gates; what differs
per architecture is only the model class that names them (its ``hf_to_vllm_mapper``), read from
the class itself. An architecture listed here gets the integration's model class (the engine's
own, subclassed: kept tensors allocated, checked after every load, refused by name where the
engine cannot hold them); one that is not, holding a kept tensor, is refused when it is built.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "REPACKED_EXPERTS", "TESTED_VLLM", "UNTESTED_ENV", "tested"]

#: Architectures (``config.json``'s ``architectures``) whose vLLM model class the integration
#: subclasses. ``True``: run in this project's tests on vLLM's CPU build, at tiny sizes
#: (``tests/engines/test_vllm_families.py``); ``False``: built the same way, not run here.
ARCHITECTURES: dict[str, bool] = {
    # MoE: gates computed in the model dtype by transformers and by vLLM
    "Qwen3MoeForCausalLM": True,
    "Qwen2MoeForCausalLM": True,
    "MixtralForCausalLM": True,
    "OlmoeForCausalLM": True,
    "DeepseekV2ForCausalLM": False,
    "DeepseekV3ForCausalLM": False,
    "GptOssForCausalLM": False,
    "PhiMoEForCausalLM": False,
    "GraniteMoeForCausalLM": False,
    "Qwen3NextForCausalLM": False,
    # MoE whose gates vLLM allocates in fp32 already (the integration checks, converts nothing)
    "Glm4MoeForCausalLM": False,
    # dense: kept norms
    "LlamaForCausalLM": True,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": True,
    "MistralForCausalLM": False,
    # pooling: reward and process-reward models (kept norms); a causal LM served with
    # runner="pooling" is vLLM's adapter over the class above, covered with it
    "Qwen2ForRewardModel": True,
    "Qwen2ForProcessRewardModel": False,
}

#: vLLM releases the integration was run against (``tests/engines``, vLLM's CPU build); a kept
#: model on another minor release is refused by name (stock models load untouched) unless
#: :data:`UNTESTED_ENV` is ``1``. ``pyproject.toml``'s ``vllm`` extra pins the same range.
TESTED_VLLM = ("0.32.0",)
UNTESTED_ENV = "FSDP_PRECISION_ALLOW_UNTESTED_VLLM"


def tested(version: str) -> bool:
    """Whether vLLM ``version`` (``"0.32.0+cpu"``) is a minor release of :data:`TESTED_VLLM`."""
    minor = tuple(version.split("+")[0].split(".")[:2])
    return any(tuple(t.split(".")[:2]) == minor for t in TESTED_VLLM)


#: Expert kernels whose post-load processing vLLM's weight-update path skips (vLLM 0.32's
#: ``UnquantizedFusedMoEMethod._setup_kernel`` runs ``fused_experts.process_weights_after_loading``
#: on the first load only): after an update they would compute on the unprocessed layout. The
#: integration runs that processing again after an update; found, and checked bitwise against a
#: fresh load, for these classes.
REPACKED_EXPERTS = frozenset({"CPUUnquantizedExperts", "X86CPUUnquantizedExperts"})
