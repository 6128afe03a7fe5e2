"""TRL's GRPO with vLLM colocated, from the base checkpoint, told what the trainer keeps.

TRL 1.16's ``GRPOTrainer(args=GRPOConfig(use_vllm=True, vllm_mode="colocate"))`` builds the
engine itself (``LLM(model=model.name_or_path, distributed_executor_backend=
"external_launcher", ...)``: no ``dtype``, no ``additional_config``), so the declaration reaches
vLLM through ``FSDP_PRECISION_KEPT``. Every step (the first at step 0) its ``sync_weights`` walks
the trainer's parameters (``VLLMGeneration._iter_named_params``: fp32 masters, Hugging Face
names) and calls the model's own ``load_weights([(name, tensor)])`` one tensor at a time.

What runs here is TRL's own code on a real vLLM (its CPU build), nothing mocked: the trainer
built by TRL, the engine built by TRL, TRL's parameter walk and TRL's load call. vLLM's CPU build
stops TRL's sync at the first attention projection, for every model, kept or not: once loaded,
its linear weights are prepacked for oneDNN (the parameter left is empty), so ``load_weights``
fails on ``q_proj``/``k_proj``/``v_proj`` (``'Parameter' object has no attribute
'weight_loader'``) and on ``o_proj`` and the routers (``Attempted to load weight
(torch.Size([8, 64])) into parameter (torch.Size([0]))``); the embedding, norms and experts
load. The test pins that, and runs the training loop with that one call swapped for vLLM's
in-place reload (the library's ``update_weights``, vLLM's ``reload_weights``), fed by TRL's own
parameter walk. Each run is a process of its own (TRL's engine joins vLLM's process-wide groups
through the external launcher); the two start together.

Runs in vLLM's CPU build (``.venv-vllm``, with ``trl`` installed as ``.ci/run`` does).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines.vllm_runtime import import_vllm  # noqa: E402

vllm = import_vllm()
trl = pytest.importorskip(
    "trl",
    reason="TRL is not installed in this venv (.ci/run installs trl==1.16.0 into .venv-vllm)",
)

from fsdp_precision import EngineDtypeError  # noqa: E402
from fsdp_precision.integrations import KEPT_ENV  # noqa: E402

from tests.engines.families import declare_family  # noqa: E402
from tests.engines.test_vllm import file_tensors, in_processes, model_of, read_back  # noqa: E402

pytestmark = pytest.mark.integration
bf16, fp32 = torch.bfloat16, torch.float32
GATES = [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]
CPU_STOP = "'Parameter' object has no attribute 'weight_loader'"


def tokenizer() -> Any:
    """A whitespace tokenizer over the model's 256 ids, built in memory (no downloads)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, 256)}}
    words = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def reward(completions: list[str], **_: Any) -> list[float]:
    """Rewards that differ within a group, so the policy gradient is not zero."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]


def grpo(base: str, declaration: str, out: str) -> dict[str, Any]:
    """A process of its own: TRL's GRPOTrainer, vLLM colocated, started from ``base`` (with
    ``FSDP_PRECISION_KEPT`` where ``declaration`` is given). What the engine holds after TRL
    builds it; the router sent in bf16 through TRL's load call (declared only); two training
    steps with the sync's load call swapped for vLLM's reload; TRL's own sync, last."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from fsdp_precision.integrations.vllm import update_weights

    os.environ.pop(KEPT_ENV, None)
    if declaration:
        os.environ[KEPT_ENV] = declaration
    model = AutoModelForCausalLM.from_pretrained(base, dtype=fp32)  # the trainer's fp32 masters
    prompts = ["t5 t6 t7 t8", "t9 t10 t11", "t12 t13", "t14 t15 t16"]
    args = GRPOConfig(
        output_dir=out, use_vllm=True, vllm_mode="colocate", max_steps=2, learning_rate=1e-3,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=4, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", vllm_max_model_length=64, seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, processing_class=tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )  # fmt: skip
    generation = trainer.vllm_generation
    llm = generation.llm
    engine = model_of(llm)
    gates = {n: m for n, m in engine.named_modules() if n.endswith("mlp.gate")}
    found: dict[str, Any] = {
        "gates": sorted({f"{type(g).__name__} {g.weight.dtype}" for g in gates.values()}),
        "at_start": read_back(llm, file_tensors(Path(base)), dict.fromkeys(GATES, fp32)),
    }
    # TRL's own load call (vllm_generation.py, sync_weights), one tensor at a time.
    load = llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights
    if declaration:
        sent = dict(generation._iter_named_params())
        try:
            load([(GATES[0], (sent[GATES[0]] * 1.001).to(bf16))])  # a sync cast to bf16
            found["bf16_sent"] = "loaded"
        except EngineDtypeError as err:
            found["bf16_sent"] = str(err)
        try:  # the same router in fp32, as TRL sends it: the CPU build's prepacked linear
            load([(GATES[0], sent[GATES[0]] * 1.001)])
            found["fp32_sent"] = "loaded"
        except AssertionError as err:
            found["fp32_sent"] = str(err)
        found["after_refusal"] = read_back(llm, file_tensors(Path(base)), {GATES[0]: fp32})

    def sync_weights() -> None:  # TRL's sync, its load call swapped for vLLM's reload
        update_weights(llm, generation._iter_named_params())
        llm.reset_prefix_cache()

    generation.sync_weights = sync_weights
    trainer.train()
    sync_weights()  # what the next step's sync sends: the weights after the last step
    trained = {n: model.get_parameter(n).detach().clone() for n in GATES}
    on_disk = file_tensors(Path(base))
    found["steps"] = trainer.state.global_step
    found["moved"] = all(not torch.equal(trained[n], on_disk[n].float()) for n in GATES)
    found["beyond_bf16"] = all(
        not torch.equal(trained[n].to(bf16).float(), trained[n]) for n in GATES
    )
    found["synced"] = read_back(llm, trained, dict.fromkeys(GATES, fp32))
    del generation.sync_weights  # TRL's own sync, unchanged: where the CPU build stops it
    try:
        generation.sync_weights()
        found["trl_sync"] = "loaded"
    except Exception as err:  # noqa: BLE001 - the CPU build's error, recorded as it is
        found["trl_sync"] = f"{type(err).__name__}: {err}"
    return found


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The base checkpoint (bf16, no record) with its tokenizer, and the trainer's declaration."""
    root = tmp_path_factory.mktemp("trl")
    kept = declare_family("qwen3_moe", root / "base", root / "kept.json")
    assert kept == dict.fromkeys(GATES, "float32")
    tokenizer().save_pretrained(root / "base")
    return root / "base", root / "kept.json"


@pytest.fixture(scope="module")
def runs(
    base: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Any]]:
    """Both GRPO runs (declared, and the control without the declaration), each a process of
    its own, started together (``in_processes``), each given its own ``MASTER_PORT`` (TRL's
    engine joins vLLM's groups through torch's env:// rendezvous, 29500 unless told)."""
    from fsdp_precision._base.dist import free_port

    ports = {free_port()}
    while len(ports) < 2:
        ports.add(free_port())
    first, second = ({"MASTER_PORT": str(port)} for port in ports)
    return in_processes(
        {
            "declared": (
                "grpo",
                str(base[0]),
                str(base[1]),
                str(tmp_path_factory.mktemp("d")),
                {"module": "test_trl_vllm", "env": first},
            ),
            "control": (
                "grpo",
                str(base[0]),
                "",
                str(tmp_path_factory.mktemp("c")),
                {"module": "test_trl_vllm", "env": second},
            ),
        }
    )


def test_grpo_colocated_declared_holds_the_trainers_fp32_routers(
    runs: dict[str, Future[Any]],
) -> None:
    """With ``FSDP_PRECISION_KEPT``: TRL's engine is built with fp32 routers; a router sent in
    bf16 through TRL's own load call is refused by name, nothing loaded; after two GRPO steps the
    engine's routers read back bitwise equal to the trainer's fp32 routers."""
    found = runs["declared"].result()
    assert found["gates"] == ["KeptGateLinear torch.float32"]
    assert found["at_start"] == dict.fromkeys(GATES)  # the base's bf16 routers, widened exactly
    assert "model.layers.0.mlp.gate.weight: sent in bfloat16, kept in float32" in found["bf16_sent"]
    assert "into parameter (torch.Size([0]))" in found["fp32_sent"]  # CPU build: prepacked
    assert found["after_refusal"] == {GATES[0]: None}  # neither call changed the engine
    assert found["steps"] == 2 and found["moved"] and found["beyond_bf16"]
    assert found["synced"] == dict.fromkeys(GATES)
    assert CPU_STOP in found["trl_sync"]  # vLLM's CPU build: prepacked linears (docstring)


def test_negative_control_grpo_colocated_without_the_declaration_rounds_the_routers(
    runs: dict[str, Future[Any]],
) -> None:
    """The same run without the declaration: TRL's engine holds bf16 routers and the trainer's
    fp32 routers are rounded with no error."""
    found = runs["control"].result()
    assert found["gates"] and all("torch.bfloat16" in g for g in found["gates"])
    assert found["steps"] == 2 and found["moved"] and found["beyond_bf16"]
    assert all(p is not None and "bfloat16" in p for p in found["synced"].values()), found
    assert CPU_STOP in found["trl_sync"]
