"""The peers side by side: every way a user keeps router gates (or norms) in fp32 under FSDP2, on
one model and one mesh, in one run.

    python benchmarks/bench_peers.py [--family moe|dense|both] [--steps 30] [--nproc 2]
        [--peer-python NAME=PYTHON ...] [--json PATH] [--markdown PATH] [--smoke]

The peers (``benchmarks/peers/``), each applied as its users apply it: ``torch_uniform`` (torch's
own policy, what accelerate's and the Trainer's FSDP2 do by default: the kept parameters compute
in bf16), ``fsdp_precision`` (this library, in-unit), ``separate_units`` (the public-API
workaround: fp32 child units), ``torchtitan_autocast`` (torchtitan 0.3.0's router: the gate under
fp32 autocast). Peers that patch torch or pin other packages run in a process of their own from
their own venv, given as ``--peer-python NAME=/path/to/venv/bin/python`` (``nemo_automodel``:
NeMo Automodel's ``fully_shard_by_dtype``; ``torch_native``: torch 2.15's
``param_dtype_override_fn``); there each is timed against ``torch_uniform`` run beside it in the
same processes, so every time is a ratio measured paired and interleaved.

The models: a Qwen3-MoE (4 layers, 8 experts, hidden 128) with its routers kept, and a Llama
(4 layers) with its norms kept, fp32 master weights, 2 gloo ranks, one unit per decoder layer and
the root (``benchmarks/peers/harness.py`` says what is measured). ``--smoke``: 2 layers, hidden
64, 2 steps, one peer's memory per family (the library's), the same code path. Prints JSON;
``--markdown`` writes the table ``docs/compared.md`` quotes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from fsdp_precision.testing import launch, process_group  # noqa: E402

#: The peers that run in this environment, in the order they are reported.
LOCAL = ("torch_uniform", "fsdp_precision", "separate_units", "torchtitan_autocast")
#: Module names of the peers (``benchmarks/peers/<module>.py``).
MODULES = {
    "torch_uniform": "torch_uniform",
    "fsdp_precision": "library",
    "separate_units": "separate_units",
    "torchtitan_autocast": "torchtitan_autocast",
    "nemo_automodel": "nemo_automodel",
    "torch_native": "torch_native",
}


def peer(name: str) -> Any:
    return importlib.import_module(f"peers.{MODULES[name]}")


def _measure(names: list[str], family: str, steps: int, smoke: bool) -> dict[str, Any]:
    from peers import harness

    torch.set_num_threads(1)
    with process_group():
        return harness.measure([peer(n) for n in names], family, steps, smoke)


def _memory(name: str, family: str, steps: int, smoke: bool) -> dict[str, Any]:
    from peers import harness

    torch.set_num_threads(1)
    with process_group():
        return harness.memory(peer(name), family, steps, smoke)


def run_here(names: list[str], family: str, args: argparse.Namespace) -> dict[str, Any]:
    """``names`` measured side by side in one process group, then each alone for its memory."""
    runs = launch(
        _measure, (names, family, args.steps, args.smoke), nproc=args.nproc, start_method="spawn"
    )
    # --smoke: the memory of one peer (the library, or the peer of a venv of its own) per family
    for name in [n for n in names if n != "torch_uniform"][:1] if args.smoke else names:
        runs[name]["memory"] = launch(
            _memory, (name, family, 3, args.smoke), nproc=args.nproc, start_method="spawn"
        )
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for package in ("transformers", "fsdp_precision", "nemo_automodel"):
        try:
            versions[package] = importlib.import_module(package).__version__
        except ImportError:
            pass
    return {"runs": runs, "versions": versions}


def run_elsewhere(name: str, python: str, family: str, args: argparse.Namespace) -> dict[str, Any]:
    """``name`` in its own venv, beside ``torch_uniform`` in the same processes."""
    command = [python, str(Path(__file__)), "--only", name, "--family", family,
               "--steps", str(args.steps), "--nproc", str(args.nproc)]  # fmt: skip
    command += ["--smoke"] if args.smoke else []
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def summarize(runs: dict[str, Any], baseline: str = "torch_uniform") -> dict[str, Any]:
    """Per peer: what the table shows."""
    out = {}
    digests: dict[str, list[str]] = {}
    for name, run in runs.items():
        digests.setdefault(run["digest"], []).append(name)
    for name, run in runs.items():
        ratios = [t / b for t, b in zip(run["times"], runs[baseline]["times"], strict=True)]
        memory = run.get("memory", {})
        out[name] = {
            "source": run["source"],
            "as_shipped": run["needed"] == "",
            "needed": run["needed"],
            "units": run["units"],
            "all_gathers": run["all_gathers"],
            "reduce_scatters": run["reduce_scatters"],
            "all_gather_bytes": run["all_gather_bytes"],
            "reduce_scatter_bytes": run["reduce_scatter_bytes"],
            "kept_gathered": run["gathered"],
            "kept_weight_in_forward": sorted({c["weight"] for c in run["computed"].values()}),
            "kept_input": sorted({c["input"] for c in run["computed"].values()}),
            "kept_output": sorted({c["output"] for c in run["computed"].values()}),
            "loss_error": run["loss_error"],
            "last_loss_error": run.get("last_loss_error", float("nan")),
            "grad_error": run["grad_error"],
            "kept_grad_error": run["kept_grad_error"],
            "digest": run["digest"],
            "bitwise_with": sorted(n for n in digests[run["digest"]] if n != name),
            "step_ratio": statistics.median(ratios) if ratios else float("nan"),
            "step_seconds": statistics.median(run["times"]) if run["times"] else float("nan"),
            "peak_rss_mib": max(memory.get("peak_mib", [float("nan")])),
            # what the model and its training took, above the process's imports (venvs differ:
            # torch's CUDA build alone is ~400 MiB more)
            "rss_over_imports_mib": max(
                (
                    p - b
                    for p, b in zip(
                        memory.get("peak_mib", []), memory.get("before_mib", []), strict=True
                    )
                ),
                default=float("nan"),
            ),
        }
    return out


def bitwise_across(peers: dict[str, Any]) -> None:
    """``bitwise_with`` over every row, those measured in other venvs included: the same digest
    of the step-0 loss and gradients is the same bits, whichever process computed it."""
    names: dict[str, list[str]] = {}
    for name, s in peers.items():
        names.setdefault(s.get("digest", name), []).append(name)
    for name, s in peers.items():
        if "digest" in s:
            s["bitwise_with"] = sorted(n for n in names[s["digest"]] if n != name)


HEADER = (
    "| peer | as shipped | units | all-gathers / reduce-scatters per step | KB gathered / "
    "reduced per rank | kept: gathered; weight, input, output in forward | loss err. step 0 / "
    "last | grad err. step 0 (kept) | bitwise with | step vs uniform | peak RSS over imports |"
)


def gpu_case(steps: int) -> dict[str, Any]:
    """``benchmarks/bench_gpu.py``'s ``peers`` case, in its process group (NCCL on a GPU): the
    peers of this environment side by side on the moe family, summarized."""
    from peers import harness

    runs = harness.measure([peer(n) for n in LOCAL], "moe", steps)
    return {"status": "ok", "peers": summarize(runs)}


def gpu_summary(result: dict[str, Any]) -> str:
    """One line per peer, for ``bench_gpu``'s printout."""
    return "\n".join(
        f"   {name:<20} units {s['units']:>2}  AG {s['all_gathers']:>3}  "
        f"RS {s['reduce_scatters']:>3}  kept gathered {'/'.join(s['kept_gathered'])}  "
        f"step x{s['step_ratio']:.2f}"
        for name, s in result["peers"].items()
    )


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for family, data in result["families"].items():
        lines += [f"### {family}: {data['what']}", "", HEADER, "|---" * 11 + "|"]
        for name, s in data["peers"].items():
            if "error" in s:
                lines.append(f"| {name} | did not run: {s['error']} |" + " |" * 9)
                continue
            shipped = "yes" if s["as_shipped"] else f"no: {s['needed']}"
            counts = f"{s['all_gathers']} / {s['reduce_scatters']}"
            lines.append(
                f"| {name} | {shipped} | {s['units']} | {counts} "
                f"| {s['all_gather_bytes'] / 1e3:,.1f} / {s['reduce_scatter_bytes'] / 1e3:,.1f} "
                f"| {'/'.join(s['kept_gathered'])}; {'/'.join(s['kept_weight_in_forward'])}, "
                f"{'/'.join(s['kept_input'])}, {'/'.join(s['kept_output'])} "
                f"| {s['loss_error']:.1e} / {s['last_loss_error']:.1e} "
                f"| {s['grad_error']:.1e} ({s['kept_grad_error']:.1e}) "
                f"| {', '.join(s['bitwise_with']) or '-'} | {s['step_ratio']:.2f}x "
                f"| {s['rss_over_imports_mib']:.0f} MiB |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("moe", "dense", "both"), default="both")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--peer-python", action="append", default=[], metavar="NAME=PYTHON")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # a peer's own venv
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 2
    families = ("moe", "dense") if args.family == "both" else (args.family,)
    if args.only:  # in the peer's venv: it and torch's uniform policy, paired
        (family,) = families
        here = run_here(["torch_uniform", args.only], family, args)
        print(json.dumps(here))
        return
    elsewhere = dict(p.split("=", 1) for p in args.peer_python)
    unknown = (set(elsewhere) - set(MODULES)) | (set(LOCAL) & set(elsewhere))
    if unknown:
        raise SystemExit(
            f"--peer-python {sorted(unknown)}: name one of nemo_automodel, torch_native"
        )
    result: dict[str, Any] = {"benchmark": "peers", "command": " ".join(["python", *sys.argv]),
                              "machine": {"cpu": platform.machine(), "cores": os.cpu_count()},
                              "families": {}}  # fmt: skip
    for family in families:
        here = run_here(list(LOCAL), family, args)
        peers = summarize(here["runs"])
        versions = {"here": here["versions"]}
        for name, python in elsewhere.items():
            there = run_elsewhere(name, python, family, args)
            if "error" in there:
                peers[name] = {"error": there["error"]}
                continue
            versions[name] = there["versions"]
            peers[name] = summarize(there["runs"])[name]
        bitwise_across(peers)
        what = "Qwen3-MoE, routers kept" if family == "moe" else "Llama, norms kept"
        result["families"][family] = {"what": what, "peers": peers, "versions": versions}
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result))
    print(text)


if __name__ == "__main__":
    main()
