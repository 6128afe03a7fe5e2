"""vLLM's CPU build returns the experts its MoE layers routed to, as vLLM returns them on a GPU.

The user's code is vLLM's own: ``LLM(..., enable_return_routed_experts=True)`` and
``CompletionOutput.routed_experts``; the library's plugin (:mod:`fsdp_precision._engines.vllm.
routes`) gives vLLM's capture the model runner the CPU build runs. Runs in vLLM's real runtime
(its CPU build, in ``.venv-vllm``; elsewhere it skips), the engine in this process.

The model: a tiny Qwen3-MoE (bf16, as released) whose first layer is dense (``mlp_only_layers``),
so the format's absolute layer rows are visible. What vLLM selected is observed, not inferred: a
forward hook on each layer's router (``GateLinear``) records the logits vLLM routed on, and the
returned ids must be vLLM's top-k of those logits for every token and layer. A compiled engine
(the CPU build's default, where hooks do not run) is checked against the eager one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engines.vllm_runtime import import_vllm

vllm = import_vllm()

from fsdp_precision._engines.vllm import routes  # noqa: E402

pytestmark = pytest.mark.integration
LAYERS, EXPERTS, TOP_K = 3, 8, 2


def prompt(seed: int, length: int) -> dict[str, list[int]]:
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))
    return {"prompt_token_ids": ids.tolist()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE base checkpoint at tiny size, its layer 0 dense."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        max_position_embeddings=128, intermediate_size=128, moe_intermediate_size=32,
        head_dim=32, num_key_value_heads=1, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        mlp_only_layers=[0],
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen3_moe_dense0") / "base"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def engine(path: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("enforce_eager", True)  # the router hooks see every forward
    return vllm.LLM(
        model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, seed=0,
        block_size=32, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Any:
    return engine(checkpoint, enable_return_routed_experts=True)


def runner_of(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.model_runner


def routers_of(llm: Any) -> dict[int, Any]:
    """Each MoE layer's router object, by absolute layer index."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return {
        m.layer_id: m.router for m in runner_of(llm).model.modules() if isinstance(m, MoERunner)
    }


class GateLogits:
    """The logits each MoE layer's router computed, one tensor per forward, in order."""

    def __init__(self, llm: Any) -> None:
        self.gates = {
            int(name.split(".")[2]): module
            for name, module in runner_of(llm).model.named_modules()
            if name.endswith(".mlp.gate")
        }
        self.seen: dict[int, list[torch.Tensor]] = {i: [] for i in self.gates}

    def __enter__(self) -> GateLogits:
        def hook(layer: int) -> Any:
            def record(module: Any, args: Any, output: Any) -> None:
                logits = output[0] if isinstance(output, tuple) else output
                self.seen[layer].append(logits.detach().clone())

            return record

        self.handles = [g.register_forward_hook(hook(i)) for i, g in self.gates.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def selected(self) -> dict[int, torch.Tensor]:
        """vLLM's own selection over what the routers computed: ``[tokens, top_k]`` per layer
        (the CPU router's ``torch.topk`` of the logits, sorted per token)."""
        return {
            layer: torch.topk(torch.cat(seen), TOP_K, dim=-1, sorted=False)[1].sort(-1).values
            for layer, seen in self.seen.items()
        }


def generate_one(llm: Any, request: dict[str, list[int]], **params: Any) -> tuple[Any, GateLogits]:
    """One request alone (each forward's rows are its tokens), its router logits recorded."""
    with GateLogits(llm) as logits:
        (out,) = llm.generate(
            [request], vllm.SamplingParams(temperature=0, **params), use_tqdm=False
        )
    return out, logits


def test_the_plugin_binds_vllm_capture_to_every_moe_router(llm: Any) -> None:
    assert routes.installed() and not routes.UNAVAILABLE
    routers = routers_of(llm)
    assert sorted(routers) == [1, 2]  # layer 0 is dense
    assert all(r.capture_fn is not None for r in routers.values())
    assert getattr(runner_of(llm), "_fsdp_precision_routes", None) is not None


@pytest.mark.parametrize(
    ("length", "params"),
    [(24, {"max_tokens": 1, "prompt_logprobs": 0}), (13, {"max_tokens": 6, "ignore_eos": True})],
    ids=["prompt_logprobs", "generation"],
)
def test_routes_in_vllm_format_are_what_vllm_selected(
    llm: Any, length: int, params: dict[str, Any]
) -> None:
    request = prompt(100 + length, length)  # fresh tokens: nothing from the prefix cache
    out, logits = generate_one(llm, request, **params)
    generated = len(out.outputs[0].token_ids)
    assert generated == params["max_tokens"]
    routed = out.outputs[0].routed_experts
    assert isinstance(routed, np.ndarray)
    # vLLM's format: [prompt + generated - 1, num_hidden_layers, top_k], uint8 up to 256 experts
    assert routed.shape == (length + generated - 1, LAYERS, TOP_K)
    assert routed.dtype == np.uint8
    assert not routed[:, 0].any()  # the dense layer's rows are zero
    # every token (prompt rows, then each generated token fed back), every MoE layer: vLLM's
    # top-k of the logits its router computed
    selected = logits.selected()
    assert sorted(selected) == [1, 2]
    for layer, ids in selected.items():
        assert ids.shape == (length + generated - 1, TOP_K)
        got = torch.from_numpy(routed[:, layer].astype(np.int64)).sort(-1).values
        assert torch.equal(got, ids), f"layer {layer}: {(got != ids).any(-1).nonzero()}"
    assert len({tuple(r) for r in routed[:, 1]}) > 1  # routing varies: not a constant


def test_a_batch_gets_each_request_its_own_rows_and_cached_prefixes_their_routes(
    llm: Any,
) -> None:
    requests = [prompt(200 + i, 24 + 12 * i) for i in range(3)]
    params = vllm.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    first = llm.generate(requests, params, use_tqdm=False)
    for request, out in zip(requests, first, strict=True):
        routed = out.outputs[0].routed_experts
        assert routed.shape == (len(request["prompt_token_ids"]) + 2, LAYERS, TOP_K)
        assert not routed[:, 0].any() and (routed[:, 1:] < EXPERTS).all()
    # alone, the same requests route the same (their full blocks now from vLLM's prefix cache)
    for request, out in zip(requests, first, strict=True):
        (again,) = llm.generate([request], params, use_tqdm=False)
        np.testing.assert_array_equal(
            again.outputs[0].routed_experts, out.outputs[0].routed_experts
        )


def test_vllm_per_request_prompt_start_drops_the_leading_prompt_rows(llm: Any) -> None:
    request, start = prompt(500, 20), 8
    params = {"max_tokens": 3, "ignore_eos": True}
    (skipped,) = llm.generate(
        [request],
        vllm.SamplingParams(temperature=0, routed_experts_prompt_start=start, **params),
        use_tqdm=False,
    )
    full, _ = generate_one(llm, request, **params)
    routed = skipped.outputs[0].routed_experts
    assert routed.shape == (20 + 3 - 1 - start, LAYERS, TOP_K)
    np.testing.assert_array_equal(routed, full.outputs[0].routed_experts[start:])


def test_the_capture_is_not_installed_on_a_vllm_it_was_not_written_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert routes._unchecked() == []  # this vLLM: tested release, sources as recorded
    target = next(iter(routes.SOURCES))
    monkeypatch.setitem(routes.SOURCES, target, "0" * 64)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv("FSDP_PRECISION_ALLOW_UNTESTED_VLLM", raising=False)
    reasons = routes._unchecked()
    assert len(reasons) == 2
    assert "vLLM 0.99.0 is outside the releases" in reasons[0]
    assert f"{target} (sha256 " in reasons[1]


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> Iterator[Any]:
    yield engine(checkpoint)


def test_negative_control_off_by_default_nothing_is_captured(plain: Any) -> None:
    assert routes.installed()  # the plugin's patch is in this process, and stays inert
    out, _ = generate_one(plain, prompt(300, 16), max_tokens=3, ignore_eos=True)
    assert out.outputs[0].routed_experts is None
    routers = routers_of(plain)
    assert routers and all(r.capture_fn is None for r in routers.values())
    assert getattr(runner_of(plain), "_fsdp_precision_routes", None) is None


@pytest.fixture(scope="module")
def compiled(checkpoint: Path) -> Any:
    """The CPU build's default: the model traced and compiled at warm-up, before the KV cache."""
    return engine(checkpoint, enable_return_routed_experts=True, enforce_eager=False)


def test_a_compiled_engine_returns_the_routes_the_eager_one_does(llm: Any, compiled: Any) -> None:
    # compiled, vLLM traces its CPU router into the graph at warm-up, before its capture is
    # bound: without the plugin's op every row came back zero (the capture never ran). Its
    # kernels round differently from eager's, so a token whose logits nearly tie may route
    # otherwise (1 of 168 rows here): the rows are checked against the eager engine's, whose ids
    # are checked against its routers' logits above; chance agreement would be 1 row in 28.
    assert runner_of(compiled).vllm_config.compilation_config.mode != 0  # compiled
    assert runner_of(compiled).vllm_config.additional_config[routes.CACHE_KEY]  # cache keyed
    requests = [prompt(400 + i, 16 + 9 * i) for i in range(3)]
    params = vllm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    eager = llm.generate(requests, params, use_tqdm=False)
    same = total = 0
    for request, expected in zip(requests, eager, strict=True):
        (out,) = compiled.generate([request], params, use_tqdm=False)
        routed = out.outputs[0].routed_experts
        assert routed.shape == (len(request["prompt_token_ids"]) + 3, LAYERS, TOP_K)
        assert routed.dtype == np.uint8 and not routed[:, 0].any()
        moe, reference = (
            np.sort(routed[:, 1:], -1),
            np.sort(expected.outputs[0].routed_experts[:, 1:], -1),
        )
        same += int((moe == reference).all(-1).sum())
        total += moe.shape[0] * moe.shape[1]
    assert same >= 0.9 * total, f"{same} of {total} rows as the eager engine routed"


def test_without_the_capture_a_request_for_routes_is_refused_by_name(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes, "UNAVAILABLE", ["RuntimeError: vLLM 9.9 is outside the releases"])
    args = vllm.EngineArgs(
        model=str(checkpoint), skip_tokenizer_init=True, max_model_len=128,
        enable_return_routed_experts=True, enforce_eager=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"capture for it is not installed .*vLLM 9\.9.*TESTED"):
        args.create_engine_config()
