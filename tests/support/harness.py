"""Run many distributed test cases in one spawned gloo process group (spawning is the slow part).

A test module lists its case functions; a module-scoped fixture spawns ``world_size`` processes
once, every rank runs every case in order, and each pytest test asserts one case's outcome.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fsdp_precision as fp
from fsdp_precision._base.dist import free_port

OK = "ok"
SKIP = "skip: "


def _worker(
    rank: int, world_size: int, port: int, module: str, cases: Sequence[str], out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    fp.apply_param_dtype_map_patch()
    mod = importlib.import_module(module)
    results: dict[str, str] = {}
    healthy = True
    for name in cases:
        if not healthy:
            results[name] = "not run: an earlier case left the process group unusable"
            continue
        try:
            getattr(mod, name)()
            results[name] = OK
        except pytest.skip.Exception as exc:
            results[name] = f"{SKIP}{exc.msg}"
        except BaseException:  # noqa: BLE001 - reported to the parent test
            results[name] = f"rank {rank}: " + traceback.format_exc()
        finally:
            if not fp.is_param_dtype_map_patch_applied():
                fp.apply_param_dtype_map_patch()
        # The case's FSDP models (reference cycles) are freed here, at a known point between
        # collectives, not by a later automatic collection in the middle of another case.
        gc.collect()
        try:  # keep ranks in step; a rank stuck in a collective times out here
            dist.barrier()
        except Exception:  # noqa: BLE001
            healthy = False
        # Written after every case: a rank that dies later still reports what it finished.
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's thread destructors can abort a finished rank


def run_cases(world_size: int, module: str, cases: Sequence[str]) -> dict[str, str]:
    """Spawn ``world_size`` ranks running ``module``'s ``cases``; return case -> "ok" or error."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), module, list(cases), out),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
            crashed = ""
        except Exception as exc:  # noqa: BLE001
            crashed = f"a rank crashed: {exc}"
        merged: dict[str, str] = {}
        for name in cases:
            outcomes = []
            for rank in range(world_size):
                path = Path(out, f"rank{rank}.json")
                outcomes.append(
                    json.loads(path.read_text()).get(name, crashed or "missing")
                    if path.exists()
                    else crashed or "missing"
                )
            failures = [o for o in outcomes if o != OK and not o.startswith(SKIP)]
            skips = [o for o in outcomes if o.startswith(SKIP)]
            merged[name] = failures[0] if failures else (skips[0] if skips else OK)
        return merged


def check(result: str) -> None:
    """Assert one case's merged outcome (a skip on the ranks skips the test)."""
    if result.startswith(SKIP):
        pytest.skip(result.removeprefix(SKIP))
    assert result == OK, result


def distributed_suite(world_size: int, module: str, cases: Sequence[str]) -> tuple[Any, Any]:
    """A module's distributed tests: ``results, test_x = distributed_suite(2, __name__, CASES)``.

    Returns a module-scoped fixture that spawns the group once and a parametrized test that
    checks one case each.
    """

    @pytest.fixture(scope="module")
    def results() -> dict[str, str]:
        return run_cases(world_size, module, cases)

    @pytest.mark.distributed
    @pytest.mark.parametrize("case", cases)
    def test_case(results: dict[str, str], case: str) -> None:
        check(results[case])

    return results, test_case


def torchrun_environment() -> None:
    """torchrun's variables for this rank, so that a framework (accelerate, Lightning,
    transformers) attaches to the harness's process group instead of launching its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )


def fresh_accelerate_state() -> None:
    """torchrun's environment for accelerate, and no accelerate state left from an earlier case."""
    from accelerate.state import AcceleratorState

    torchrun_environment()
    AcceleratorState._reset_state(reset_partial_state=True)


def collect_cases(module_globals: dict[str, object]) -> list[str]:
    """Every ``case_*`` function of a module, in definition order."""
    return [n for n, f in module_globals.items() if n.startswith("case_") and callable(f)]


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Run a block on torch's original FSDP2 (the harness re-applies the patch afterwards)."""
    fp.remove_param_dtype_map_patch()
    try:
        yield
    finally:
        fp.apply_param_dtype_map_patch()


def launch_example(
    script: str | Path, *args: object, nproc: int = 2, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    """A script under ``torchrun --standalone`` on ``nproc`` CPU ranks, one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*launcher, f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def run_example(script: str | Path, *args: object, nproc: int = 2, timeout: int = 600) -> str:
    """:func:`launch_example`'s stdout. It must succeed (the assertion shows the end of its
    output)."""
    out = launch_example(script, *args, nproc=nproc, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout
