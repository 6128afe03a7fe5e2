"""Does the inference engine route like the trainer? vLLM with kept routers against stock vLLM,
on a model trained long enough that routing is decided, on the tokens where precision decides.

    python benchmarks/bench_engine_parity.py [--steps 1500] [--prompts 48] [--gate-prompts 512]
        [--seq 128] [--json PATH] [--smoke]

Runs where vLLM is installed (here its CPU build, ``.venv-vllm``; ``.ci/run`` runs ``--smoke``
there). The trainer: a Qwen3-MoE from its transformers config (2 layers, 8 experts, top-2, hidden
64, bytes as tokens) trained on the interpreter's help text (``pydoc_data.topics``, the last 10%
held out) with FSDP2 on one gloo process, the router gates kept in fp32
(``Glob("*.mlp.gate.weight")``), AdamW; then exported (bulk bf16, gates fp32, the record).
On held-out prompts, the trainer's model (in the trainer's process, as it computes in training)
gives per MoE layer each token's router logits and top-2 experts, and each position's next-token
logprobs. The same prompts go through three engines: vLLM loading the export with the library
installed (its plugin keeps the routers), the same engine after ``update_weights`` from
``full_weights`` of the trained weights (an RL step's hand-off), and stock vLLM (the plugin off,
``VLLM_PLUGINS``, in a process of its own), which rounds the routers to bf16.

Reported per engine, two ways. **The router on the trainer's inputs**: each engine's own router
module (vLLM's ``GateLinear``, behind its CPU kernel) run on the hidden states the trainer's
routers received (``--gate-prompts`` held-out prompts through the trained model: the export loaded
by transformers with its routers restored, which computes the trainer's logits bit for bit), so
only the router's precision differs. **End to end**: the engine's own forward on ``--prompts``
prompts, its routers fed its own hidden states (vLLM's attention and bf16 kernels differ from
torch's by a few bf16 ulps, which moves near-ties on their own). For both, per MoE layer, the share
of tokens whose top-2 expert set is the trainer's: over all tokens and over the tokens where gate
precision decides: **bf16 ties** (the trainer's 2nd and 3rd router logits are equal once rounded
to bf16: a bf16 router cannot order them) and **rounding flips** (the trainer's top-2 changes when
its gate weight is rounded to bf16); end to end also the next-token argmax agreement and the mean
and largest |logprob difference| of the actual next token. ``--smoke``: 20 steps, 4 short prompts,
the same code path. Prints JSON.
"""

# ci-venv: .venv-vllm

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench_advice_training import corpus  # the same text, the same bytes-as-tokens

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BF16, FP32 = torch.bfloat16, torch.float32
TOP_K, EXPERTS = 2, 8


def build(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=256,
        router_aux_loss_coef=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=FP32)


def prompts_of(data: torch.Tensor, count: int, seq: int, seed: int = 123) -> list[list[int]]:
    held_out = data[int(0.9 * data.numel()) :]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, held_out.numel() - seq, (count,), generator=g)
    return [held_out[s : s + seq].tolist() for s in starts.tolist()]


def trainer(args: argparse.Namespace, out: str) -> dict[str, Any]:
    """In the trainer's process (one gloo rank): train, export, and compute the reference."""
    import fsdp_precision as fp
    from fsdp_precision.checkpoint import export_safetensors

    data = corpus()
    train = data[: int(0.9 * data.numel())]
    model = build(args.seed)
    rules = fp.PrecisionRules(rules=(fp.Glob("*.mlp.gate.weight"),), advice="off")
    fp.compile_param_dtype_maps(model, rules, [*model.model.layers, model]).apply()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(args.seed)
    start, losses = time.perf_counter(), []
    for _ in range(args.steps):
        starts = torch.randint(0, train.numel() - args.seq - 1, (8,), generator=g)
        ids = torch.stack([train[s : s + args.seq] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    train_seconds = time.perf_counter() - start
    export_safetensors(model, out, dtype=BF16)
    reference = reference_of(model, prompts_of(data, args.prompts, args.seq))
    reference["train"] = {
        "steps": args.steps, "seconds": train_seconds,
        "loss_first": losses[0], "loss_last": sum(losses[-20:]) / len(losses[-20:]),
    }  # fmt: skip
    return reference


@torch.no_grad()
def reference_of(model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    """Per prompt: each MoE layer's router logits (the trainer's fp32) and the same router on the
    same hidden states with its weight rounded to bf16; each position's logprobs."""
    from torch.distributed.tensor import DTensor

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        weight = module.weight
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight
        hidden = args[0].reshape(-1, full.shape[1]).float()
        logits = torch.nn.functional.linear(hidden, full.float())
        rounded = torch.nn.functional.linear(hidden, full.to(BF16).float())
        seen.append((logits, rounded))

    handles = [g.register_forward_hook(hook) for g in gates]
    model.eval()
    out: dict[str, Any] = {"layers": [], "logprobs": [], "argmax": []}
    for prompt in prompts:
        seen.clear()
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        out["layers"].append([(a.tolist(), b.tolist()) for a, b in seen])
        out["logprobs"].append(
            logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        )
        out["argmax"].append(logprobs[:-1].argmax(-1).tolist())
    for handle in handles:
        handle.remove()
    return out


@torch.no_grad()
def router_inputs(export: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per MoE layer, the inputs the trainer's routers receive on ``prompts`` (the trained model:
    the export loaded by transformers, its routers restored in fp32 with their boundary cast)."""
    model = stored(export)
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[list[torch.Tensor]] = [[] for _ in gates]
    handles = [
        g.register_forward_hook(
            lambda m, a, o, i=i: seen[i].append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for i, g in enumerate(gates)
    ]
    model.eval()
    for start in range(0, len(prompts), 16):
        model(input_ids=torch.tensor(prompts[start : start + 16]))
    for handle in handles:
        handle.remove()
    return [torch.cat(s).float() for s in seen]


@torch.no_grad()
def router_parity(
    gates: list[torch.nn.Module], export: str, inputs: list[torch.Tensor]
) -> list[dict[str, float]]:
    """Each engine router on the trainer's router inputs, against the trainer's fp32 router."""
    from safetensors.torch import load_file

    files: dict[str, torch.Tensor] = {}
    for path in sorted(Path(export).glob("*.safetensors")):
        files.update(load_file(str(path)))
    out = []
    for layer, (gate, x) in enumerate(zip(gates, inputs, strict=True)):
        weight = files[f"model.layers.{layer}.mlp.gate.weight"].float()
        logits = torch.nn.functional.linear(x, weight)
        rounded = torch.nn.functional.linear(x, weight.to(BF16).float())
        served = gate(x.to(BF16))
        served = (served[0] if isinstance(served, tuple) else served).float()
        out.append(agreement([(logits, rounded, served)]))
    return out


def agreement(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Top-2 agreement of served router logits with the trainer's, over all tokens, bf16 ties and
    rounding flips (``samples``: (trainer's fp32 logits, with the weight rounded, served))."""
    agree = {"all": [0, 0], "bf16_ties": [0, 0], "rounding_flips": [0, 0]}
    for logits, rounded, served in samples:
        same = (topk(logits) == topk(served)).all(-1)
        ranked = logits.sort(-1, descending=True).values
        ties = ranked[:, TOP_K - 1].to(BF16) == ranked[:, TOP_K].to(BF16)
        flips = ~(topk(logits) == topk(rounded)).all(-1)
        for key, mask in (
            ("all", torch.ones_like(same)),
            ("bf16_ties", ties),
            ("rounding_flips", flips),
        ):
            agree[key][0] += int((same & mask).sum())
            agree[key][1] += int(mask.sum())
    return {
        **{f"{k}_tokens": n for k, (_, n) in agree.items()},
        **{f"{k}_agree": (a / n if n else float("nan")) for k, (a, n) in agree.items()},
    }


def engine_run(
    export: str, prompts: list[list[int]], update: bool, gate_prompts: list[list[int]] | None = None
) -> dict[str, Any]:
    """The engine on ``prompts``, one at a time: each MoE layer's router logits (a hook on vLLM's
    gate), each position's actual-token logprob and argmax. ``update``: first hand it the
    trained weights through ``update_weights(full_weights(...))``."""
    import vllm

    llm = vllm.LLM(
        model=export, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
        enforce_eager=True, seed=0,
    )  # fmt: skip
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    if update:
        from fsdp_precision import full_weights
        from fsdp_precision.integrations.vllm import update_weights

        update_weights(llm, full_weights(stored(export)))
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[torch.Tensor] = []
    handles = [
        g.register_forward_hook(
            lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).float())
        )
        for g in gates
    ]
    params = vllm.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out: dict[str, Any] = {
        "class": type(model).__module__,
        "layers": [],
        "logprobs": [],
        "argmax": [],
    }
    for prompt in prompts:
        seen.clear()
        result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        out["layers"].append([t.tolist() for t in seen[: len(gates)]])
        positions = result.prompt_logprobs[1:]
        out["logprobs"].append(
            [pos[tok].logprob for pos, tok in zip(positions, prompt[1:], strict=True)]
        )
        out["argmax"].append(
            [next(t for t, lp in pos.items() if lp.rank == 1) for pos in positions]
        )
    for handle in handles:
        handle.remove()
    if gate_prompts:
        out["router"] = router_parity(gates, export, router_inputs(export, gate_prompts))
    return out


def stored(export: str) -> torch.nn.Module:
    """The trained weights as the trainer computed them, unwrapped: the export loaded by
    transformers (bulk bf16) with its kept routers put back in fp32 (``restore_kept``); the
    stream ``full_weights`` gives from it is the trainer's."""
    from transformers import AutoModelForCausalLM

    from fsdp_precision.checkpoint import restore_kept

    model = AutoModelForCausalLM.from_pretrained(export, dtype=BF16)
    restore_kept(model, export)
    return model


def topk(logits: torch.Tensor) -> torch.Tensor:
    return logits.topk(TOP_K, -1).indices.sort(-1).values


def compare(reference: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    per_layer = []
    for layer in range(len(reference["layers"][0])):
        samples = [
            (*(torch.tensor(t) for t in ref_prompt[layer]), torch.tensor(eng_prompt[layer]))
            for ref_prompt, eng_prompt in zip(reference["layers"], engine["layers"], strict=True)
        ]
        per_layer.append(agreement(samples))
    ref_lp = torch.tensor([x for p in reference["logprobs"] for x in p])
    eng_lp = torch.tensor([x for p in engine["logprobs"] for x in p])
    ref_arg = torch.tensor([x for p in reference["argmax"] for x in p])
    eng_arg = torch.tensor([x for p in engine["argmax"] for x in p])
    return {
        "engine_class": engine["class"],
        "router_on_trainer_inputs": engine.get("router"),
        "end_to_end_layers": per_layer,
        "argmax_agree": float((ref_arg == eng_arg).float().mean()),
        "logprob_abs_diff_mean": float((ref_lp - eng_lp).abs().mean()),
        "logprob_abs_diff_max": float((ref_lp - eng_lp).abs().max()),
    }


def stock_in_a_process(
    export: str, prompts: list[list[int]], gate_prompts: list[list[int]]
) -> dict[str, Any]:
    """Stock vLLM: the same, with the plugin off, in a fresh process."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([prompts, gate_prompts], f)
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import bench_engine_parity as b; "
        f"p, g = json.load(open({f.name!r})); "
        f"print(json.dumps(b.engine_run({export!r}, p, False, g)))"
    )
    env = {**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"stock vLLM failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from fsdp_precision.testing import launch

    workdir = Path(tempfile.mkdtemp(prefix="engine-parity-"))
    try:
        export = str(workdir / "export")
        reference = launch(trainer, (args, export), nproc=1, start_method="spawn")
        prompts = prompts_of(corpus(), args.prompts, args.seq)
        gate_prompts = prompts_of(corpus(), args.gate_prompts, args.seq, seed=7)
        engines = {
            "vllm_kept": engine_run(export, prompts, False, gate_prompts),
            "vllm_kept_after_update": engine_run(export, prompts, True, gate_prompts),
            "vllm_stock": stock_in_a_process(export, prompts, gate_prompts),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import vllm

    return {
        "benchmark": "engine_parity",
        "command": " ".join(["python", "benchmarks/bench_engine_parity.py", *sys.argv[1:]]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "train": reference["train"],
        "prompts": args.prompts,
        "gate_prompts": args.gate_prompts,
        "seq": args.seq,
        "results": {name: compare(reference, e) for name, e in engines.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--gate-prompts", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.prompts, args.gate_prompts, args.seq = 20, 4, 8, 32
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
