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
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["free_port", "is_rank0", "launch", "process_group", "under_torchrun"]

R = TypeVar("R")


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_rank0() -> bool:
    """True in the launching process and on rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for ``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def process_group(backend: str = "gloo", *, timeout_s: float = 120) -> Iterator[None]:
    """``init_process_group`` from the environment, destroyed on exit.

    Before the group is destroyed, garbage is collected: FSDP-wrapped models live in reference
    cycles (modules, hooks, FSDP state), and their last collectives' work objects, left to
    interpreter shutdown, made gloo abort the process ("terminate called without an active
    exception", about one torchrun demo in ten on a loaded 2-core machine)."""
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


def launch(
    fn: Callable[..., R], args: tuple[Any, ...], *, nproc: int, start_method: str = "spawn"
) -> R:
    """``fn(*args)`` on ``nproc`` new processes; returns rank 0's result.

    Under torchrun, runs ``fn(*args)`` in this process instead (``nproc`` is ignored: the world
    size is torchrun's) and returns its result. ``fn`` must be a module-level function. A rank
    that raises makes this raise ``torch.multiprocessing.ProcessRaisedException``, whose message
    ends with the rank's exception.

    ``start_method="fork"`` (Linux, CPU only: never after CUDA was initialised) starts the ranks
    in milliseconds with everything this process imported (transformers takes seconds to
    import); ``"spawn"`` starts fresh interpreters.
    """
    if under_torchrun():
        return fn(*args)
    from torch.multiprocessing.spawn import start_processes

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
    # destructors of gloo's threads sometimes abort the process ("terminate called without an
    # active exception", SIGABRT) after a clean run (seen in CI on bench_checkpoint.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
