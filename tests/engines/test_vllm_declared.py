"""vLLM as RL frameworks start it: from the base checkpoint, told what the trainer keeps.

verl- and slime-style rollouts start vLLM from the base Hugging Face checkpoint (no export
record; often ``load_format="dummy"``) and stream the trainer's weights in every step. Here the
trainer declares what it keeps (``declare_kept``) and the launcher hands the file to vLLM through
its own configuration (``additional_config``) or ``FSDP_PRECISION_KEPT``: the routers are built
in fp32 from the start, and every later update must bring them in fp32 (a sync that casts the
state dict to the rollout dtype is refused by name on every path into the model). Also: pooling
(reward) models, fp16 serving, and a plugin whose registration fails or meets an untested vLLM:
stock models load untouched, kept ones are refused by name.

Runs in vLLM's CPU build (``.venv-vllm``), as ``test_vllm.py``, whose helpers it uses.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines.vllm_runtime import import_vllm  # noqa: E402

vllm = import_vllm()

from fsdp_precision import EngineDtypeError, full_weights  # noqa: E402
from fsdp_precision._engines.declaration import read_declaration  # noqa: E402
from fsdp_precision._engines.vllm.models import CACHE_KEY  # noqa: E402
from fsdp_precision.integrations import KEPT_ENV  # noqa: E402
from fsdp_precision.integrations.vllm import update_weights  # noqa: E402

from tests.engines.families import declare_family, export_family  # noqa: E402
from tests.engines.test_vllm import (  # noqa: E402
    file_tensors,
    in_processes,
    model_of,
    prompt_logprobs,
    read_back,
)

pytestmark = pytest.mark.integration
bf16, fp32 = torch.bfloat16, torch.float32
GATES = [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]


def start(path: Path, **overrides: Any) -> Any:
    """vLLM as test_vllm.py starts it, any argument overridden (``dtype``, ``runner``, ...)."""
    options = {"skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 128,
               "enforce_eager": True, "seed": 0, **overrides}  # fmt: skip
    return vllm.LLM(model=str(path), **options)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The base checkpoint (bf16, no record) and the trainer's declaration."""
    root = tmp_path_factory.mktemp("rl")
    kept = declare_family("qwen3_moe", root / "base", root / "kept.json")
    assert kept == dict.fromkeys(GATES, "float32")
    return root / "base", root / "kept.json"


def trainer(path: Path, seed: int) -> torch.nn.Module:
    """The trainer's model after an RL step: the base loaded by transformers (bulk bf16), its
    routers fp32 with new values bf16 cannot hold."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=bf16)
    g = torch.Generator().manual_seed(seed)
    for name in GATES:
        model.get_parameter(name).data = torch.randn(8, 64, generator=g) * 0.05
    return model


def routers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: model.get_parameter(n).detach().clone() for n in GATES}


@pytest.fixture(scope="module")
def declared_engine(base: tuple[Path, Path]) -> Any:
    path, declaration = base
    return start(path, additional_config={"fsdp_precision": str(declaration)})


def test_a_base_checkpoint_declared_through_vllms_config_holds_fp32_routers(
    base: tuple[Path, Path], declared_engine: Any
) -> None:
    model = model_of(declared_engine)
    gates = {n: m for n, m in model.named_modules() if n.endswith("mlp.gate")}
    assert {type(g).__name__ for g in gates.values()} == {"KeptGateLinear"}
    assert {(g.weight.dtype, g.out_dtype) for g in gates.values()} == {(fp32, fp32)}
    on_disk = file_tensors(base[0])  # the base stores its routers in bf16: widened exactly
    assert {on_disk[n].dtype for n in GATES} == {bf16}
    assert read_back(declared_engine, on_disk, dict.fromkeys(GATES, fp32)) == dict.fromkeys(GATES)
    config = declared_engine.llm_engine.vllm_config  # vLLM's compile cache is keyed by the plan
    assert config.additional_config[CACHE_KEY] == read_declaration(base[1]).digest()
    keyed = config.compute_hash()
    digest = config.additional_config.pop(CACHE_KEY)
    assert config.compute_hash() != keyed
    config.additional_config[CACHE_KEY] = digest
    step = trainer(base[0], seed=5)
    update_weights(declared_engine, full_weights(step))
    assert read_back(declared_engine, routers(step), dict.fromkeys(GATES, fp32)) == dict.fromkeys(
        GATES
    )


def test_the_environment_declares_a_dummy_loaded_engine(
    base: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_format="dummy"`` (no checkpoint read) and ``FSDP_PRECISION_KEPT``: the first
    weights arrive through vLLM's own ``reload_weights``, the routers exactly."""
    path, declaration = base
    monkeypatch.setenv(KEPT_ENV, str(declaration))
    llm = start(path, load_format="dummy")
    assert {m.weight.dtype for n, m in model_of(llm).named_modules() if n.endswith("mlp.gate")} == {
        fp32
    }
    step = trainer(path, seed=6)
    llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": iter(full_weights(step)), "is_checkpoint_format": True},
    )
    assert read_back(llm, routers(step), dict.fromkeys(GATES, fp32)) == dict.fromkeys(GATES)


def test_negative_control_the_base_without_a_declaration_rounds_the_routers(
    base: tuple[Path, Path],
) -> None:
    """The same launch without the declaration: vLLM's own numbers, routers bf16, and vLLM's
    ``reload_weights`` rounds the fp32 routers it is sent with no error."""
    llm = start(base[0])
    assert {m.weight.dtype for n, m in model_of(llm).named_modules() if n.endswith("mlp.gate")} == {
        bf16
    }
    step = trainer(base[0], seed=7)
    llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": iter(full_weights(step)), "is_checkpoint_format": True},
    )
    problems = read_back(llm, routers(step), dict.fromkeys(GATES, fp32))
    assert all(p is not None and "bfloat16" in p for p in problems.values()), problems


def rounded(step: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a sync that casts the state dict to the rollout dtype sends: every tensor bf16."""
    return [(n, t.float().mul(1.001).to(bf16)) for n, t in full_weights(step) if n in GATES]


@pytest.mark.parametrize("path", ["update_weights", "reload_weights", "load_weights"])
def test_a_router_sent_in_bf16_is_refused_by_name_on_every_path(
    base: tuple[Path, Path], path: str
) -> None:
    """The library's ``update_weights``, vLLM's ``reload_weights``, and the model's own
    ``load_weights`` one tensor at a time (TRL's colocated sync): refused, nothing loaded."""
    declared_engine = start(base[0], additional_config={"fsdp_precision": str(base[1])})
    before = prompt_logprobs(declared_engine)
    weights = rounded(trainer(base[0], seed=8))
    with pytest.raises(
        EngineDtypeError, match=r"model.layers.0.mlp.gate.weight: sent in bfloat16, kept in float32"
    ):
        if path == "update_weights":
            update_weights(declared_engine, weights)
        elif path == "reload_weights":
            declared_engine.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True},
            )
        else:
            for name, tensor in weights:
                model_of(declared_engine).load_weights([(name, tensor)])
    assert torch.equal(prompt_logprobs(declared_engine), before)


def reward_model(out: Path) -> None:
    """A kept Qwen2 export made a reward model, as a reward/critic checkpoint is laid out:
    ``Qwen2ForRewardModel`` and its ``score`` head."""
    from safetensors.torch import save_file

    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["Qwen2ForRewardModel"]
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    head = {
        "score.0.weight": torch.randn(64, 64, generator=g),
        "score.2.weight": torch.randn(1, 64),
    }
    save_file({k: v.to(bf16) for k, v in head.items()}, str(out / "score.safetensors"))


def test_a_reward_model_holds_its_kept_norms(tmp_path: Path) -> None:
    out = tmp_path / "export"
    kept = export_family("qwen2", out)
    assert kept and all(n.endswith("norm.weight") for n in kept)
    reward_model(out)
    llm = start(out, runner="pooling")
    model = model_of(llm)
    assert type(model).__name__ == "Qwen2ForRewardModel"
    assert type(model).__module__ == "fsdp_precision._engines.vllm.models"
    files = file_tensors(out)
    assert read_back(llm, files, dict.fromkeys(kept, fp32)) == dict.fromkeys(kept)
    (scores,) = llm.encode([{"prompt_token_ids": list(range(1, 9))}], pooling_task="token_classify")
    assert torch.isfinite(torch.as_tensor(scores.outputs.data)).all()


def build_error(path: str, overrides: str) -> dict[str, str]:
    """The error starting ``path`` with ``overrides`` (JSON) raised (``{}``: none)."""
    try:
        start(Path(path), **json.loads(overrides))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"type": type(err).__name__, "message": str(err)}
    return {}


BREAKAGES = ["registry", "owned", "version"]


@pytest.fixture(scope="module")
def refusals(
    base: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Any]]:
    """The module's starts that fail on purpose, each in a process of its own (a failed start
    leaves vLLM's process-wide groups torn down), started together (``in_processes``): a Phi-3
    export as a pooling model, and a kept Qwen3-MoE export beside the stock base under each
    breakage of :func:`launch_with_a_broken_vllm`."""
    root = tmp_path_factory.mktemp("refusals")
    export_family("phi3", root / "phi3")
    export_family("qwen3_moe", root / "qwen3_moe")
    own = {"module": "test_vllm_declared"}
    calls: dict[str, tuple[Any, ...]] = {
        "pooling": ("build_error", str(root / "phi3"), json.dumps({"runner": "pooling"}), own)
    }
    for breakage in BREAKAGES:
        calls[breakage] = (
            "launch_with_a_broken_vllm", str(root / "qwen3_moe"), str(base[0]), breakage,
            {**own, "plugin": False},
        )  # fmt: skip
    return in_processes(calls)


def test_an_uncovered_pooling_model_is_refused_by_name(refusals: dict[str, Future[Any]]) -> None:
    """Served with ``runner="pooling"`` a model builds no ``LogitsProcessor``; the guard sits
    on the embedding every text model builds."""
    error = refusals["pooling"].result()
    assert error.get("type") == "EngineDtypeError", error
    assert "which fsdp-precision's vLLM integration does not build" in error["message"]


def test_a_kept_norm_model_serves_in_fp16(tmp_path: Path) -> None:
    """Trained in bf16, served in fp16: the kept norms cast back to the engine's dtype."""
    out = tmp_path / "export"
    kept = export_family("llama", out)
    llm = start(out, dtype="float16")
    assert read_back(llm, file_tensors(out), dict.fromkeys(kept, fp32)) == dict.fromkeys(kept)
    params = vllm.SamplingParams(max_tokens=4, temperature=0)
    (result,) = llm.generate([{"prompt_token_ids": list(range(1, 9))}], params, use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 4


def launch_with_a_broken_vllm(export: str, stock: str, breakage: str) -> dict[str, Any]:
    """In a process where vLLM did not load the plugin: break a vLLM internal the plugin uses
    (``registry``), let another plugin own the router's layer slot first (``owned``), or make
    vLLM a release the integration was not run against (``version``),
    then register as vLLM would and start a stock model, then the kept export."""
    from vllm.model_executor.models.registry import ModelRegistry

    from fsdp_precision._engines.vllm.plugin import register

    def moved(*args: Any, **kwargs: Any) -> None:
        raise AttributeError("'_ModelRegistry' object has no attribute 'register_model'")

    if breakage == "registry":
        ModelRegistry.register_model = moved
    elif breakage == "owned":  # a platform plugin registered its own router first
        from vllm.model_executor.custom_op import PluggableLayer
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

        class PlatformGateLinear(GateLinear):  # type: ignore[misc]
            pass

        PluggableLayer.register_oot(name="GateLinear")(PlatformGateLinear)
    else:
        vllm.__version__ = "0.99.0"
    register()  # never raises
    stock_model = model_of(start(Path(stock)))
    result: dict[str, Any] = {
        "stock_gates": sorted(
            str(m.weight.dtype) for n, m in stock_model.named_modules() if n.endswith("mlp.gate")
        ),
    }
    result.update(build_error(export, "{}"))
    return result


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_broken_registration_or_untested_vllm_refuses_kept_models_only(
    refusals: dict[str, Future[Any]], breakage: str
) -> None:
    result = refusals[breakage].result()
    assert result["stock_gates"] == ["torch.bfloat16", "torch.bfloat16"]  # stock loads
    assert result.get("type") == "EngineDtypeError", result
    if breakage == "registry":
        assert "could not register what holds them" in result["message"]
        assert "register_model" in result["message"]
    elif breakage == "owned":
        assert "another vLLM plugin replaced GateLinear" in result["message"]
    else:
        assert "vLLM 0.99.0 is outside the releases" in result["message"]
        assert "FSDP_PRECISION_ALLOW_UNTESTED_VLLM=1" in result["message"]
