"""Run many distributed test cases in one spawned gloo process group (spawning is the slow part).

A test module lists its case functions; a module-scoped fixture spawns ``world_size`` processes
once, every rank runs every case in order, and each pytest test asserts one case's outcome.

The same cases run with the ranks as threads of one spawned process (``threads=True``: torch's
threaded process group, as PyTorch's own ``FSDPTestMultiThread`` tests run), each case in a
fresh group, so a case that fails on one rank leaves the next case a working group. With
``patch=False`` the ranks run on torch's own FSDP2, the library's patch never applied. A case
may return a JSON value (digests of outputs and gradients, recorded collectives):
:func:`case_values` gives each rank's, for comparing a patched run with torch alone.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
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
TERMINATED = "Test termination event occurs"


CASE_SECONDS = 120  # a thread rank still running a case after this is stuck in a collective
_values: dict[tuple[str, bool, bool], dict[str, list[Any]]] = {}


def _run_case(mod: Any, name: str, rank: int) -> tuple[str, Any]:
    """One case on this rank: its outcome ("ok", "skip: ...", or the traceback) and value."""
    try:
        value = getattr(mod, name)()
        json.dumps(value)  # a case's value must travel to the test
        return OK, value
    except pytest.skip.Exception as exc:
        return f"{SKIP}{exc.msg}", None
    except BaseException:  # noqa: BLE001 - reported to the parent test
        return f"rank {rank}: " + traceback.format_exc(), None


def _write(out: str, rank: int, results: dict[str, str], values: dict[str, Any]) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps({"results": results, "values": values}))


#: Imported once, by the fork server every rank is forked from: each rank then starts in
#: milliseconds instead of importing torch and the library again (seconds of CPU per rank, most
#: of a small case's cost on two cores). Nothing here builds a policy or applies the patch.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "fsdp_precision",
    __name__,
]


def _start(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(i, *args)`` in ``nprocs`` processes forked from the preloaded fork server, each
    given this process's environment as it is now (the server's is the one it started with)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    mp.start_processes(fn, args=(dict(os.environ), *args), nprocs=nprocs, start_method="forkserver")


def _take_environment(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def _worker(
    rank: int,
    env: dict[str, str],
    world_size: int,
    port: int,
    module: str,
    cases: Sequence[str],
    out: str,
    patch: bool = True,
) -> None:
    _take_environment(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    if patch:
        fp.apply_param_dtype_map_patch()
    mod = importlib.import_module(module)
    results: dict[str, str] = {}
    values: dict[str, Any] = {}
    healthy = True
    for name in cases:
        if not healthy:
            results[name] = "not run: an earlier case left the process group unusable"
            continue
        results[name], values[name] = _run_case(mod, name, rank)
        if patch and not fp.is_param_dtype_map_patch_applied():
            fp.apply_param_dtype_map_patch()
        # The case's FSDP models (reference cycles) are freed here, at a known point between
        # collectives, not by a later automatic collection in the middle of another case.
        gc.collect()
        try:  # keep ranks in step; a rank stuck in a collective times out here
            dist.barrier()
        except Exception:  # noqa: BLE001
            healthy = False
        # Written after every case: a rank that dies later still reports what it finished.
        _write(out, rank, results, values)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: gloo's thread destructors can abort a finished rank


def _thread_worker(
    _: int,
    env: dict[str, str],
    world_size: int,
    module: str,
    cases: Sequence[str],
    out: str,
    patch: bool,
) -> None:
    """The ranks as threads of this one process: each case in a fresh threaded process group
    (torch's, as ``MultiThreadedTestCase`` sets it up), every rank a thread."""
    _take_environment(env)
    from torch.testing._internal.distributed.multi_threaded_pg import (  # lazy: test-only torch
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch.set_num_threads(1)
    if patch:
        fp.apply_param_dtype_map_patch()
    mod = importlib.import_module(module)
    results: list[dict[str, str]] = [{} for _ in range(world_size)]
    values: list[dict[str, Any]] = [{} for _ in range(world_size)]
    stuck = ""
    for name in cases:
        if stuck:
            for rank in range(world_size):
                results[rank][name] = f"not run: {stuck}"
            continue
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _install_threaded_pg()
        store = dist.HashStore()

        def rank_thread(rank: int, name: str = name, store: dist.Store = store) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank][name], values[rank][name] = _run_case(mod, name, rank)
                if results[rank][name] != OK and not results[rank][name].startswith(SKIP):
                    # wake the other ranks from a collective this rank will never join
                    ProcessLocalGroup.exception_handle(RuntimeError(results[rank][name]))
            finally:
                dist.destroy_process_group()

        threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(CASE_SECONDS)
        if any(thread.is_alive() for thread in threads):
            stuck = f"case {name} did not finish within {CASE_SECONDS} s on every thread"
            for rank in range(world_size):
                results[rank].setdefault(name, stuck)
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        gc.collect()
        for rank in range(world_size):
            _write(out, rank, results[rank], values[rank])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_cases(
    world_size: int,
    module: str,
    cases: Sequence[str],
    *,
    threads: bool = False,
    patch: bool = True,
) -> dict[str, str]:
    """Run ``module``'s ``cases`` on ``world_size`` ranks: spawned gloo processes, or
    (``threads``) threads of one spawned process; return case -> "ok" or the error. ``patch``:
    whether the ranks run with the library's patch applied. Each rank's returned values are
    kept for :func:`case_values`."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        try:
            if threads:
                _start(_thread_worker, (world_size, module, list(cases), out, patch), 1)
            else:
                args = (world_size, free_port(), module, list(cases), out, patch)
                _start(_worker, args, world_size)
            crashed = ""
        except Exception as exc:  # noqa: BLE001
            crashed = f"a rank crashed: {exc}"
        reports = [
            json.loads(path.read_text()) if path.exists() else {"results": {}, "values": {}}
            for path in (Path(out, f"rank{rank}.json") for rank in range(world_size))
        ]
        merged: dict[str, str] = {}
        for name in cases:
            outcomes = [r["results"].get(name, crashed or "missing") for r in reports]
            failures = [o for o in outcomes if o != OK and not o.startswith(SKIP)]
            # a rank woken from a collective by another rank's failure reports only that it
            # was woken (torch's threaded group): the other rank's error is the cause
            failures.sort(key=lambda o: TERMINATED in o)
            skips = [o for o in outcomes if o.startswith(SKIP)]
            merged[name] = failures[0] if failures else (skips[0] if skips else OK)
        _values.setdefault((module, threads, patch), {}).update(
            {name: [r["values"].get(name) for r in reports] for name in cases}
        )
        return merged


def case_values(module: str, *, threads: bool = False, patch: bool = True) -> dict[str, list[Any]]:
    """What each case returned on each rank, in the last :func:`run_cases` of that kind."""
    return _values[(module, threads, patch)]


def check(result: str) -> None:
    """Assert one case's merged outcome (a skip on the ranks skips the test)."""
    if result.startswith(SKIP):
        pytest.skip(result.removeprefix(SKIP))
    assert result == OK, result


def distributed_suite(
    world_size: int,
    module: str,
    cases: Sequence[str],
    *,
    threads: bool = False,
    patch: bool = True,
    slow: Sequence[str] = (),
) -> tuple[Any, Any]:
    """A module's distributed tests: ``results, test_x = distributed_suite(2, __name__, CASES)``.

    Returns a module-scoped fixture that spawns the group once and a parametrized test that
    checks one case each. One module may hold several suites of different kinds (``threads``,
    ``patch``, see :func:`run_cases`): the fixture is named ``results`` for the default kind,
    ``results_threads``, ``results_unpatched``, ``results_threads_unpatched`` otherwise.

    ``slow``: cases (of ``cases``) in the opt-in tier (``pytest -m slow``), each test marked
    ``slow``; they run in a process group of their own, started when the first of them runs, so
    the default tier never spends their time.
    """
    name = "results" + ("_threads" if threads else "") + ("" if patch else "_unpatched")
    opt_in = [c for c in cases if c in slow]
    default = [c for c in cases if c not in slow]
    assert len(opt_in) == len(set(slow)), f"slow cases not in the suite: {set(slow) - set(cases)}"

    @pytest.fixture(scope="module", name=name)
    def results() -> dict[str, str]:
        return run_cases(world_size, module, default, threads=threads, patch=patch)

    slow_results: dict[str, str] = {}

    def results_slow() -> dict[str, str]:
        if not slow_results:
            slow_results.update(run_cases(world_size, module, opt_in, threads=threads, patch=patch))
        return slow_results

    params = [pytest.param(c, marks=pytest.mark.slow) if c in slow else c for c in cases]

    def outcome(request: pytest.FixtureRequest, case: str) -> str:
        return (results_slow() if case in slow else request.getfixturevalue(name))[case]

    @pytest.mark.distributed
    @pytest.mark.parametrize("case", params)
    def test_case(request: pytest.FixtureRequest, case: str) -> None:
        check(outcome(request, case))

    test_case.outcome = outcome  # type: ignore[attr-defined]
    return results, test_case


#: The four ways a conformance module's cases run: (threads, patch). "torch" is torch alone.
CONFORMANCE_KINDS = {
    "processes_patched": (False, True),
    "processes_torch": (False, False),
    "threads_patched": (True, True),
    "threads_torch": (True, False),
}


def conformance_suites(
    world_size: int,
    module: str,
    cases: Sequence[str],
    *,
    compare: bool = True,
    slow_threads: Sequence[str] = (),
) -> dict[str, Any]:
    """A conformance module's tests, for ``globals().update(...)``: its cases on spawned gloo
    ranks and on threads (torch's threaded process group), each with the patch applied and on
    torch alone; with ``compare``, ``test_same_as_torch_alone``: where a case returns
    ``{kind: digest}`` (what it computed and communicated, one digest per way of building the
    policy, see ``tests.conformance.kinds``), every kind's digest under the patch equals the
    ``"upstream"`` digest on torch alone, rank by rank, in the same process-group kind.
    ``slow_threads``: cases whose threaded runs (and their comparison) are in the opt-in tier
    (``-m slow``); the default tier still runs them on spawned ranks, patched and on torch alone.
    """
    suites: dict[str, Any] = {}
    for name, (threads, patch) in CONFORMANCE_KINDS.items():
        slow = slow_threads if threads else ()
        fixture, test = distributed_suite(
            world_size, module, cases, threads=threads, patch=patch, slow=slow
        )
        suites[f"results_{name}"], suites[f"test_{name}"] = fixture, test
    if not compare:
        return suites

    params = [
        pytest.param(
            case,
            threads,
            id=f"{case}-{'threads' if threads else 'processes'}",
            marks=[pytest.mark.slow] if threads and case in slow_threads else [],
        )
        for case in cases
        for threads in (False, True)
    ]

    @pytest.mark.distributed
    @pytest.mark.parametrize(("case", "threads"), params)
    def test_same_as_torch_alone(request: pytest.FixtureRequest, case: str, threads: bool) -> None:
        prefix = "threads" if threads else "processes"
        for kind in (f"{prefix}_patched", f"{prefix}_torch"):
            check(suites[f"test_{kind}"].outcome(request, case))
        patched = case_values(module, threads=threads, patch=True)[case]
        alone = case_values(module, threads=threads, patch=False)[case]
        if all(v is None for v in patched):
            pytest.skip("the case compares nothing with torch alone")
        for rank, (mine, torch_alone) in enumerate(zip(patched, alone, strict=True)):
            assert torch_alone is not None and set(torch_alone) == {"upstream"}, torch_alone
            differ = sorted(k for k, v in mine.items() if v != torch_alone["upstream"])
            assert not differ, f"rank {rank}: {differ} differ from torch alone"

    suites["test_same_as_torch_alone"] = test_same_as_torch_alone
    return suites


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


_rng = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draw from torch's RNG seeded with ``seed``, alone: ranks that are threads of one process
    share the generator, so a case seeds and draws (a model's init, its inputs) under this lock
    or the ranks' draws interleave. Spawned ranks hold it uncontended."""
    with _rng:
        torch.manual_seed(seed)
        yield


def collect_cases(module_globals: dict[str, object]) -> list[str]:
    """Every ``case_*`` function of a module, in definition order."""
    return [n for n, f in module_globals.items() if n.startswith("case_") and callable(f)]


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Run a block on torch's original FSDP2, where building a mapped policy does not install
    the patch either (torch alone, as a control); the patch is re-applied afterwards."""
    from fsdp_precision._policy import armed  # lazy: private, for controls only

    fp.remove_param_dtype_map_patch()
    try:
        with armed.disarmed():
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
