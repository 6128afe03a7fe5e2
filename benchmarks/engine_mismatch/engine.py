"""An engine's side, in a process of its own: vLLM (in-process engine, its CPU build) on the
held-out prompts, one at a time. Per prompt: the engine's logprob of each actual next token, the
experts it routed each token to (vLLM's own ``enable_return_routed_experts``) and, per MoE layer
(a forward hook on vLLM's router module, ``GateLinear``), the engine's top-2 experts and the
top-2 the trainer's fp32 router gives on the engine's own hidden states (the ablation: the
router's inputs are the engine's, only the router's precision differs).

    python -m engine_mismatch.engine EXPORT PROMPTS_JSON OUT_JSON TRAINED_EXPORT

Started by :func:`run_engine` on the export (kept: the plugin holds the gates in fp32) or on
:func:`stock_export` of it (stock: the gates in bf16, as stock vLLM holds them, and no record,
so the plugin leaves the model as vLLM builds it; on the CPU build it still drives vLLM's own
route capture, which vLLM 0.32 runs only on Model Runner V2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def stock_export(export: str, out: str) -> str:
    """A copy of ``export`` as stock vLLM would hold it: the router gates rounded to bf16 (what
    stock vLLM's bf16 ``GateLinear`` makes of the fp32 tensors on load) and no export record."""
    from safetensors.torch import load_file, save_file

    from fsdp_precision.checkpoint import EXPORT_RECORD

    Path(out).mkdir(parents=True, exist_ok=True)
    for path in Path(export).iterdir():
        if path.name == EXPORT_RECORD:
            continue
        if path.suffix == ".safetensors":
            tensors = {
                k: v.to(torch.bfloat16) if k.endswith("mlp.gate.weight") else v
                for k, v in load_file(str(path)).items()
            }
            save_file(tensors, str(Path(out) / path.name), metadata={"format": "pt"})
        else:
            (Path(out) / path.name).write_bytes(path.read_bytes())
    return out


def run_engine(export: str, prompts_json: str, out_json: str, kept: bool) -> dict[str, Any]:
    """Runs this module in a fresh interpreter on ``export`` (for ``kept``) or on its
    :func:`stock_export`, and returns what it wrote."""
    trained = export  # the trainer's fp32 gates, for the ablation
    if not kept:
        export = stock_export(export, str(Path(out_json).with_suffix("")) + "-stock-export")
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("VLLM_PLUGINS", None)
    command = [
        *(sys.executable, "-m", "engine_mismatch.engine"),
        *(export, prompts_json, out_json, trained),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        which = "kept" if kept else "stock"
        raise RuntimeError(f"the {which} engine failed:\n{done.stderr[-3000:]}")
    return json.loads(Path(out_json).read_text())  # type: ignore[no-any-return]


def trainer_gates(export: str) -> dict[int, torch.Tensor]:
    """The trainer's router weights as exported (kept: fp32), by layer."""
    from safetensors.torch import load_file

    gates: dict[int, torch.Tensor] = {}
    for path in sorted(Path(export).glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if name.endswith("mlp.gate.weight"):
                gates[int(name.split(".")[2])] = tensor
    return dict(sorted(gates.items()))


@torch.no_grad()
def engine_pass(export: str, prompts: list[list[int]], trained: str) -> dict[str, Any]:
    """The engine's logprobs, routes and top-2 experts on ``prompts``, and the ablation's top-2
    (the fp32 gates of the ``trained`` export on the engine's router inputs)."""
    import vllm

    from engine_mismatch.trainer import topk

    llm = vllm.LLM(
        model=export, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
        enforce_eager=True, seed=0, enable_return_routed_experts=True,
    )  # fmt: skip
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    gates = [m for m in model.modules() if isinstance(m, GateLinear)]
    fp32 = trainer_gates(trained)
    names = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("gate")})
    assert len(gates) == len(fp32), (len(gates), sorted(fp32), names)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        seen.append((args[0].detach().float().clone(), logits.detach().float().clone()))

    handles = [g.register_forward_hook(hook) for g in gates]
    params = vllm.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out: dict[str, Any] = {
        "vllm": vllm.__version__,
        "gate_dtype": str(gates[0].weight.dtype),
        "trainer_gate_dtype": str(fp32[0].dtype),
        "logprobs": [],
        "top2": [],
        "ablation_top2": [],
        "routes": [],
    }
    for prompt in prompts:
        seen.clear()
        result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        positions = result.prompt_logprobs[1:]
        out["routes"].append(result.outputs[0].routed_experts.tolist())
        out["logprobs"].append(
            [pos[tok].logprob for pos, tok in zip(positions, prompt[1:], strict=True)]
        )
        layers = seen[: len(gates)]
        assert all(h.shape[0] == len(prompt) for h, _ in layers), [h.shape for h, _ in layers]
        out["top2"].append([topk(logits).tolist() for _, logits in layers])
        out["ablation_top2"].append(
            [
                topk(torch.nn.functional.linear(h, fp32[i].float())).tolist()
                for i, (h, _) in enumerate(layers)
            ]
        )
    for handle in handles:
        handle.remove()
    return out


def main() -> None:
    """``EXPORT PROMPTS_JSON OUT_JSON TRAINED_EXPORT``: the engine pass, written as JSON."""
    export, prompts_json, out_json, trained = sys.argv[1:5]
    prompts = json.loads(Path(prompts_json).read_text())
    Path(out_json).write_text(json.dumps(engine_pass(export, prompts, trained)))


if __name__ == "__main__":
    main()
