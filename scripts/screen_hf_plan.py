"""Does ``fsdp-precision plan hf:<model_type>`` work for every transformers architecture?

For every model type of the installed transformers with a causal-LM, seq2seq or
image-text-to-text class, run ``plan hf:<model_type> --world-size 8 --json`` in this process
and report:

- **plans**: ``yes``, or why not: transformers itself cannot build the default config (or the
  model from it, on the meta device), an optional dependency is not installed, the library
  refused the layout with its named error (``refused: ...``: ``--plans-only`` plans one unit per
  transformer block, which a tied parameter across blocks cannot take), or the library failed
  (``library: ...``: a bug to fix);
- **traced**: whether the first forward and backward in the planned compute dtypes reached a
  verdict on a tiny CPU build of the same config: ``yes`` (they ran), ``yes: the planned dtypes
  fail: ...`` (the trace's finding, which ``plan`` prints as a warning), or ``no: ...`` (where it
  stopped for another reason, or why there was none);
- **advice**: whether the precision advisor's forward reached its end: the full-size model on
  the meta device, or, where that stops (it reads values: MoE dispatch, ``Tensor.item()``), the
  tiny CPU build, its findings carried to the full-size names (``no: ...`` says where it
  stopped).

Where the trace or the advice stops, the model's own forward is run on the tiny CPU build in
fp32 without any plan: when that fails too, the row says so (``the model's own forward fails
...``): the default config cannot run a training forward (a token id or a size it leaves
unset), whatever the precision.

    python scripts/screen_hf_plan.py                  # every such model type, Markdown
    python scripts/screen_hf_plan.py mamba2 gemma4    # some
    python scripts/screen_hf_plan.py --json
    python scripts/screen_hf_plan.py --no-trace       # plans only: meta builds, no tiny trace
    python scripts/screen_hf_plan.py --plans-only     # no forward at all: the fastest check
    python scripts/screen_hf_plan.py --record tests/hf/plan_screen.json  # the test's record
                                                      # (the screen, then --plans-only)

Exit status 1 when the library fails on a type (a ``library:`` reason). The table is in
docs/model-families.md; ``tests/hf/test_plan_screen.py`` checks a record of it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: The auto-model tables that make a type part of the screen.
TABLES = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
)
YES = "yes"


@dataclass
class Row:
    """One model type's outcome.

    Attributes:
        name: The transformers model type.
        model: The class ``plan`` built (empty when it built none).
        plans: ``"yes"`` or why not (``"library: ..."`` when the library failed).
        traced: ``"yes"``, ``"yes: the planned dtypes fail: ..."``, ``"no: why"``, or empty when
            it did not plan.
        advice: ``"yes"`` (reached the end of the forward), ``"no: why"``, or empty.
        own_forward: Why the model's own forward fails without any plan, where it does.
        seconds: Wall time of the type's plan.
    """

    name: str
    model: str = ""
    plans: str = ""
    traced: str = ""
    advice: str = ""
    own_forward: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.plans.startswith("library:")


def model_types() -> list[str]:
    """Every model type in :data:`TABLES`, sorted."""
    from transformers.models.auto import modeling_auto

    found: set[str] = set()
    for table in TABLES:
        found |= set(getattr(modeling_auto, table, {}))
    return sorted(found)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:200]


def _missing_dependency(exc: BaseException) -> str | None:
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, ImportError) or ("requires the" in text and "library" in text):
            return text.strip().splitlines()[0][:160] if text.strip() else type(seen).__name__
        seen = seen.__cause__ or seen.__context__
    return None


def _outside_library(model_type: str) -> str | None:
    """Why transformers itself cannot build ``model_type``'s default config or model on meta
    (``None`` when it can: a failure is then the library's)."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        dependency = _missing_dependency(exc)
        if dependency:
            return f"optional dependency not installed: {dependency}"
        return f"transformers cannot build the default config: {_first_line(exc)}"
    import transformers

    error: BaseException | None = None
    for table in (*TABLES, "MODEL_MAPPING_NAMES"):
        names = getattr(modeling_auto, table, {}).get(model_type)
        for name in names if isinstance(names, (list, tuple)) else (names,):
            cls = getattr(transformers, name, None) if name else None
            if cls is None:
                continue
            try:
                with torch.device("meta"):
                    cls._from_config(config)
                return None
            except Exception as exc:  # noqa: BLE001 - reported in the table
                error = error or exc
    if error is None:
        return None
    dependency = _missing_dependency(error)
    if dependency:
        return f"optional dependency not installed: {dependency}"
    return f"transformers cannot build the default config on meta: {_first_line(error)}"


def _traced(first: dict[str, Any]) -> str:
    """``yes`` where the trace reached a verdict: the forward and backward ran, or they failed
    on a dtype in the planned compute dtypes (the trace's finding, printed as a warning)."""
    if first.get("ok"):
        return YES
    if first.get("dtype_error"):
        return f"yes: the planned dtypes fail: {first.get('error', '')}"[:240]
    return f"no: {first.get('error') or first.get('how', '')}"[:240]


def _advice(advice: dict[str, Any] | None) -> str:
    if advice is None:
        return "no: advice off"
    traced = str(advice.get("traced", ""))
    if not advice.get("covered"):
        return f"no: reached no parameter ({traced})"[:240]
    if "stopped early" in traced:
        return f"no: {traced.partition('stopped early: ')[2]}"[:240]
    return YES


def screen(model_type: str, *, trace: bool = True, advice: bool = True, units: str = "size") -> Row:
    """``plan hf:<model_type> --world-size 8 --json`` in this process (``--no-trace`` without
    ``trace``, ``--advice off`` without ``advice``, ``--units``: ``transformer_block`` plans
    without a traced forward)."""
    from fsdp_precision import ParamDtypeMapError
    from fsdp_precision._cli.plan import PlanOptions, run_plan

    row = Row(model_type)
    out = io.StringIO()
    start = time.perf_counter()
    torch.manual_seed(0)
    try:
        with contextlib.redirect_stdout(out):
            options = PlanOptions(
                model=f"hf:{model_type}",
                world_size=8,
                advice="report" if advice else "off",
                units=units,
                trace=trace,
                as_json=True,
            )
            run_plan(options)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        if isinstance(exc, ParamDtypeMapError):  # the library refusing a layout, and why
            row.plans = f"refused: {_first_line(exc)}"
        else:
            row.plans = _outside_library(model_type) or f"library: {_first_line(exc)}"
        row.seconds = round(time.perf_counter() - start, 2)
        return row
    row.seconds = round(time.perf_counter() - start, 2)
    data = json.loads(out.getvalue())
    row.model = str(data.get("model", ""))
    row.plans = YES
    row.traced = _traced(data.get("first_forward", {})) if trace else ""
    row.advice = _advice(data.get("advice")) if advice else ""
    if row.traced.startswith("no:") or row.advice.startswith("no:"):
        own = _own_forward(model_type)
        if own:
            row.traced = row.traced and (OWN if row.traced.startswith("no:") else row.traced)
            row.advice = row.advice and (OWN if row.advice.startswith("no:") else row.advice)
            row.own_forward = own
    return row


OWN = "no: the model's own forward fails"


def _own_forward(model_type: str) -> str:
    """Why the model's own forward fails on a tiny fp32 CPU build of its default config, with
    verify's inputs and no plan at all; ``""`` when it runs."""
    from fsdp_precision._cli.spec import resolve

    spec = resolve(f"hf:{model_type}")
    torch.manual_seed(0)
    try:
        model = spec.build_tiny("cpu", dtype=torch.float32)
        inputs = spec.inputs(model, torch.Generator().manual_seed(0))
        model(**inputs)
    except Exception as exc:  # noqa: BLE001 - the reason, for the table
        return _first_line(exc)
    return ""


def run(
    names: list[str],
    *,
    trace: bool = True,
    advice: bool = True,
    units: str = "size",
    progress: bool = False,
) -> list[Row]:
    """Every model type named, in this process, quietly."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rows = []
    for i, name in enumerate(names):
        with contextlib.redirect_stderr(io.StringIO()):
            rows.append(screen(name, trace=trace, advice=advice, units=units))
        if progress:
            r = rows[-1]
            print(f"[{i + 1}/{len(names)}] {name}: {r.plans[:80]} ({r.seconds}s)", file=sys.stderr)
    return rows


def write_record(rows: list[Row], fast: list[Row], path: str) -> None:
    """The screen as ``tests/hf/test_plan_screen.py`` reads it: per type what it says, and what
    ``--plans-only`` says, with the transformers release it ran on."""
    import transformers

    quick = {r.name: r.plans for r in fast}
    types = {
        r.name: {
            "plans": r.plans,
            "traced": r.traced,
            "advice": r.advice,
            "own_forward": r.own_forward,
            "plans_only": quick[r.name],
        }
        for r in rows
    }
    record = {
        "transformers": transformers.__version__,
        "command": "python scripts/screen_hf_plan.py --record tests/hf/plan_screen.json",
        "types": types,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[Row], *, trace: bool = True, advice: bool = True) -> str:
    """The summary line and the table."""
    planned = [r for r in rows if r.plans == YES]
    library = [r for r in rows if r.plans.startswith("library:")]
    summary = (
        f"{len(planned)} of {len(rows)} model types plan; {len(library)} fail in the library, "
        f"{len(rows) - len(planned) - len(library)} cannot be built by transformers as installed"
    )
    if trace:
        traced = [r for r in planned if r.traced.startswith(YES)]
        failing = sum(r.traced != YES for r in traced)
        summary += f"; traced: {len(traced)} (the planned dtypes fail in {failing})"
    if advice:
        summary += f"; advice reached the end: {sum(r.advice == YES for r in planned)}"
    own = [r for r in planned if r.own_forward]
    if own:
        summary += (
            f"; the model's own forward fails without any plan in {len(own)} (its default "
            "config cannot run a training forward)"
        )
    lines = [
        summary,
        "",
        "| model type | class | plans | traced | advice reached the end |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.model} | {_cell(r.plans)} | {_cell(r.traced)} | {_cell(r.advice)} |"
        )
    if own:
        lines += ["", "Where the model's own forward fails (a tiny fp32 build, no plan):", ""]
        lines += [f"- {r.name}: {_cell(r.own_forward)}" for r in own]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="model types (default: every such type)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--no-trace", action="store_true", help="no tiny CPU trace")
    parser.add_argument(
        "--plans-only",
        action="store_true",
        help="no trace, no advice, transformer-block units: no forward at all, the fastest",
    )
    parser.add_argument("--progress", action="store_true", help="one line per type on stderr")
    parser.add_argument("--record", metavar="PATH", help="also write the record tests read")
    args = parser.parse_args(argv)
    trace = not (args.no_trace or args.plans_only)
    advice = not args.plans_only
    units = "transformer_block" if args.plans_only else "size"
    names = args.names or model_types()
    rows = run(names, trace=trace, advice=advice, units=units, progress=args.progress)
    if args.record:
        fast = run(names, trace=False, advice=False, units="transformer_block")
        write_record(rows, fast, args.record)
    if args.json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in rows], indent=1))
    else:
        import transformers

        print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
        print(markdown(rows, trace=trace, advice=advice))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
