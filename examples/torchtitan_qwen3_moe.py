"""torchtitan with one ``model_policy``: the ``parallelize_fn`` of its Qwen3 MoE, the router gates
in fp32 inside bf16 FSDP units, gradients reduced in fp32; saved and resumed with torchtitan's own
``CheckpointManager``, exported for inference.

    torchrun --standalone --nproc_per_node 2 examples/torchtitan_qwen3_moe.py --dir run  # CPU, tiny
    torchrun --standalone --nproc_per_node 2 examples/torchtitan_qwen3_moe.py --dir run \\
        --stop-after 2      # a preemption: the run ends after step 2's checkpoint
    torchrun --standalone --nproc_per_node 2 examples/torchtitan_qwen3_moe.py --dir run
                            # resumes after step 2, bitwise as if it had never stopped
    torchrun --standalone --nproc_per_node 4 examples/torchtitan_qwen3_moe.py --tp 2 --ep 2
                            # torchtitan's tensor and expert parallelism, FSDP on top

torchtitan's ``apply_fsdp_to_decoder`` builds its own ``MixedPrecisionPolicy``; the recipe makes
the same calls (embedding, ``[norm, lm_head]``, each block, the root) with one ``model_policy``,
and goes in the model's ``ModelSpec.parallelize_fn`` (``parallelize_qwen3_with_model_policy``,
torchtitan's signature; set ``--parallelism.spmd_backend partial_dtensor``). Its
``parallelize_qwen3`` applies torchtitan's TP and EP first; under EP > 1 the recipe makes each MoE
block one unit of two parameter groups, as ``apply_fsdp_to_decoder`` does: the routed experts on
the ``efsdp`` mesh through a ``ShardPlacementResult``, the rest (the gate too) on ``fsdp``. Under
TP the norms and gates are replicated on the TP mesh; their gradients' all-reduce over it runs in
the reduce dtype (fp32) under the library's patch (torch's own runs it in the compute dtype,
pytorch #190626). ``--tp``/``--ep`` set torchtitan's degrees. On CUDA torchtitan
computes the gate under ``autocast(float32)``; the rule's boundary cast casts the gate's input on
any device. Here ``main`` builds torchtitan's own Qwen3 MoE small on CPU (its SDPA attention:
flex attention has no CPU backward), takes the job config of its ``qwen3_moe_debug`` recipe from
its ``ConfigManager`` (``--checkpoint.interval 1``; ``--training.disable_cuda_graphs``, which its
EP token dispatch needs), its ``ParallelDims`` (on the CPU without a GPU), and builds the
optimizers, LR schedulers and checkpointer from it as torchtitan's ``Trainer`` does. A reload
in one process gives the trained logits bitwise without TP/EP, and within 5% with them (TP's
sharded matmuls and EP's dispatched experts sum in another order).

Checkpoints: ``CheckpointManager.save(step)`` writes ``<dump_folder>/checkpoint/step-<N>`` with
``torch.distributed.checkpoint``: every rank its model and optimizer shards as stored (the fp32
masters), the LR schedulers and the train state as pickled bytes, and a pickled ``.metadata``,
written last (to a temporary name, then renamed). ``load()`` resumes from the newest step that
has one: a save cut off is skipped. The last step's save is model-only and cast to
``--checkpoint.export_dtype`` when ``last_save_model_only`` (the default outside the debug
recipe), and the Hugging Face one (``last_save_in_hf``) casts every tensor, the gates too.

Before ``load()`` the example checks the step it will read with ``check_checkpoint`` (DCP's
default reader unpickles ``.metadata`` and the pickled states: a crafted file would run code).

Export: ``export_safetensors(model, dir, dtype=torch.bfloat16)`` writes torchtitan's names (the
``plain`` layout: a torchtitan model is a plain ``nn.Module``), the bulk in bf16 and the gates in
fp32, one FSDP unit in memory at a time; a fresh model loads it with ``load_state_dict(...,
assign=True)`` and ``restore_kept`` (the boundary casts). torchtitan's
``Qwen3StateDictAdapter.to_hf`` renames it for Hugging Face (experts split, dtypes kept).
Without ``--dir`` the run lives in a temporary directory. ``--out`` writes the final state
(rank 0), which ``tests/integrations/test_torchtitan.py`` (2 ranks) and
``test_torchtitan_meshes.py`` (4 ranks, TP 2 x EP 2) compare bitwise across launches; they also
import the recipe from this file. CI runs them in its torchtitan venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdp_precision as fp
from fsdp_precision.checkpoint import check_checkpoint, export_safetensors, restore_kept
from fsdp_precision.testing import GatherProbe

RULES = fp.PrecisionRules(
    param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
    cast_forward_inputs=False,  # as apply_fsdp_to_decoder
    rules=(fp.Glob("*moe.router.gate.weight"),),
)
VOCAB, SEQ = 64, 8


def parallelize_with_model_policy(
    model: Any, dp_mesh: Any, rules: fp.PrecisionRules, *, ep_degree: int = 1,
    edp_mesh: Any = None,
) -> Any:  # fmt: skip
    """The recipe: apply_fsdp_to_decoder's units (no weight tying) with one model_policy: the
    embedding, ``[norm, lm_head]``, each block, the root. Under expert parallelism (EP > 1) an
    MoE block is one unit of two parameter groups, as torchtitan makes it: the routed experts
    on ``edp_mesh`` (its ``efsdp`` mesh), the rest (attention, norms, the router gate) on
    ``dp_mesh``, through ``shard_placement_fn`` and a ``ShardPlacementResult`` per parameter."""
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    policy = fp.model_policy(model, rules)
    fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=policy)
    fully_shard([model.norm, model.lm_head], mesh=dp_mesh, mp_policy=policy,
                reshard_after_forward=False)  # fmt: skip
    for block in model.layers.values():
        placement = experts_placement(block, dp_mesh, ep_degree, edp_mesh)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    disable_fsdp_gradient_division(model)
    return model


def experts_placement(block: Any, dp_mesh: Any, ep_degree: int, edp_mesh: Any) -> Any:
    """apply_fsdp_to_decoder's ``shard_placement_fn`` for a block (torchtitan 0.3.0): None for
    a dense block or EP = 1 with as many experts as shards; the experts on dim 1 where the
    experts' shards outnumber them; under EP > 1 a ``ShardPlacementResult`` per parameter."""
    if not getattr(block, "moe_enabled", False):
        return None
    experts = block.moe.routed_experts.inner_experts
    expert_params = set(experts.parameters())
    shards = edp_mesh["efsdp"].size() * ep_degree if ep_degree > 1 else dp_mesh.size()
    on_experts = Shard(1) if shards > experts.num_experts else Shard(0)
    if ep_degree == 1:
        if on_experts == Shard(0):
            return None
        return lambda param: on_experts if param in expert_params else None
    if edp_mesh is None:
        raise ValueError(f"expert parallelism of degree {ep_degree} needs the experts' edp_mesh")
    # What torchtitan's own placement imports (FSDP2 has no public name for them yet).
    from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: TID251
        ShardPlacementResult,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info  # noqa: TID251

    on_edp, on_dp = _get_mesh_info(edp_mesh, None), _get_mesh_info(dp_mesh, None)
    return lambda param: (
        ShardPlacementResult(placement=on_experts, mesh_info=on_edp)
        if param in expert_params
        else ShardPlacementResult(placement=Shard(0), mesh_info=on_dp)
    )


def parallelize_qwen3_with_model_policy(
    model: Any, *, parallel_dims: Any, training: Any, parallelism: Any, skip_dp: bool = False,
    **rest: Any,
) -> Any:  # fmt: skip
    """A ``ModelSpec.parallelize_fn`` with torchtitan's signature: its ``parallelize_qwen3``
    without the FSDP step (TP/EP/CP, activation checkpointing, compile), then the recipe's
    units on its meshes (``fsdp``, under EP ``efsdp`` for the experts) with the job config's
    dtypes and the router gates in fp32."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.qwen3 import parallelize_qwen3

    if not skip_dp and parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"this recipe covers spmd_backend='partial_dtensor', got "
            f"{parallelism.spmd_backend!r}: set --parallelism.spmd_backend partial_dtensor"
        )
    parallelize_qwen3(model, parallel_dims=parallel_dims, training=training,
                      parallelism=parallelism, skip_dp=True, **rest)  # fmt: skip
    if skip_dp:
        return model
    rules = fp.PrecisionRules(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
        rules=(fp.Glob("*moe.router.gate.weight"),),
    )
    dp_mesh, edp_mesh = titan_meshes(parallel_dims)
    return parallelize_with_model_policy(
        model, dp_mesh, rules, ep_degree=parallel_dims.ep, edp_mesh=edp_mesh
    )


def titan_meshes(parallel_dims: Any) -> tuple[Any, Any]:
    """parallelize_qwen3's FSDP meshes under partial_dtensor: ``fsdp`` (with ``dp_replicate``
    under HSDP), and under EP the experts' ``efsdp``."""
    replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
    dp_mesh = parallel_dims.get_mesh([*replicate, "fsdp"])
    edp_mesh = (
        parallel_dims.get_optional_mesh([*replicate, "efsdp"]) if parallel_dims.ep_enabled else None
    )
    return dp_mesh, edp_mesh


def tiny_qwen3_moe_config() -> Any:
    """torchtitan's Qwen3 MoE config from its own builders, 2 layers, 4 experts, CPU attention."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE

    dim, head_dim = 32, 16
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=2, dim=dim, n_heads=2, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=48,
            num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * SEQ, theta=1e6),
        ),
    )  # fmt: skip
    for layer in config.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


class TrainState(Stateful):
    """What torchtitan's Trainer checkpoints as ``train_state``: the step (and the losses)."""

    def __init__(self) -> None:
        self.step = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.losses = state_dict["step"], list(state_dict["losses"])


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def on_this_machine(config: Any) -> Any:
    """torchtitan's ``ParallelDims`` from the job config, as its Trainer makes them; on a machine
    without a GPU its meshes go on the CPU (torchtitan builds them on ``device_type``)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import utils as titan_utils

    if not torch.cuda.is_available():
        titan_dims.device_type = "cpu"
    titan_utils.set_spmd_backend(config.parallelism.spmd_backend)
    return titan_dims.ParallelDims.from_config(config.parallelism, dist.get_world_size())


def whole(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict with every DTensor gathered whole (collective)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state_dict.items()}


def newest_step(folder: Path) -> Path | None:
    """The step torchtitan's ``load()`` resumes from: the newest ``step-<N>`` with a
    ``.metadata`` (a save cut off has none)."""
    steps = [p.parent for p in folder.glob("step-*/.metadata")]
    steps = [p for p in steps if p.name.removeprefix("step-").isdigit()]
    return max(steps, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def tokens(step: int, rank: int) -> torch.Tensor:
    """Step ``step``'s batch on ``rank``: a resumed run sees what the uninterrupted one saw."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)


def main() -> None:
    from safetensors.torch import load_file
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="", help="the run's directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stop-after", type=int, default=0, help="end after this step's save")
    parser.add_argument("--out", default="", help="rank 0 saves the final state here")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel degree")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    where = [args.dir or (tempfile.mkdtemp(prefix="torchtitan-") if rank == 0 else "")]
    dist.broadcast_object_list(where)
    run = Path(where[0])
    config = ConfigManager().parse_args(
        ["--module", "qwen3", "--config", "qwen3_moe_debug", "--dump_folder", str(run),
         "--training.steps", str(args.steps), "--training.seq_len", str(SEQ),
         "--checkpoint.enable", "--checkpoint.interval", "1",
         "--parallelism.spmd_backend", "partial_dtensor",
         "--parallelism.tensor_parallel_degree", str(args.tp),
         "--parallelism.expert_parallel_degree", str(args.ep),
         "--training.disable_cuda_graphs"]  # its EP token dispatch syncs with the host
    )  # fmt: skip
    parallel_dims = on_this_machine(config)
    torch.manual_seed(0)
    model_config = tiny_qwen3_moe_config()
    model_config.update_from_config(config=config)  # as the Trainer does: TP, EP dispatch
    model = model_config.build()
    model.init_states()
    parallelize_qwen3_with_model_policy(
        model, parallel_dims=parallel_dims, training=config.training,
        parallelism=config.parallelism, compile_config=config.compile, ac_config=None,
        dump_folder=config.dump_folder,
    )  # fmt: skip
    for module in model.modules():  # gloo has no PREMUL_SUM for torchtitan's divide factor 1
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    batch_rank = rank // args.tp  # the ranks of a TP group share their batch
    # As torchtitan's Trainer builds them, from the job config.
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=args.steps)
    state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=Qwen3StateDictAdapter(model_config, None),
        base_folder=config.dump_folder,
    )  # fmt: skip
    newest = newest_step(Path(checkpointer.folder))
    if newest is not None:  # what load() will read, checked first: DCP's reader unpickles it
        check_checkpoint(newest)
    checkpointer.load()  # the newest complete step under <dir>/checkpoint, or a fresh start
    start = state.step
    for step in range(start + 1, args.steps + 1):
        batch = tokens(step, batch_rank)
        logits = whole_tensor(model(batch[:, :-1]))  # under TP, sharded on the vocabulary
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch[:, 1:].flatten()
        )
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        state.step = step
        state.losses.append(mean.item() / dist.get_world_size())
        checkpointer.save(step, last_step=step == args.steps)
        if step == args.stop_after:
            if rank == 0:
                print(f"stopped after step {step}'s checkpoint (a simulated preemption)")
            checkpointer.close()
            return
    checkpointer.close()
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not wrap it"
    prompt = tokens(0, 0)[:, :-1]
    with torch.no_grad(), GatherProbe(model) as probe:
        trained_logits = whole_tensor(model(prompt))  # collective
    kept = {n for n in probe.seen if n.endswith("moe.router.gate.weight")}
    assert kept and all(probe.seen[n].dtype == torch.float32 for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in probe.seen.items() if n not in kept)

    # Export (collective; rank 0 writes): torchtitan's names, bulk bf16, gates fp32.
    export = run / "export"
    export_safetensors(model, export, dtype=torch.bfloat16, step=args.steps)
    params, optim = whole(model.state_dict()), whole(optimizers.state_dict())  # collective
    if rank == 0:
        weights = load_file(export / "model.safetensors")
        assert all(weights[n].dtype == torch.float32 for n in kept)
        reloaded = model_config.build()  # a fresh, unwrapped model, as for inference
        reloaded.load_state_dict(weights, strict=False, assign=True)  # the file's dtypes
        restored = restore_kept(reloaded, export)  # exact, with training's boundary casts
        assert kept <= set(restored), (kept, restored)
        with torch.no_grad():
            logits = reloaded(prompt)
        # One process sums TP's sharded matmuls (and EP's dispatched experts) in another order.
        exact = args.tp == args.ep == 1
        assert (
            torch.equal(logits, trained_logits)
            if exact
            else torch.allclose(logits, trained_logits, rtol=0.05, atol=0.05)
        ), "reloaded logits differ"
        hf = Qwen3StateDictAdapter(model_config, None).to_hf(weights)  # torchtitan's adapter
        hf_gates = [n for n in hf if n.endswith("mlp.gate.weight")]
        assert len(hf_gates) == len(kept) and all(hf[n].dtype == torch.float32 for n in hf_gates)
        if args.out:
            lr = schedulers.state_dict()
            torch.save(
                {"params": params, "optim": optim, "lr": lr, "losses": state.losses}, args.out
            )
        print(
            f"step {args.steps}, loss {state.losses[-1]:.4f} (started after step {start}); "
            f"{len(kept)} router gates gathered in fp32, the other {len(probe.seen) - len(kept)} "
            f"parameters in bf16, on FSDP2; exported bf16 with the gates in fp32, reloaded with "
            f"the trained logits; {len(hf)} tensors in Hugging Face names"
        )
        if not args.dir:
            shutil.rmtree(run)


if __name__ == "__main__":
    main()
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()
    # Leave without interpreter shutdown (as examples/elastic_resume.py does): a gloo worker
    # thread can still hold the last collective's work, and releasing it while the interpreter
    # finalises can abort a rank that finished. Everything is written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
