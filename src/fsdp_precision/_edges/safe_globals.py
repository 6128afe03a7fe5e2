"""The library's objects a framework's checkpoint may hold, for loaders that refuse the rest.

Frameworks pickle what users hand them: the HF Trainer ``torch.save``s its arguments (a
``model_policy`` in ``fsdp_plugin_args``), Lightning its hyperparameters (rules, a policy).
``torch.load`` refuses any class it was not told about (``weights_only=True``, its default since
torch 2.6, and Lightning's): ``torch.serialization.safe_globals(SAFE_GLOBALS)`` allows exactly
these, data-only records whose construction validates every field and runs nothing else.
"""

from __future__ import annotations

from fsdp_precision._policy.casts import ModuleCast
from fsdp_precision._policy.policy import ParamDtypeMixedPrecisionPolicy, _FrozenMap
from fsdp_precision._policy.scope import _plain_policy
from fsdp_precision._rules.rules import Glob, PrecisionRules

__all__ = ["SAFE_GLOBALS"]

#: What a pickled rule set or policy of this library is made of (a ``model_policy`` pickles as
#: the plain policy it reads as, through ``_plain_policy``). ``ModuleClass`` rules hold a
#: module class, which a loader must allow by itself. The rules' former path (before they moved
#: below the advisor) is allowed too, for what was pickled under it.
SAFE_GLOBALS: tuple[object, ...] = (
    PrecisionRules,
    Glob,
    (PrecisionRules, "fsdp_precision._plan.rules.PrecisionRules"),
    (Glob, "fsdp_precision._plan.rules.Glob"),
    ModuleCast,
    ParamDtypeMixedPrecisionPolicy,
    _FrozenMap,
    _plain_policy,
)
