"""The GPU figures: ``docs/gpu-results.json`` (written by ``benchmarks/bench_gpu.py`` on a GPU
machine) holds every case, meets its goals, and is what ``docs/benchmarks.md`` quotes.

The cases, the ratios and their goals come from the script itself (``CASES``, ``RATIOS``), so
a JSON cannot pass by leaving a case out or by carrying another goal. A ratio meets its goal
when its median is at most the goal plus its measured spread (half the width of the 95%
interval of the median). The docs contract, checked once ``docs/benchmarks.md`` has a section
whose heading names the GPU: it quotes every goal ratio's median at three decimals, names the
GPU and the torch release of the run, and every number it writes with three decimals is one of
the JSON's numbers at three decimals. Until a GPU run is recorded the checks of the recorded
figures skip; the checkers themselves are tested here on made-up results either way.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "gpu-results.json"
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
NO_RUN = "no GPU run recorded yet (benchmarks/bench_gpu.py on a GPU machine writes it)"

sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_gpu's own parts (benchmarks/gpu/)
_spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpu"] = bench
_spec.loader.exec_module(bench)


# ----------------------------------------------------------------------------- the checkers


def result_problems(results: dict[str, Any]) -> list[str]:
    """What keeps a GPU results JSON from being the recorded figures (empty: none)."""
    problems = []
    if results.get("smoke"):
        problems.append("a --smoke run (CPU, tiny sizes), not a GPU run")
    if not results.get("complete"):
        problems.append("the run did not complete (stopped before its last case)")
    cases = results.get("cases", {})
    for case in bench.CASES:
        status = cases.get(case, {}).get("status")
        if status is None:
            problems.append(f"case {case!r} missing")
        elif status == "skipped" and case in bench.OPTIONAL_CASES:
            if not cases[case].get("reason"):
                problems.append(f"case {case!r} skipped without a reason")
        elif status != "ok":
            problems.append(f"case {case!r} is {status}: {cases[case].get('reason')}")
    for (case, variant, reference), goal in bench.RATIOS.items():
        if goal is None or cases.get(case, {}).get("status") != "ok":
            continue
        name = bench.ratio_name(variant, reference)
        ratio = cases[case].get("ratios", {}).get(name)
        if ratio is None:
            problems.append(f"{case}: ratio {name} missing")
        elif ratio["goal"] != goal:
            problems.append(f"{case}: {name} recorded goal {ratio['goal']}, the script's is {goal}")
        elif ratio["n"] < bench.MIN_N:
            problems.append(
                f"{case}: {name} has {ratio['n']} paired iterations, under {bench.MIN_N}: no "
                "interval, insufficient"
            )
        elif not ratio["median"] <= goal + ratio["spread"]:
            problems.append(
                f"{case}: {name} median {ratio['median']:.3f} > goal {goal} + spread "
                f"{ratio['spread']:.3f} (n {ratio['n']})"
            )
    for check in results.get("checks", []):
        if not check["passed"]:
            problems.append(f"check failed: {check['name']} ({check['detail']})")
    return problems


def gpu_section(markdown: str) -> str | None:
    """The text under the first heading that names the GPU, up to the next heading of its level
    or above; ``None`` when there is no such heading."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        heading = re.match(r"(#{1,6})\s+(.*)", line)
        if heading and re.search(r"\bGPUs?\b", heading.group(2)):
            level = len(heading.group(1))
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if (m := re.match(r"(#{1,6})\s", lines[j])) and len(m.group(1)) <= level
                ),
                len(lines),
            )
            return "\n".join(lines[i:end])
    return None


def _floats(value: Any) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floats(v)
    elif isinstance(value, list):
        for v in value:
            yield from _floats(v)


def docs_problems(section: str, results: dict[str, Any]) -> list[str]:
    """Where the GPU section of docs/benchmarks.md and the recorded JSON disagree."""
    problems = []
    recorded = {f"{x:.3f}" for x in _floats(results)}
    for quoted in re.findall(r"(?<![\w.])\d+\.\d{3}(?!\d)", section):
        if quoted not in recorded:
            problems.append(f"the docs quote {quoted}, which the JSON does not hold")
    for (case, variant, reference), goal in bench.RATIOS.items():
        ratio = (
            results["cases"]
            .get(case, {})
            .get("ratios", {})
            .get(bench.ratio_name(variant, reference))
        )
        if goal is not None and ratio is not None and f"{ratio['median']:.3f}" not in section:
            problems.append(
                f"the docs do not quote {case} {variant} / {reference}: {ratio['median']:.3f}"
            )
    machine = results.get("machine", {})
    for what in ("gpu", "torch"):
        if machine.get(what) and machine[what] not in section:
            problems.append(f"the docs do not name the run's {what}: {machine[what]}")
    return problems


# ----------------------------------------------------------------------------- the recorded run


def _recorded() -> dict[str, Any]:
    if not RESULTS.exists():
        pytest.skip(NO_RUN)
    results: dict[str, Any] = json.loads(RESULTS.read_text())
    return results


def test_recorded_gpu_figures_hold_every_case_and_meet_their_goals() -> None:
    assert result_problems(_recorded()) == []


def test_benchmarks_doc_quotes_the_recorded_gpu_figures() -> None:
    results = _recorded()
    section = gpu_section(BENCHMARKS_MD.read_text())
    if section is None:
        pytest.skip("docs/benchmarks.md has no GPU section yet")
    assert docs_problems(section, results) == []


# ----------------------------------------------------------------------------- the checkers, tested


def _made_up() -> dict[str, Any]:
    """A complete, passing result in the script's shape (numbers made up)."""
    cases: dict[str, Any] = {
        case: {"status": "ok", "ratios": {}} for case in bench.CASES if case != "wan_block"
    }
    cases["wan_block"] = {"status": "skipped", "reason": "diffusers does not import"}
    for (case, variant, reference), goal in bench.RATIOS.items():
        if case in cases and cases[case]["status"] == "ok":
            median = 1.004 if goal is not None else 1.250
            cases[case]["ratios"][bench.ratio_name(variant, reference)] = {
                "median": median, "spread": 0.006, "goal": goal, "n": 40,
            }  # fmt: skip
    return {
        "smoke": False,
        "complete": True,
        "machine": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"},
        "cases": cases,
        "checks": [{"name": "kept parameters add no collective", "passed": True, "detail": ""}],
    }


def test_a_complete_passing_result_has_no_problems() -> None:
    assert result_problems(_made_up()) == []


def test_a_ratio_over_its_goal_plus_spread_is_a_problem() -> None:
    results = _made_up()
    ratio = results["cases"]["kept_compiled"]["ratios"]["kept_over_uniform"]
    ratio["median"] = 1.03 + 0.006 + 0.001  # just over goal + spread
    assert result_problems(results) == [
        "kept_compiled: kept_over_uniform median 1.037 > goal 1.03 + spread 0.006 (n 40)"
    ]
    ratio["median"] = 1.035  # over the goal, within its spread: met
    assert result_problems(results) == []


def test_fewer_than_six_iterations_is_insufficient_never_met() -> None:
    """With n < 6 the median's 95% interval is the whole range: a smoke run's 1.157 against a
    1.03 goal read as met (issue 53)."""
    results = _made_up()
    results["cases"]["kept_eager"]["ratios"]["kept_over_uniform"]["n"] = 5
    assert result_problems(results) == [
        "kept_eager: kept_over_uniform has 5 paired iterations, under 6: no interval, insufficient"
    ]
    stats = bench.ratio_stats([1.157, 1.0, 1.2, 0.9, 1.1], [1.0] * 5, 1.03)
    assert stats["spread"] > 0.1 and not stats["sufficient"]
    assert stats["within_goal_plus_spread"] is False and stats["meets_goal"] is False
    assert bench.ratio_stats([1.0] * 6, [1.0] * 6, 1.03)["within_goal_plus_spread"] is True


def test_the_default_model_is_sized_to_an_h100() -> None:
    """The fit check on the default Qwen3-MoE (about 134 M parameters of embeddings and head,
    320 M a layer: 2.70 B at 8 layers) against an H100's free memory: a resident pair of 8
    layers (65 GB of states) does not fit, fewer layers do, and the chosen depth is the most
    that fits."""
    fit = importlib.import_module("gpu.fit")
    free = 79 * 2**30

    def params_at(n: int) -> int:
        return 134_000_000 + n * 320_000_000

    layers, record = fit.layers_that_fit(params_at, 8, free)
    assert 0 < layers < 8 and record["layers"] == layers
    assert record["pair_state_bytes"] <= fit.SHARE * free < record["asked_pair_state_bytes"]
    bigger, _ = fit.layers_that_fit(params_at, layers + 1, free)
    assert bigger == layers  # one more layer would not fit
    assert fit.layers_that_fit(params_at, 8, 2**30)[0] == 0  # nothing fits: 0, never a guess


def test_a_missing_case_ratio_or_goal_is_a_problem() -> None:
    results = _made_up()
    del results["cases"]["export"]
    del results["cases"]["overhead"]["ratios"]["empty_map_over_unpatched"]
    results["cases"]["kept_eager"]["ratios"]["kept_over_uniform"]["goal"] = 1.2
    results["cases"]["kept_compiled"] = {"status": "skipped", "reason": "--budget-s spent"}
    assert result_problems(results) == [
        "case 'export' missing",
        "case 'kept_compiled' is skipped: --budget-s spent",
        "overhead: ratio empty_map_over_unpatched missing",
        "kept_eager: kept_over_uniform recorded goal 1.2, the script's is 1.03",
    ]


def test_a_smoke_or_unfinished_run_or_failed_check_is_a_problem() -> None:
    results = _made_up()
    results.update(smoke=True, complete=False)
    results["checks"][0]["passed"] = False
    assert result_problems(results) == [
        "a --smoke run (CPU, tiny sizes), not a GPU run",
        "the run did not complete (stopped before its last case)",
        "check failed: kept parameters add no collective ()",
    ]


_DOC = """# Benchmarks

## Step time (`benchmarks/bench_step.py`)

| ratio | median |
|---|---|
| mapped / uniform | 1.029 |

## On one GPU (`benchmarks/bench_gpu.py`)

NVIDIA H200, torch 2.11.0+cu130, one rank. Kept / uniform, eager: 1.004.

| case | ratio | median | goal |
|---|---|---|---|
| overhead | empty map / unpatched | 1.004 | 1.010 |
| eager | kept / uniform | 1.004 | 1.030 |
| compiled | kept / uniform | 1.004 | 1.030 |
| eager | separate / uniform | 1.250 | |

## Next section
"""


def test_the_gpu_section_is_found_and_ends_at_the_next_heading() -> None:
    section = gpu_section(_DOC)
    assert section is not None
    assert section.startswith("## On one GPU") and "Next section" not in section
    assert "1.029" not in section  # another section's figure
    assert gpu_section("# Benchmarks\n\n## Step time\n") is None


def test_docs_quoting_the_json_have_no_problems_and_a_wrong_figure_is_named() -> None:
    results = _made_up()
    section = gpu_section(_DOC)
    assert section is not None
    assert docs_problems(section, results) == []
    assert docs_problems(section.replace("| 1.250 |", "| 1.251 |"), results) == [
        "the docs quote 1.251, which the JSON does not hold"
    ]
    assert docs_problems(section.replace("eager: 1.004.", "eager: 1.014."), results) == [
        "the docs quote 1.014, which the JSON does not hold"  # at the end of a sentence too
    ]
    moved = copy.deepcopy(results)
    moved["cases"]["kept_eager"]["ratios"]["kept_over_uniform"]["median"] = 1.012
    moved["machine"]["torch"] = "2.11.1+cu130"
    assert docs_problems(section, moved) == [
        "the docs do not quote kept_eager kept / uniform: 1.012",
        "the docs do not name the run's torch: 2.11.1+cu130",
    ]
