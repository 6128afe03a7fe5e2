"""Test-only: save a checkpoint, then SIGKILL this process in the middle of the next save.

    python tests/support/ckpt_kill.py DIR POINT      (POINT: mid_write | before_metadata | between_renames)
    python tests/support/ckpt_kill.py DIR verify STEP   (load DIR/ckpt, expect STEP, bitwise; save again)

Writes ``DIR/ckpt`` at step 1 and ``DIR/step{1,2}.expected.pt`` (the consolidated state at each
step), then starts saving step 2 to ``DIR/ckpt`` and kills itself at POINT through a hook
monkeypatched into this process only (the library reads no environment variable and has no hook).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

import fsdp_precision as fp
from fsdp_precision import checkpoint as _checkpoint
from fsdp_precision._base.dist import free_port as _free_port
from fsdp_precision._edges.checkpoint import metadata as _metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tests.edges.test_checkpoint import full_state, make, train  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
    if point == "mid_write":  # one tensor file item written, the rest not
        original = dcp_fs._write_item
        calls = []

        def write_item(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) > 1:
                die()
            return original(*args, **kwargs)

        dcp_fs._write_item = write_item
    elif point == "before_metadata":  # every shard written, the completion marker not
        _metadata.write_metadata = lambda *a, **k: die()
    elif point == "between_renames":  # previous moved aside, the new one not yet in place
        replace = os.replace

        def guarded(src, dst):  # type: ignore[no-untyped-def]
            if Path(src).name.startswith("ckpt.tmp-") and Path(dst).name == "ckpt":
                die()
            return replace(src, dst)

        os.replace = guarded  # the os module's: every rename of the save protocol goes through it
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def verify(directory: Path, survivor: int) -> None:
    """Load what the killed save left, compare bitwise, then save again (which cleans up)."""
    from tests.edges.test_checkpoint import assert_bitwise

    model, opt = make(7)
    meta = _checkpoint.load_checkpoint(directory / "ckpt", model, opt)
    assert meta["step"] == survivor, meta
    expected = torch.load(directory / f"step{survivor}.expected.pt")
    assert_bitwise(expected, full_state(model, opt))
    _checkpoint.save_checkpoint(directory / "ckpt", model, opt, step=survivor + 10)
    print("verified")


def main() -> None:
    directory, point = Path(sys.argv[1]), sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        run(directory, point)
    finally:
        gc.collect()  # the FSDP model's reference cycles die while the group is alive
        dist.destroy_process_group()
    # A finished script can still die of SIGABRT in interpreter shutdown ("terminate called
    # without an active exception", gloo's threads; seen on torch 2.11 and 2.13 even after the
    # two lines above). What this script checks is done and printed by now: end the process
    # without the shutdown, so the test judges the checkpoint, not torch's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(directory: Path, point: str) -> None:
    fp.apply_param_dtype_map_patch()
    if point == "verify":
        verify(directory, int(sys.argv[3]))
        return
    model, opt = make(0)
    train(model, opt, range(1))
    _checkpoint.save_checkpoint(directory / "ckpt", model, opt, step=1)
    torch.save(full_state(model, opt), directory / "step1.expected.pt")
    train(model, opt, range(1, 2))
    torch.save(full_state(model, opt), directory / "step2.expected.pt")
    install(point)
    _checkpoint.save_checkpoint(directory / "ckpt", model, opt, step=2)
    print("the save finished: the kill hook never fired")


if __name__ == "__main__":
    main()
