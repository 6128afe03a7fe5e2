"""The rules' former home, kept for what was pickled from it: a rule set the HF Trainer saved in
its ``training_args.bin`` (or Lightning in its hyperparameters) before the rules moved to
:mod:`fsdp_precision._rules.rules` names its classes by this path. ``pickle`` finds them here;
``torch.load(weights_only=True)`` through the aliases in ``SAFE_GLOBALS``. Nothing imports it.
"""

from fsdp_precision._rules.rules import Glob, ModuleClass, PrecisionRules

__all__ = ["Glob", "ModuleClass", "PrecisionRules"]
