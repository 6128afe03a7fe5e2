"""Elastic training: checkpoint every step, and resume by itself after a rank dies.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 examples/elastic_resume.py --root ckpt

The loop resumes from the newest complete checkpoint under ``--root`` (none on a first start),
then trains and saves every step, keeping the last two. Under ``torchrun --max-restarts N`` a
rank that dies makes torchrun stop and restart every rank; the restarted loop continues from the
newest complete step: a step whose save was cut off is not complete, so the one before is used.
The loss history rides in the checkpoints' metadata. ``--kill-at K`` (first attempt only) makes
the last rank SIGKILL itself after step K's update, before its save; ``--kill-in-save K`` makes
rank 0 die in step K's save, after the shards are written and before the checkpoint is complete.
``--out`` writes the final parameters, optimizer state and loss history (rank 0), which
``tests/train/test_elastic.py`` compares bitwise with an uninterrupted run. ``--hsdp R``: HSDP with
R replicas (over two torchrun agents: one node each, see docs/guides/distributed.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import fsdp_precision as fp
from fsdp_precision import checkpoint
from fsdp_precision._edges.checkpoint import metadata as _metadata  # the --kill-in-save seam
from fsdp_precision.testing import TinyConfig, TinyDecoder

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def init_process_group(backend: str) -> None:
    """``init_process_group`` whose store keys belong to this restart: torchrun keeps one store
    across restarts, and a rank reading a peer's address before the peer republished it gets
    the dead one of the previous attempt (gloo: "connectFullMesh failed ... Connection
    refused")."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False
    )
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"attempt-{attempt}/", store), rank=rank, world_size=world
    )


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_save(step: int) -> None:
    """Rank 0 dies in step ``step``'s save, its shards written, the checkpoint not complete."""
    write = _metadata.write_metadata

    def dying(path: Path, kind: object, saved: int | None, *args: object, **kwargs: object) -> None:
        if saved == step and FIRST_ATTEMPT:
            die()
        write(path, kind, saved, *args, **kwargs)  # type: ignore[arg-type]

    _metadata.write_metadata = dying  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    parser.add_argument(
        "--root",
        default=os.path.join(tempfile.gettempdir(), f"fsdp-precision-elastic-{run}"),
        help="the run's checkpoint directory (default: one per torchrun run id, in the temp dir)",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    parser.add_argument("--hsdp", type=int, default=0, help="replicas (0: FSDP over all ranks)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.kill_in_save >= 0 and rank == 0:
        kill_in_save(args.kill_in_save)

    cfg = TinyConfig(dim=32, depth=2)
    torch.manual_seed(0)
    config = fp.DistributedConfig(
        parallel_strategy="hsdp" if args.hsdp else "fsdp",
        hsdp_replicate_size=args.hsdp or None,
        fsdp_mixed_precision=fp.PrecisionRules(rules=(fp.Glob("*router.weight"),), advice="off"),
        fsdp_auto_wrap_min_params=0,
    )
    model = fp.wrap_model_for_training(TinyDecoder(cfg), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    meta = checkpoint.resume_from_latest(args.root, model, optimizer)
    start = meta["step"] + 1 if meta else 0
    losses: list[float] = list(meta["extra"]["losses"]) if meta else []
    if rank == 0:
        print(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: start at {start}")
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=g)
        loss = model.loss(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step == args.kill_at and FIRST_ATTEMPT and rank == world - 1:
            die()
        checkpoint.save_step(
            args.root, model, optimizer, step=step, keep_last=2, extra={"losses": losses}
        )

    params = checkpoint.model_state_dict(model, "full")
    optim = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0 and args.out:
        torch.save({"params": params, "optim": optim, "losses": losses}, args.out)
    if rank == 0:
        mesh = next(iter(model.parameters())).device_mesh  # type: ignore[attr-defined]
        print(f"trained to step {args.steps - 1} on mesh {mesh.mesh.tolist()}: losses "
              f"{[round(x, 4) for x in losses]}")  # fmt: skip
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter shutdown (as the library's own launcher does): a gloo worker
    # thread can still hold the last collective's work, and releasing its tensors while the
    # interpreter finalises aborts a rank that finished ("terminate called without an active
    # exception"; 3 of about 30 runs here). Everything is written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
