"""The MoE screen: do transformers' MoE architectures train with fp32 routers and norms kept
inside bf16 FSDP units, with no hook or ``.float()`` of the user's?

Each architecture is built from its config class at a tiny size in fp32 and wrapped the way
accelerate and the Trainer wrap it: ``fully_shard`` per decoder layer, then the root, every call
with one ``model_policy`` (bf16 compute, fp32 reduce, the kept weights fp32), on two ranks (gloo,
CPU). Kept: its routers, its norms, or both. Under ``boundary="auto"`` (the default) and
``boundary="none"`` (no boundary cast: the model's own code meets the fp32 weights):

- ``ok``: one forward and backward ran;
- ``bitwise``: loss and every gradient equal those of the nested-unit layout with the same casts
  (``layout="separate_units"``: each kept module its own ``fully_shard`` unit, FSDP's own
  ``cast_forward_inputs`` / ``output_dtype``, public API only);
- ``uniform collectives``: as many all-gathers and reduce-scatters on the wire as the uniform
  bf16 policy (counted on the two ranks).

    python scripts/screen_hf_keep.py                 # every architecture, Markdown
    python scripts/screen_hf_keep.py qwen3_moe olmoe # some
    python scripts/screen_hf_keep.py --json

Exit status 1 when an architecture fails under ``"auto"``. ``tests/hf/test_moe_screen.py`` runs
it; docs/rules.md holds the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

ARCHITECTURES = (
    "gpt_oss phimoe afmoe qwen3_next cohere2_moe deepseek_v4 qwen3_5_moe_text deepseek_v3 "
    "deepseek_v2 glm4_moe glm4_moe_lite longcat_flash ernie4_5_moe exaone_moe kimi_linear "
    "mimo_v2_flash minimax_m2 sarvam_moe solar_open bailing_hybrid qwen3_moe qwen2_moe mixtral "
    "olmoe granitemoe granitemoeshared minimax jetmoe llama4_text deepseek_v32 glm_moe_dsa "
    "hunyuan_v1_moe"
).split()

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "first_k_dense_replace": 0,
    "n_group": 2,
    "topk_group": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "use_cache": False,
    "pad_token_id": 0,
    "index_topk": 4,
    "index_head_dim": 16,
    "index_n_heads": 4,
}
#: Multi-head latent attention: rotary embeddings span qk_rope_head_dim, which config.head_dim
#: stands for in these configs; one key-value head per query head (the sparse-attention
#: indexers of deepseek_v32 and glm_moe_dsa need it).
MLA = {"deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash"}
#: What is kept: root-relative globs (those matching nothing in a model are dropped).
KINDS: dict[str, tuple[str, ...]] = {
    "routers": ("*.gate.*", "*router*"),
    "norms": ("*norm*",),
    "both": ("*.gate.*", "*router*", "*norm*"),
}
BOUNDARIES = ("auto", "none")


@dataclass
class Cell:
    """One architecture, one kind, one boundary."""

    kept: int = 0
    ok: bool = False
    bitwise: bool | None = None  # only checked where it trains
    parity: str = ""  # with which rules the nested-unit layout was compared
    uniform_collectives: bool | None = None
    error: str = ""
    notes: list[str] = field(default_factory=list)  # fsdp_precision's, naming the fix


@dataclass
class Row:
    model_type: str
    cells: dict[str, Cell] = field(default_factory=dict)  # "kind/boundary" -> cell
    note: str = ""  # why the architecture was not screened
    uniform_error: str = ""  # the uniform bf16 policy fails too: not a keep problem


def build(model_type: str) -> nn.Module:
    """The tiny fp32 model, seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(SMALL)
    if model_type in MLA:
        small.update(head_dim=small["qk_rope_head_dim"], num_key_value_heads=4)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **small)
    return AutoModelForCausalLM.from_config(config).float()


def units(model: nn.Module) -> list[nn.Module]:
    """What accelerate's transformer-based wrap and the Trainer wrap: the decoder layers, then
    the root."""
    layers = model.get_submodule("model.layers")
    return [*layers, model]


def rules_for(model: nn.Module, kind: str, boundary: str) -> object:
    from fnmatch import fnmatchcase

    import fsdp_precision as fp

    names = [n for n, _ in model.named_parameters()]
    globs, taken = [], set()
    for glob in KINDS[kind]:  # each glob that claims something the earlier ones did not
        matched = {n for n in names if fnmatchcase(n, glob)}
        if matched - taken:
            globs.append(glob)
            taken |= matched
    return fp.PrecisionRules(
        rules=tuple(fp.Glob(g, boundary=boundary) for g in globs),  # type: ignore[arg-type]
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )


def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward on fixed ids: the loss and every gradient, full."""
    from fsdp_precision._base.dist import full_tensor

    ids = torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def counted(
    model: nn.Module,
) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], tuple[int, int]]:
    from fsdp_precision._observe.collectives import CollectiveRecorder

    with CollectiveRecorder() as recorder:
        result = step(model)
    return result, (recorder.count("all_gather"), recorder.count("reduce_scatter"))


def screen_cell(model_type: str, kind: str, boundary: str) -> Cell:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fsdp_precision as fp

    ours = build(model_type)
    rules = rules_for(ours, kind, boundary)
    declared = fp.compile_param_dtype_maps(ours, rules).claims
    cell = Cell(kept=sum(len(c.fqns) for c in declared if not c.declared))
    nested, uniform = copy.deepcopy(ours), copy.deepcopy(ours)
    try:
        policy = fp.model_policy(ours, rules)
        for unit in units(ours):
            fully_shard(unit, mp_policy=policy)
        (loss, grads), collectives = counted(ours)
    except Exception as exc:  # a survey: report and go on
        from fsdp_precision._policy.diagnose import notes_of

        cell.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        cell.notes = notes_of(exc)
        return cell
    cell.ok = True
    cell.bitwise, cell.parity = nested_parity(model_type, rules, nested, loss, grads)
    plain = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units(uniform):
        fully_shard(unit, mp_policy=plain)
    _, uniform_collectives = counted(uniform)
    cell.uniform_collectives = collectives == uniform_collectives
    return cell


def nested_parity(
    model_type: str,
    rules: object,
    nested: nn.Module,
    loss: torch.Tensor,
    grads: dict[str, torch.Tensor],
) -> tuple[bool, str]:
    """Whether the nested-unit layout with the same casts trains bitwise like ours, and with
    which rules: the same, or, where separate units cannot express the model's own
    declarations (a declared parameter beside others in one module), both without them."""
    from dataclasses import replace

    from torch.distributed.fsdp import fully_shard

    import fsdp_precision as fp

    how = "same rules"
    try:
        plan = fp.compile_param_dtype_maps(nested, rules, units(nested), layout="separate_units")
    except fp.ParamDtypeMapError as exc:  # separate units cannot express the declarations
        rules = replace(rules, hf_keep_in_fp32=False)  # type: ignore[type-var]
        how = f"both without the model's declarations ({str(exc).split(';')[0][:160]})"
        ours = build(model_type)
        policy = fp.model_policy(ours, rules)
        for unit in units(ours):
            fully_shard(unit, mp_policy=policy)
        loss, grads = step(ours)
        nested = build(model_type)
        plan = fp.compile_param_dtype_maps(nested, rules, units(nested), layout="separate_units")
    try:
        plan.apply()
        nested_loss, nested_grads = step(nested)
    except Exception as exc:  # separate units need modules that are called
        return False, f"the nested-unit layout fails: {type(exc).__name__}: {str(exc)[:120]}"
    same = torch.equal(loss, nested_loss) and grads.keys() == nested_grads.keys()
    return same and all(torch.equal(grads[n], nested_grads[n]) for n in grads), how


def uniform_error(model_type: str) -> str:
    """How the architecture fails under the uniform bf16 policy, keeping nothing (``""``: it
    trains). Such a failure is the model's, not a keep's: its own fp32 buffers meet bf16
    activations, say."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(model_type)
    plain = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units(model):
        fully_shard(unit, mp_policy=plain)
    try:
        step(model)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return ""


def screen(model_type: str, boundaries: tuple[str, ...] = BOUNDARIES) -> Row:
    row = Row(model_type)
    try:
        build(model_type)
    except Exception as exc:
        row.note = f"not built: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        return row
    row.uniform_error = uniform_error(model_type)
    if row.uniform_error:
        row.note = f"fails under the uniform bf16 policy too, keeping nothing: {row.uniform_error}"
        return row
    for kind in KINDS:
        for boundary in boundaries:
            row.cells[f"{kind}/{boundary}"] = screen_cell(model_type, kind, boundary)
    return row


def _show(cell: Cell | None, checked: bool) -> str:
    """A cell: ``ok``/``fails``, and under ``"auto"`` what else failed."""
    if cell is None:
        return ""
    if not cell.ok:
        return "fails"
    extras = [] if cell.bitwise or not checked else ["not bitwise"]
    extras += [] if cell.uniform_collectives or not checked else ["more collectives"]
    return "ok" + (f" ({', '.join(extras)})" if extras else "")


def markdown(rows: list[Row]) -> str:
    head = [f"{kind} {boundary!r}" for boundary in BOUNDARIES for kind in KINDS]
    lines = ["| architecture | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for row in rows:
        if row.note:
            lines.append(f"| {row.model_type} | {row.note} |" + " |" * (len(head) - 1))
            continue
        cells = [
            _show(row.cells.get(f"{k}/{b}"), checked=b == "auto") for b in BOUNDARIES for k in KINDS
        ]
        lines.append(f"| {row.model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def screen_all(model_types: list[str], boundaries: tuple[str, ...]) -> list[Row]:
    """Every architecture, on this rank of a process group (each rank runs the same)."""
    import transformers.utils.logging as hf_logging

    from fsdp_precision._base.dist import is_rank0
    from fsdp_precision._base.launch import process_group

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    with process_group("gloo"):
        for name in model_types:
            rows.append(screen(name, boundaries))
            if is_rank0():
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def run(
    model_types: list[str], boundaries: tuple[str, ...] = BOUNDARIES, nproc: int = 2
) -> list[Row]:
    """The screen on ``nproc`` local processes; rank 0's rows."""
    from fsdp_precision._base.launch import launch

    return launch(screen_all, (list(model_types), boundaries), nproc=nproc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", default=ARCHITECTURES)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--auto-only", action="store_true", help="skip boundary='none'")
    args = parser.parse_args(argv)
    boundaries = ("auto",) if args.auto_only else BOUNDARIES
    rows = run(list(args.model_types), boundaries)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        import transformers

        print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
        print(markdown(rows))
    return 1 if failed(rows) else 0


def failed(rows: list[Row]) -> list[str]:
    """``model_type kind`` of every cell under ``"auto"`` that did not train bitwise with the
    uniform policy's collectives, and every architecture that was not built (one that fails
    under the uniform policy too is reported, not counted: it is not a keep's failure)."""
    bad = [f"{r.model_type}: {r.note}" for r in rows if r.note and not r.uniform_error]
    for row in rows:
        for key, cell in row.cells.items():
            if key.endswith("/auto") and not (
                cell.ok and cell.bitwise and cell.uniform_collectives
            ):
                bad.append(f"{row.model_type} {key}: {cell.error or cell}")
    return bad


if __name__ == "__main__":
    raise SystemExit(main())
