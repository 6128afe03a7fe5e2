"""The ``fsdp-precision`` command line: presentation only, the library does the work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-precision",
        description="Exact per-parameter precision for PyTorch FSDP2.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small transformer with fp32 norms/router inside bf16 FSDP units, "
        "and check it bitwise against separate fp32 units",
        description="Launches N CPU processes (gloo; NCCL when every rank has a GPU; or runs "
        "under torchrun), trains a small decoder with norms and the MoE router mapped to fp32, "
        "prints per FSDP unit the all-gathered dtypes and bytes and the collective counts, and "
        "checks bitwise parity against the public-API reference.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="processes to launch (default: 2)")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    demo.add_argument("--dim", type=int, default=64, help="model width (default: 64)")
    demo.add_argument("--depth", type=int, default=2, help="transformer blocks (default: 2)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fsdp-precision`` console script."""
    args = _parser().parse_args(argv)
    from fsdp_precision._errors import FsdpPrecisionError

    try:
        if args.command == "demo":
            from ._demo import DemoOptions, run

            opts = DemoOptions(
                nproc=args.nproc, steps=args.steps, dim=args.dim, depth=args.depth, seed=args.seed
            )
            return run(opts)
    except (ValueError, FsdpPrecisionError) as exc:
        print(f"fsdp-precision: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a rank failed: one line, not the spawn traceback
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(f"fsdp-precision: {args.command} failed: {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
