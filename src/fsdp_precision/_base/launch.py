"""Run a function on N local processes, or in the processes ``torchrun`` already started.

>>> result = launch(job, (opts,), nproc=2)  # doctest: +SKIP

``job`` runs on every rank with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and creates its process group with
:func:`process_group`. Spawned: the caller gets rank 0's return value (it must pickle). Under
torchrun: every rank gets its own, and :func:`is_rank0` says who prints.
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

from fsdp_precision._base.dist import free_port, under_torchrun

__all__ = ["fork_is_safe", "launch", "process_group"]

R = TypeVar("R")


@contextmanager
def process_group(backend: str = "gloo", *, timeout_s: float = 120) -> Iterator[None]:
    """``init_process_group`` from the environment, destroyed on exit.

    Garbage is collected before the group is destroyed: FSDP-wrapped models live in reference
    cycles (modules, hooks, FSDP state), and gloo can abort a process whose last collectives'
    work objects are left to interpreter shutdown."""
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


def launch(
    fn: Callable[..., R], args: tuple[Any, ...], *, nproc: int, start_method: str = "auto"
) -> R:
    """``fn(*args)`` on ``nproc`` new processes; returns rank 0's result.

    Under torchrun, runs ``fn(*args)`` in this process instead (``nproc`` is ignored: the world
    size is torchrun's) and returns its result. ``fn`` must be a module-level function. A rank
    that raises makes this raise ``torch.multiprocessing.ProcessRaisedException``, whose message
    ends with the rank's exception.

    ``start_method="fork"`` (Linux, CPU only: never after CUDA was initialised) starts the ranks
    in milliseconds with everything this process imported (transformers takes seconds to
    import); ``"spawn"`` starts fresh interpreters; ``"auto"`` forks where that is safe
    (:func:`fork_is_safe`) and spawns otherwise.
    """
    if under_torchrun():
        return fn(*args)
    if start_method == "auto":
        start_method = "fork" if fork_is_safe() else "spawn"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="fsdp-precision-") as out:
        start_processes(  # type: ignore[no-untyped-call]
            _entry,
            args=(fn, args, nproc, free_port(), out),
            nprocs=nproc,
            join=True,
            start_method=start_method,
        )
        with open(Path(out, "rank0.pkl"), "rb") as f:
            result: R = pickle.load(f)
    return result


def fork_is_safe() -> bool:
    """Whether forked ranks would start clean here: Linux, no CUDA in use or available (a forked
    child cannot use CUDA), and no process group in this process (a forked child would inherit
    it: "trying to initialize the default process group twice")."""
    return sys.platform == "linux" and not torch.cuda.is_available() and not dist.is_initialized()


def _entry(
    rank: int, fn: Callable[..., Any], args: tuple[Any, ...], nproc: int, port: int, out: str
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result = fn(*args)
    if rank == 0:
        with open(Path(out, "rank0.pkl"), "wb") as f:
            pickle.dump(result, f)
    # The rank's work is done and its result written: leave without interpreter shutdown, whose
    # destructors of gloo's threads can abort a process after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
