"""The ``fsdp-precision`` command line: presentation only, the library does the work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fsdp_precision._base.errors import FsdpPrecisionError
from fsdp_precision._policy.diagnose import notes_of

__all__ = ["main"]


_MODEL_HELP = (
    "hf:<model_type> (e.g. hf:deepseek_v3), a local Hugging Face directory with config.json, "
    "or module:callable returning an nn.Module"
)


def _add_keep(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="GLOB[=DTYPE]",
        help="keep parameters matching GLOB in DTYPE (fp32 unless given), before the model's "
        "own keep-in-fp32 declarations; repeatable",
    )


def _add_boundary(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--boundary",
        choices=("auto", "inputs", "inputs_outputs", "none"),
        default="auto",
        help="how a module the --keep rules keep whole meets the activations: auto (inputs "
        "cast to the kept dtype; outputs cast back for norms and scales), inputs, "
        "inputs_outputs, none (the model casts for itself) (default: auto)",
    )


def _add_uncast(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--uncast-inputs",
        default="",
        metavar="NAMES",
        help="comma-separated forward argument names the units' input cast leaves in the "
        "dtype they arrive in, e.g. temb,rotary_emb (a timestep embedding or rotary table "
        "computed in fp32); plan lists the inputs a unit's cast rounds (default: none)",
    )


def _add_advice(parser: argparse.ArgumentParser, *, measured: bool = False) -> None:
    parser.add_argument(
        "--advice",
        choices=("report", "apply", "measured", "off") if measured else ("report", "apply", "off"),
        default="report",
        help="the precision advisor (a traced forward finds routers, log-space parameters, "
        "gains and norms that compute in bf16/fp16): report lists them under the plan, apply "
        "also keeps routers, log-space parameters and gains in fp32, "
        + ("measured keeps what --measure finds above --advice-threshold, " if measured else "")
        + "off skips it (default: report)",
    )
    if measured:
        parser.add_argument(
            "--advice-threshold",
            type=float,
            default=None,
            metavar="SHARE",
            help="with --advice measured: keep a candidate when keeping it alone removes at "
            "least this share of bf16's logits KL, in [0, 1] (default: 0.05)",
        )


def _add_measure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure what bf16 does to each candidate on the model's weights (a directory "
        "with *.safetensors, loaded in fp32): per router the tokens whose experts change, per "
        "module its output error, at the end the logits KL with each kept alone",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="calibration data for --measure: a .txt (tokenized with the directory's "
        "tokenizer) or token ids in a .safetensors/.pt ([rows, tokens]) (default: random "
        "inputs, as verify makes them)",
    )
    parser.add_argument("--batches", type=int, default=4, help="batches to measure on (default: 4)")
    parser.add_argument(
        "--batch-size", type=int, default=4, help="rows per --data batch (default: 4)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=128, help="tokens per --data row (default: 128)"
    )


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _add_units(parser: argparse.ArgumentParser, default: str | None, text: str) -> None:
    parser.add_argument(
        "--units",
        choices=("size", "transformer_block", "accelerate"),
        default=default,
        help="the fully_shard calls: size (a unit per --min-params, as wrap_model_for_training), "
        "transformer_block (the _no_split_modules blocks, then the root), accelerate "
        f"(accelerate's FSDP2 transformer-based wrap: blocks, embedding, norm+head, root) {text}",
    )


def _add_precision(parser: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
    parser.add_argument(
        "--precision",
        choices=choices,
        default="bf16",
        help="mixed-precision preset: compute dtype; gradients reduce in fp32 (default: bf16)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-precision",
        description="Exact per-parameter precision for PyTorch FSDP2.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small transformer on N processes with fp32 router/norms inside bf16 FSDP "
        "units, check it bitwise, checkpoint, resume at another world size",
        description="Launches N processes (gloo on CPU; NCCL when every rank has a GPU; or runs "
        "under torchrun) and trains a small decoder-only transformer (DeepSeek-V3 from its "
        "transformers config when transformers is installed, a built-in one otherwise) with "
        "precision rules compiled to exact per-unit maps. It shows the plan, checks losses, "
        "every sharded gradient and every parameter bitwise against separate fp32 FSDP units, "
        "saves a sharded checkpoint halfway, resumes it on a different number of processes and "
        "checks the resumed run bitwise against the uninterrupted one.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="processes to train on (default: 2)")
    demo.add_argument(
        "--resume-nproc",
        type=int,
        default=None,
        help="processes to resume on (default: 1, or 2 when --nproc is 1)",
    )
    demo.add_argument(
        "--steps", type=int, default=8, help="training steps, checkpoint halfway (default: 8)"
    )
    demo.add_argument(
        "--model",
        default="auto",
        metavar="MODEL",
        help="auto (hf:deepseek_v3 when transformers is installed, else builtin), "
        "hf:deepseek_v3 or builtin (default: auto)",
    )
    demo.add_argument("--dim", type=int, default=64, help="model width (default: 64)")
    demo.add_argument("--depth", type=int, default=2, help="transformer (MoE) blocks (default: 2)")
    _add_precision(demo, ("bf16", "fp16"))
    _add_keep(demo)
    demo.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help="write the checkpoint and results here and keep them (default: a temporary "
        "directory, removed at the end)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    plan = sub.add_parser(
        "plan",
        help="show what FSDP will do to a model's precision and memory, before running it",
        description="Builds MODEL on the meta device (no weights, no download) and prints the "
        "precision plan: per FSDP unit, parameters by storage and compute dtype, bytes per "
        "all-gather, collectives per step, memory per rank, compared with a uniform policy and "
        "with separate fp32 child units.",
    )
    plan.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    plan.add_argument(
        "--world-size", type=int, default=8, help="ranks FSDP shards over (default: 8)"
    )
    for flag, what in (("--tp", "tensor"), ("--ep", "expert"), ("--pp", "pipeline")):
        plan.add_argument(
            flag,
            type=int,
            default=1,
            help=f"{what}-parallel degree beside FSDP, laid out from the model's own "
            f"{flag[2:]}_plan: per-stage collectives and bytes per rank (default: 1)",
        )
    _add_precision(plan, ("bf16", "fp16", "fp32"))
    plan.add_argument(
        "--min-params",
        type=int,
        default=10_000_000,
        help="auto-wrap threshold in parameters (default: 10000000)",
    )
    _add_keep(plan)
    _add_boundary(plan)
    _add_advice(plan, measured=True)
    _add_measure(plan)
    _add_uncast(plan)
    _add_units(plan, "size", "(default: size)")
    plan.add_argument(
        "--no-trace",
        action="store_true",
        help="skip the first forward in the planned compute dtypes (a tiny CPU build)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    verify = sub.add_parser(
        "verify",
        help="check a model sharded by its precision plan against the unsharded reference, "
        "per parameter, on N CPU processes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Builds MODEL on N CPU processes (gloo; transformers configs shrunk to a tiny size unless
--full-size), compiles its precision plan (the model's keep-in-fp32 declarations plus --keep
rules), wraps it with fully_shard and runs one forward, backward and AdamW step, on the same
inputs on every rank, next to an unsharded reference that computes as FSDP does (each
parameter cast to its planned compute dtype, each unit's inputs cast to its param_dtype).
Compared, per parameter: the dtype it was all-gathered in (must be its planned compute
dtype), its gradient and its value after the step; and the loss and output.

Bitwise where the math allows: on 1 and 2 processes everything must be bitwise identical
((g + g) / 2 == g exactly). On other counts the gradient reduction rounds ((g + g + g) / 3
need not be g): gradients must be within N * eps(reduce dtype) * max|grad|, and the
reference optimizer steps on FSDP's gradients so parameters still compare bitwise.
Exit code: 0 when everything matches, 1 when something differs, 2 for a bad MODEL or option.""",
    )
    verify.add_argument(
        "model",
        metavar="MODEL",
        help=_MODEL_HELP + " (with example_inputs(generator) unless it is a transformers model)",
    )
    verify.add_argument("--nproc", type=int, default=2, help="processes to launch (default: 2)")
    _add_precision(verify, ("bf16", "fp16", "fp32"))
    _add_keep(verify)
    _add_boundary(verify)
    _add_advice(verify)
    _add_uncast(verify)
    _add_units(verify, None, "(default: size with --min-params, else transformer_block)")
    verify.add_argument(
        "--full-size",
        action="store_true",
        help="build a transformers MODEL at its config's size instead of the tiny one",
    )
    verify.add_argument(
        "--min-params",
        type=int,
        default=None,
        help="size-based units as wrap_model_for_training makes them (default: the model's "
        "_no_split_modules blocks and the root)",
    )
    verify.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of a table")
    advise_cmd = sub.add_parser(
        "advise",
        help="which parameters need more than bf16 (a traced forward), and with --measure "
        "what bf16 does to each on the model's own weights and data",
        description="Traces one forward of MODEL and lists the parameters whose precision "
        "matters (routers, log-space parameters, gains, timestep features, norms), each with "
        "its reason and a rule to paste. With --measure, loads the weights (a save_pretrained "
        "directory, safetensors only, in fp32) and measures on the calibration batches, per "
        "candidate: its module's output error in bf16 on the same inputs, for a router the "
        "share of tokens whose top-k experts change and the routing-weight error, and at the "
        "model's end the logits KL, argmax flips and loss change with nothing kept, everything "
        "kept, and each candidate alone kept; then ranks the candidates by effect per byte.",
    )
    advise_cmd.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    _add_precision(advise_cmd, ("bf16", "fp16"))
    _add_measure(advise_cmd)
    advise_cmd.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor = sub.add_parser(
        "doctor",
        help="what this machine's torch and packages mean for fsdp_precision",
        description="Reports torch and the integration packages beside the versions the "
        "library was tested with, whether each upstream function the patch relies on matches "
        "its recorded source, torch's native override, the accelerator and backends, and which "
        "layout a plan takes here. Exit code 0 when the patch can run, 1 when it cannot.",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fsdp-precision`` console script."""
    args = _parser().parse_args(argv)

    try:
        if args.command == "demo":
            # lazy: each command imports only what it runs
            from fsdp_precision._cli.demo import DemoOptions, run

            opts = DemoOptions(
                nproc=args.nproc,
                resume_nproc=args.resume_nproc,
                steps=args.steps,
                model=args.model,
                dim=args.dim,
                depth=args.depth,
                precision=args.precision,
                keep=tuple(args.keep),
                output_dir=args.output_dir,
                seed=args.seed,
            )
            return run(opts)
        if args.command == "plan":
            # lazy: each command imports only what it runs
            from fsdp_precision._cli.plan import PlanOptions, run_plan

            return run_plan(
                PlanOptions(
                    model=args.model,
                    world_size=args.world_size,
                    tp=args.tp,
                    ep=args.ep,
                    pp=args.pp,
                    precision=args.precision,
                    min_params=args.min_params,
                    rules=tuple(args.keep),
                    units=args.units,
                    boundary=args.boundary,
                    advice=args.advice,
                    advice_threshold=args.advice_threshold,
                    measure=args.measure,
                    data=args.data,
                    batches=args.batches,
                    batch_size=args.batch_size,
                    seq_len=args.seq_len,
                    uncast_inputs=_names(args.uncast_inputs),
                    trace=not args.no_trace,
                    as_json=args.json,
                )
            )
        if args.command == "advise":
            # lazy: each command imports only what it runs
            from fsdp_precision._cli.advise import AdviseOptions, run_advise
            from fsdp_precision._cli.calibration import Calibration  # lazy: likewise

            return run_advise(
                AdviseOptions(
                    model=args.model,
                    measure=args.measure,
                    data=args.data,
                    calibration=Calibration(
                        batches=args.batches, batch_size=args.batch_size, seq_len=args.seq_len
                    ),
                    precision=args.precision,
                    as_json=args.json,
                )
            )
        if args.command == "doctor":
            from fsdp_precision._cli.doctor import run_doctor  # lazy: only what it runs

            return run_doctor(args.json)
        if args.command == "verify":
            # lazy: each command imports only what it runs
            from fsdp_precision._cli.verify import VerifyOptions, run_verify

            return run_verify(
                VerifyOptions(
                    model=args.model,
                    nproc=args.nproc,
                    precision=args.precision,
                    rules=tuple(args.keep),
                    full_size=args.full_size,
                    min_params=args.min_params,
                    units=args.units,
                    boundary=args.boundary,
                    advice=args.advice,
                    uncast_inputs=_names(args.uncast_inputs),
                    seed=args.seed,
                    as_json=args.json,
                )
            )
    except (ValueError, FsdpPrecisionError) as exc:
        print(f"fsdp-precision: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a rank failed: its error and our notes, not the traceback
        notes = notes_of(exc)
        lines = [ln.strip() for ln in str(exc).splitlines() if ln not in notes and ln.strip()]
        print(
            f"fsdp-precision: {args.command} failed: {lines[-1] if lines else type(exc).__name__}",
            file=sys.stderr,
        )
        for note in notes:
            print(note, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
