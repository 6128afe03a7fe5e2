"""transformers' native FSDP2 with a model-scoped policy: an explicit, source-guarded opt-in.

``from_pretrained(..., distributed_config=transformers.DistributedConfig(fsdp_size=N))`` wraps
the model itself (``transformers.distributed.fsdp.apply_fully_sharded_data_parallelism``, called
from ``DistributedMixin.maybe_distribute_model`` before the weights load) and hands every
``fully_shard`` call one hard-coded policy, ``MixedPrecisionPolicy(bf16, fp32)`` when
``fsdp_mixed_precision=True``: a router that ``_keep_in_fp32_modules_strict`` keeps in fp32 gets its
own unit and is still gathered in bf16. Inside :func:`transformers_native_fsdp`, that call gets
``model_policy(model, rules)`` instead, built on the model transformers is about to wrap.

Like the torch patch, the opt-in touches private code only where it checked it: it refuses
unless the installed transformers release is in :data:`CHECKED` and the functions it relies on
hash to the recorded sources.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fsdp_precision._base.errors import PatchIntegrityError
from fsdp_precision._base.sources import lookup, source_sha256
from fsdp_precision._plan.model_policy import model_policy
from fsdp_precision._rules.rules import PrecisionRules

__all__ = ["CHECKED", "transformers_native_fsdp"]

_FSDP = "transformers.distributed.fsdp"
_MIXIN = "transformers.distributed.mixin"

#: transformers release -> SHA-256 of each function the opt-in relies on (``_patch._sources``).
CHECKED: dict[str, dict[str, str]] = {
    "5.24.0": {
        f"{_FSDP}:apply_fully_sharded_data_parallelism": (
            "9ad37489531f5851b81c737820ec6c6cc7f1760d919648b77a0279af6061caf6"
        ),
        f"{_FSDP}:_get_fsdp_policy_kwargs": (
            "645c2b0ab84f5918d6d51f6a657fd1b178e7fae5d3b78fb6211f23075178c260"
        ),
        # calls apply_fully_sharded_data_parallelism by the name it imported into the mixin
        f"{_MIXIN}:DistributedMixin.maybe_distribute_model": (
            "4b7491e3340d4620d94a6c441933b3dd9ab0c1a4464cc779e0a3f630a72243ce"
        ),
    },
}


def check_release(version: str) -> None:
    """Raise :class:`PatchIntegrityError` unless ``version`` is checked and its sources match."""
    expected = CHECKED.get(version)
    if expected is None:
        raise PatchIntegrityError(
            f"fsdp_precision's native-FSDP2 opt-in was not checked against transformers {version} "
            f"(checked: {', '.join(sorted(CHECKED))}); nothing was changed. Install a checked "
            "release, or wrap the model yourself: wrap_model_for_training, or fully_shard with "
            "fsdp_precision.model_policy(model, rules)"
        )
    for target, sha in expected.items():
        actual = source_sha256(lookup(target))
        if actual != sha:
            raise PatchIntegrityError(
                f"transformers {version}: {target} differs from the source the native-FSDP2 "
                f"opt-in was checked against (sha256 {actual[:12]}..., expected {sha[:12]}...); "
                "nothing was changed. Reinstall an unmodified transformers, or wrap the model "
                "yourself with fsdp_precision.model_policy"
            )


@contextmanager
def transformers_native_fsdp(rules: PrecisionRules) -> Iterator[None]:
    """While active, transformers' native FSDP2 wraps with ``model_policy(model, rules)``.

    >>> with transformers_native_fsdp(PrecisionRules(param_dtype=torch.bfloat16,  # doctest: +SKIP
    ...                                              reduce_dtype=torch.float32)):
    ...     model = AutoModelForCausalLM.from_pretrained(
    ...         path, dtype=torch.bfloat16,
    ...         distributed_config=transformers.DistributedConfig(fsdp_size=8))

    The rules (and the model's keep declarations: ``_keep_in_fp32_modules_strict`` routers) are
    compiled on the model transformers is about to wrap (on meta, before its weights load), and
    the policy replaces the ``mp_policy`` of every ``fully_shard`` call transformers makes; its
    other knobs (meshes, ``reshard_after_forward``, CPU offload) stay. Mind the name:
    ``transformers.DistributedConfig`` configures transformers' path, not this library's
    ``fsdp_precision.DistributedConfig``. Raises :class:`PatchIntegrityError`, before anything
    is changed, on a transformers release or source this opt-in was not checked against.
    """
    import transformers  # lazy: an optional dependency

    if not isinstance(rules, PrecisionRules):
        raise TypeError(f"rules must be a PrecisionRules, got {type(rules).__name__}")
    check_release(transformers.__version__)
    fsdp: Any = importlib.import_module(_FSDP)
    mixin: Any = importlib.import_module(_MIXIN)
    original = mixin.apply_fully_sharded_data_parallelism

    def apply(model: Any, *args: Any, **kwargs: Any) -> Any:
        policy = model_policy(model, rules)
        policy_kwargs = fsdp._get_fsdp_policy_kwargs
        fsdp._get_fsdp_policy_kwargs = lambda config: {**policy_kwargs(config), "mp_policy": policy}
        try:
            return original(model, *args, **kwargs)
        finally:
            fsdp._get_fsdp_policy_kwargs = policy_kwargs

    mixin.apply_fully_sharded_data_parallelism = apply
    try:
        yield
    finally:
        mixin.apply_fully_sharded_data_parallelism = original
