"""Wall time of the README's main job, ``fsdp-precision demo``, as a user runs it.

    python benchmarks/bench_demo.py --runs 3 [-- DEMO_ARGS...]
    python benchmarks/bench_demo.py --smoke   (one run of the built-in decoder, 2 steps: CI)

Each run is a fresh ``python -m fsdp_precision demo`` (imports, both phases' processes, the
checkpoint, the summary), timed from outside. Prints each run's wall time and the median, and the
time the demo itself reports for its two phases. Target: under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time


def one_run(extra: list[str]) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_precision", "demo", *extra],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"demo failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    reported = re.search(r"^  time .*$", out.stdout, re.M)
    return wall, reported.group(0).strip() if reported else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("demo_args", nargs="*", help="passed to fsdp-precision demo")
    parser.add_argument("--smoke", action="store_true", help="one tiny run, seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.demo_args = 1, ["--model", "builtin", "--steps", "2", "--dim", "16"]
    walls = []
    for i in range(args.runs):
        wall, reported = one_run(args.demo_args)
        walls.append(wall)
        print(f"run {i + 1}: {wall:.1f} s wall; demo reports: {reported}", flush=True)
    print(
        f"median wall: {statistics.median(walls):.1f} s over {args.runs} runs "
        f"({os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
