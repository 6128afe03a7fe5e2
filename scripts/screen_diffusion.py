"""The diffusion screen: do Diffusers' transformer and UNet families train with their declared
keep-in-fp32 modules and the precision advisor's keeps inside bf16 FSDP units, bitwise the
separate-units layout?

Each model is built as ``fsdp-precision plan``/``verify`` build a Diffusers model directory:
its class's default config shrunk by ``tiny_diffusers_config``, in fp32, with the inputs of the
CLI's table (:data:`fsdp_precision._cli.diffusers_models.INPUTS`). The plan: bf16 compute, fp32
reduce, the model's ``_keep_in_fp32_modules`` and the advisor's keeps (``advice="apply"``,
traced on those inputs); units: the ``_no_split_modules`` blocks (else the ``blocks`` /
``transformer_blocks`` children), then the root. On two ranks (gloo, CPU), each rank with its
own inputs:

- ``trains``: two AdamW steps of the in-unit layout (``plan.apply()``) ran;
- ``separate units``: ``bitwise`` when a copy wrapped the public-API way
  (``fsdp_precision.testing.wrap_separate_units``: each kept module its own unit, plain torch
  policies) gives the same losses, every gradient and every parameter after each step, bit for
  bit; where that layout cannot express the plan, why (and the check falls back to
  ``verify_parity``: one step against the unsharded reference, the same inputs on both ranks);
- collectives per step (all-gathers + reduce-scatters) of both layouts.

    python scripts/screen_diffusion.py            # every model, Markdown
    python scripts/screen_diffusion.py wan flux   # some
    python scripts/screen_diffusion.py --json

Exit status 1 when a model does not train, or differs from its reference.
``tests/hf/test_diffusion_screen.py`` runs it; docs/model-families.md holds the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

#: Screen name -> Diffusers model class.
MODELS = {
    "wan": "WanTransformer3DModel",
    "flux": "FluxTransformer2DModel",
    "sd3": "SD3Transformer2DModel",
    "hunyuan_video": "HunyuanVideoTransformer3DModel",
    "ltx_video": "LTXVideoTransformer3DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
    "qwenimage": "QwenImageTransformer2DModel",
    "unet": "UNet2DConditionModel",
}
STEPS = 2
#: A rule label of the advice in ``PrecisionPlan.rule_claims``: kind and pattern.
_ADVICE = re.compile(r"advice \((\w+)\) '(.+)'")
_BLOCK_LISTS = ("transformer_blocks", "blocks")


#: The two ways the advised parameters are kept: as ``advice="apply"`` keeps them (boundary
#: ``"auto"``), and, where that fails, as the failure's note says to (their outputs cast back).
ATTEMPTS = ("advised", "inputs_outputs")


@dataclass
class Attempt:
    """One plan of one model, trained."""

    trains: bool = False
    error: str = ""
    notes: list[str] = field(default_factory=list)  # fsdp_precision's, naming the fix
    separate: str = ""  # "bitwise", "DIFFERS: ...", or "cannot express: ..."
    reference: str = ""  # verify_parity, where separate units cannot express the plan
    collectives: tuple[int, int] = (0, 0)  # ours: all-gathers, reduce-scatters per step
    separate_collectives: tuple[int, int] | None = None

    @property
    def ok(self) -> bool:
        checked = self.reference if self.separate.startswith("cannot") else self.separate
        return self.trains and checked == "bitwise"


@dataclass
class Row:
    """One model's outcome."""

    name: str
    model: str = ""
    params: int = 0
    units: int = 0
    declared: list[str] = field(default_factory=list)  # _keep_in_fp32_modules that keep some
    advised: list[str] = field(default_factory=list)  # "kind pattern" the advice keeps
    kept: int = 0  # parameters computing in fp32
    error: str = ""  # not built or not planned
    attempts: dict[str, Attempt] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """It trains, bitwise its reference, with the advice as applied."""
        return not self.error and self.attempts["advised"].ok


def build(name: str) -> tuple[nn.Module, Any]:
    """The tiny fp32 model, seeded, and its inputs' maker (a generator -> keyword arguments)."""
    from fsdp_precision._cli.diffusers_models import DiffusersConfig, build, inputs_source

    cls = MODELS[name]
    torch.manual_seed(0)
    config = DiffusersConfig(name, cls, {"_class_name": cls})
    model = build(config, torch.device("cpu"), tiny=True, dtype=torch.float32)
    return model, inputs_source(name, model)


def units(model: nn.Module) -> list[nn.Module]:
    from fsdp_precision._plan.units import default_units

    found = default_units(model)
    if len(found) > 1:
        return found
    lists = [getattr(model, n, None) for n in _BLOCK_LISTS]
    blocks = [b for found in lists if isinstance(found, nn.ModuleList) for b in found]
    return [*blocks, model]


def rules(advised: tuple[str, ...] = ()) -> Any:
    """bf16 compute, fp32 reduce, the model's declarations; the advice applied (``advised``
    empty) or its patterns kept with their outputs cast back (``boundary="inputs_outputs"``)."""
    import fsdp_precision as fp

    return fp.PrecisionRules(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        rules=tuple(fp.Glob(p, boundary="inputs_outputs") for p in advised),
        advice="off" if advised else "apply",
    )


def loss_of(out: Any) -> torch.Tensor:
    """The first floating output, squared and averaged in fp32."""
    from torch.utils import _pytree as pytree

    first = next(
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
    )
    return first.float().pow(2).mean()


def train(model: nn.Module, make: Any, rank: int) -> tuple[list[Any], tuple[int, int]]:
    """``STEPS`` AdamW steps: per step the loss, every gradient and every parameter after it
    (full tensors); and the collectives of the first step."""
    from fsdp_precision._base.dist import full_tensor
    from fsdp_precision.testing import CollectiveRecorder

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace, counts = [], (0, 0)
    for step in range(STEPS):
        inputs = make(torch.Generator().manual_seed(1000 * step + rank))
        with CollectiveRecorder() as recorder:
            loss = loss_of(model(**inputs))
            loss.backward()
        if step == 0:
            counts = (recorder.count("all_gather"), recorder.count("reduce_scatter"))
        grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optim.step()
        optim.zero_grad()
        params = {n: full_tensor(p.detach()) for n, p in model.named_parameters()}
        trace.append((loss.detach(), grads, params))
    return trace, counts


def differences(ours: list[Any], theirs: list[Any]) -> list[str]:
    out = []
    for step, ((la, ga, pa), (lb, gb, pb)) in enumerate(zip(ours, theirs, strict=True)):
        if not torch.equal(la, lb):
            out.append(f"step {step} loss {la.item():.6g} vs {lb.item():.6g}")
        for kind, a, b in (("grad", ga, gb), ("param", pa, pb)):
            if a.keys() != b.keys():
                out.append(f"step {step} {kind}s of different parameters")
            out += [f"step {step} {kind} {n}" for n in a if n in b and not torch.equal(a[n], b[n])]
    return out


def _why(exc: Exception) -> str:
    """Why separate units cannot express the plan, in a table cell."""
    text = str(exc).split("separate units cannot express this plan: ")[-1]
    owns = re.match(r"module '(.+?)' owns kept '(.+?)'", text)
    if owns:
        return (
            f"`{owns[1]}` holds kept `{owns[2]}` beside parameters in other dtypes, and a unit "
            "has one param_dtype"
        )
    root = re.match(r"kept parameter '(.+?)' .* sits directly on the root", text)
    if root:
        return f"`{root[1]}` sits on the root beside parameters in other dtypes"
    return text.split(" (")[0][:160]


def _plan(name: str, advised: tuple[str, ...]) -> tuple[Any, Any]:
    import torch.distributed as dist

    import fsdp_precision as fp

    model, make = build(name)
    plan = fp.compile_param_dtype_maps(
        model, rules(advised), units(model), world_size=dist.get_world_size(),
        example_inputs=make(torch.Generator().manual_seed(0)),
    )  # fmt: skip
    return plan, make


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"


def attempt(name: str, advised: tuple[str, ...]) -> Attempt:
    """Train the plan in-unit and check it against separate units (else the unsharded
    reference)."""
    import torch.distributed as dist

    import fsdp_precision as fp
    from fsdp_precision._policy.diagnose import notes_of
    from fsdp_precision.testing import verify_parity, wrap_separate_units

    out, rank = Attempt(), dist.get_rank()
    plan, make = _plan(name, advised)
    try:
        separate = wrap_separate_units(copy.deepcopy(plan.model), plan)
    except fp.ParamDtypeMapError as exc:
        separate = None
        out.separate = f"cannot express: {_why(exc)}"
    try:
        plan.apply()
        ours, out.collectives = train(plan.model, make, rank)
        out.trains = all(bool(torch.isfinite(step[0])) for step in ours)
    except Exception as exc:  # a survey: report and go on
        out.error, out.notes = _error(exc), notes_of(exc)
        return out
    if separate is not None:
        theirs, out.separate_collectives = train(separate, make, rank)
        diff = differences(ours, theirs)
        out.separate = "bitwise" if not diff else f"DIFFERS: {len(diff)}: {', '.join(diff[:3])}"
        return out
    fresh, _ = _plan(name, advised)  # the same inputs on both ranks
    report = verify_parity(fresh, make(torch.Generator().manual_seed(7)))
    out.reference = "bitwise" if report.ok else "DIFFERS: " + "; ".join(report.problems()[:3])
    return out


def screen(name: str) -> Row:
    row = Row(name, MODELS[name])
    try:
        plan, _ = _plan(name, ())
    except Exception as exc:  # a survey: report and go on
        row.error = f"not planned: {_error(exc)}"
        return row
    row.params = sum(p.numel() for p in plan.model.parameters())
    row.units = len(plan.units)
    row.declared = sorted({d.pattern for d in plan.declarations if d.params})
    claimed = {label: fqns for label, fqns in plan.rule_claims.items() if fqns}
    advised = [m.groups() for m in map(_ADVICE.fullmatch, claimed) if m]
    row.advised = [f"{kind} {pattern}" for kind, pattern in advised]
    row.kept = sum(1 for u in plan.units for p in u.params if p.compute == torch.float32)
    row.attempts["advised"] = attempt(name, ())
    if not row.attempts["advised"].trains and advised:
        row.attempts["inputs_outputs"] = attempt(name, tuple(p for _, p in advised))
    return row


def screen_all(names: list[str]) -> list[Row]:
    """Every model, on this rank of a process group (each rank runs the same)."""
    import diffusers.utils.logging as diffusers_logging

    from fsdp_precision._base.dist import is_rank0
    from fsdp_precision._base.launch import process_group
    from fsdp_precision._patch import apply_param_dtype_map_patch

    warnings.filterwarnings("ignore")
    diffusers_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    with process_group("gloo"):
        apply_param_dtype_map_patch()
        for name in names:
            rows.append(screen(name))
            if is_rank0():
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def run(names: list[str], nproc: int = 2) -> list[Row]:
    """The screen on ``nproc`` local processes; rank 0's rows."""
    from fsdp_precision._base.launch import launch

    return launch(screen_all, (list(names),), nproc=nproc)


def _kept(row: Row) -> str:
    declared = ", ".join(f"`{p}`" for p in row.declared) or "none"
    kinds: dict[str, list[str]] = {}
    for entry in row.advised:  # one entry per module: its .weight and .bias rules
        kind, pattern = entry.split(" ", 1)
        module = re.sub(r"\.(weight|bias)$", "", pattern)
        if module not in kinds.setdefault(kind, []):
            kinds[kind].append(module)
    advised = "; ".join(
        f"{kind} {', '.join(f'`{p}`' for p in patterns)}" for kind, patterns in kinds.items()
    )
    return f"{row.kept}: declared {declared}; advised: {advised or 'none'}"


def _outcome(tried: Attempt | None) -> str:
    if tried is None:
        return ""
    if not tried.trains:
        why = f"fails: {tried.error}"
        module = re.findall(r"'([^']+)' \((\w+)\) returned float32", " ".join(tried.notes))
        if module:
            why += "; the note: " + ", ".join(f"`{m}` ({c})" for m, c in module) + " returned fp32"
        return why
    if tried.separate_collectives is not None:
        (ag, rs), (sag, srs) = tried.collectives, tried.separate_collectives
        return f"{tried.separate}: {ag} + {rs} collectives (separate units {sag} + {srs})"
    return f"{tried.separate}; against the unsharded reference (verify_parity): {tried.reference}"


def markdown(rows: list[Row]) -> str:
    lines = [
        "| model | class | params | units | fp32 params: what keeps them | advice applied "
        "(boundary auto) | advised rules with boundary='inputs_outputs' |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.error:
            lines.append(f"| {row.name} | `{row.model}` | | | | {row.error} | |")
            continue
        cells = [_outcome(row.attempts.get(a)) for a in ATTEMPTS]
        lines.append(
            f"| {row.name} | `{row.model}` | {row.params:,} | {row.units} | {_kept(row)} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def failed(rows: list[Row]) -> list[str]:
    """``name: why`` of every model that does not train bitwise its reference as advised."""
    out = []
    for row in rows:
        tried = row.attempts.get("advised")
        if row.error or tried is None:
            out.append(f"{row.name}: {row.error}")
        elif not tried.ok:
            out.append(f"{row.name}: {tried.error or tried.separate or tried.reference}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"some of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(MODELS))
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    rows = run(list(args.names) or list(MODELS))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        import diffusers

        print(f"diffusers {diffusers.__version__}, torch {torch.__version__}\n")
        print(markdown(rows))
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
