"""Per-token mismatch metrics of an engine against the trainer, and their 95% intervals.

Per token, ``d = trainer_logprob - engine_logprob`` of the actual next token. The mismatch KL is
the k3 estimator RL frameworks log for the trainer/rollout mismatch (verl's ``low_var_kl``,
prime-rl's ``mismatch_kl``): the mean over tokens of ``exp(d) - d - 1``. On tokens the engine
sampled it estimates KL(engine || trainer); here the tokens are held-out text (teacher forcing),
so it is the same statistic on those tokens, not an unbiased estimate of that KL.

Two 95% intervals for each metric and for the paired difference kept - stock: a Student t
interval over seeds (each seed: its own training run and its own prompts; few seeds make it
wide), and a bootstrap over prompts (2,000 resamples, prompts resampled within each seed, the
same resample for both engines, the pooled ratio recomputed; percentile interval).
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: Two-sided 95% Student t quantiles by degrees of freedom (1 to 10); beyond, the normal's.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}  # fmt: skip

#: Per-prompt sums: |d|, k3, |p_trainer - p_engine|, predicted tokens, router positions.
TOKEN_SUMS = ("abs_d", "k3", "abs_dp", "tokens", "positions")
#: Per MoE layer, counts of tokens whose top-2 expert sets agree, then the count of flips.
AGREEMENTS = (
    "top2_engine_vs_trainer",  # end to end: what the engine routes
    "top2_fp32_router_on_engine_inputs_vs_trainer",  # drift before the router alone
    "top2_engine_vs_fp32_router_on_engine_inputs",  # the router's precision alone
    "top2_on_flips_engine_vs_trainer",  # end to end, on the trainer's rounding flips
    "flips",
)


def prompt_sums(reference: dict[str, Any], engine: dict[str, Any]) -> torch.Tensor:
    """Per prompt the sums the metrics are ratios of: ``[prompts, columns]``, the columns
    ``TOKEN_SUMS`` then ``AGREEMENTS`` per MoE layer."""
    rows = []
    for p, ref_lp in enumerate(reference["logprobs"]):
        trainer = torch.tensor(ref_lp, dtype=torch.float64)
        served = torch.tensor(engine["logprobs"][p], dtype=torch.float64)
        d = trainer - served
        row = [
            float(d.abs().sum()),
            float((d.exp() - d - 1).sum()),
            float((trainer.exp() - served.exp()).abs().sum()),
            float(d.numel()),
            float(d.numel() + 1),
        ]
        for layer, ref_top in enumerate(reference["top2"][p]):
            want = torch.tensor(ref_top)
            top = torch.tensor(engine["top2"][p][layer])
            ablated = torch.tensor(engine["ablation_top2"][p][layer])
            flips = torch.tensor(reference["flips"][p][layer])
            same = (top == want).all(-1)
            row += [
                float(same.sum()),
                float((ablated == want).all(-1).sum()),
                float((top == ablated).all(-1).sum()),
                float((same & flips).sum()),
                float(flips.sum()),
            ]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def ratios(sums: torch.Tensor, layers: int) -> dict[str, torch.Tensor]:
    """The pooled metrics of column sums ``sums[..., columns]`` (any leading batch shape)."""
    out = {
        "logprob_abs_diff_mean": sums[..., 0] / sums[..., 3],
        "mismatch_kl_k3": sums[..., 1] / sums[..., 3],
        "prob_abs_diff_mean": sums[..., 2] / sums[..., 3],
    }
    for layer in range(layers):
        base = len(TOKEN_SUMS) + layer * len(AGREEMENTS)
        for i, name in enumerate(AGREEMENTS[:3]):
            out[f"layer{layer}_{name}"] = sums[..., base + i] / sums[..., 4]
        out[f"layer{layer}_{AGREEMENTS[3]}"] = sums[..., base + 3] / sums[..., base + 4]
        out[f"layer{layer}_flips_share"] = sums[..., base + 4] / sums[..., 4]
    return out


def t_interval(values: list[float]) -> list[float] | None:
    """The 95% Student t interval of the mean of ``values`` (None with fewer than 2)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T95.get(n - 1, 1.96) * sd / math.sqrt(n)
    return [mean - half, mean + half]


#: The four setups: (a) stock engine, trainer live; (b) kept gates; (c) stock engine, trainer
#: replaying its routes; (d) kept gates and replay.
VARIANTS = ("stock", "kept", "stock_replay", "kept_replay")
#: The paired differences reported, ``a - b``.
PAIRS = (
    ("kept", "stock"),
    ("stock_replay", "stock"),
    ("kept_replay", "stock"),
    ("kept_replay", "kept"),
    ("kept_replay", "stock_replay"),
)


def summarize(
    variants: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    pairs: tuple[tuple[str, str], ...] = PAIRS,
    resamples: int = 2000,
) -> dict[str, Any]:
    """Per metric: each variant's (``name -> (trainer references, engine passes)``, per seed)
    per-seed values, pooled value, and both intervals; and each pair's difference ``a - b``,
    with both intervals (prompts resampled alike for every variant)."""
    first = next(iter(variants.values()))[0]
    layers = len(first[0]["top2"][0])
    sums = {
        name: [prompt_sums(r, e) for r, e in zip(refs, engines, strict=True)]
        for name, (refs, engines) in variants.items()
    }
    g = torch.Generator().manual_seed(0)
    picks = [
        torch.randint(0, s.shape[0], (resamples, s.shape[0]), generator=g)
        for s in next(iter(sums.values()))
    ]
    boot = {
        name: ratios(sum(s[i].sum(1) for s, i in zip(per_seed, picks, strict=True)), layers)
        for name, per_seed in sums.items()
    }
    point = {
        name: ratios(sum(s.sum(0) for s in per_seed), layers) for name, per_seed in sums.items()
    }
    seeds = {name: [ratios(s.sum(0), layers) for s in per_seed] for name, per_seed in sums.items()}
    out: dict[str, Any] = {}
    for metric in next(iter(point.values())):
        row: dict[str, Any] = {}
        for name in sums:
            values = [float(s[metric]) for s in seeds[name]]
            row[name] = {
                "pooled": float(point[name][metric]),
                "per_seed": values,
                "t95_over_seeds": t_interval(values),
                "bootstrap95_over_prompts": quantiles(boot[name][metric]),
            }
        for a, b in pairs:
            diffs = [float(x[metric] - y[metric]) for x, y in zip(seeds[a], seeds[b], strict=True)]
            row[f"{a}_minus_{b}"] = {
                "pooled": float(point[a][metric] - point[b][metric]),
                "per_seed": diffs,
                "t95_over_seeds": t_interval(diffs),
                "bootstrap95_over_prompts": quantiles(boot[a][metric] - boot[b][metric]),
            }
        out[metric] = row
    maxima = {
        name: [max_abs_d(r, e) for r, e in zip(refs, engines, strict=True)]
        for name, (refs, engines) in variants.items()
    }
    out["logprob_abs_diff_max"] = max_row(maxima, pairs)
    return out


def max_row(maxima: dict[str, list[float]], pairs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The largest |Δlogprob| per seed: each variant's and each pair's difference, with t
    intervals (a maximum has no bootstrap over prompts worth the name)."""
    rows = dict(maxima)
    for a, b in pairs:
        rows[f"{a}_minus_{b}"] = [x - y for x, y in zip(maxima[a], maxima[b], strict=True)]
    return {
        name: {
            "per_seed": values,
            "mean": sum(values) / len(values),
            "t95_over_seeds": t_interval(values),
        }
        for name, values in rows.items()
    }


def quantiles(values: torch.Tensor) -> list[float] | None:
    """The 2.5% and 97.5% quantiles, NaNs (resamples without flips) left out; None if all are."""
    q = torch.nanquantile(values, torch.tensor([0.025, 0.975], dtype=values.dtype))
    return None if q.isnan().any() else [float(q[0]), float(q[1])]


def max_abs_d(reference: dict[str, Any], engine: dict[str, Any]) -> float:
    """The largest |trainer - engine| logprob of an actual next token."""
    return max(
        abs(a - b)
        for ref, eng in zip(reference["logprobs"], engine["logprobs"], strict=True)
        for a, b in zip(ref, eng, strict=True)
    )
