"""Layer 5: rules, plans and the planning verbs.

From the bottom: rules and what they claim (``rules``, ``quantized``, ``claims``), the plan's
records (``records``) and cost model (``cost``), where each parameter is used and which modules
can be units (``usage``, ``units``, ``replicated``), building the units (``build``), the plan's
data (``data``: what is planned and read from it, knowing none of the modules above), the
separate-units layout (``separate``), checking, laying out and reporting a plan (``preflight``,
``meshes``, ``report``, ``memory``), the plan with its verbs (``plan``: ``PrecisionPlan``), and
the planning verbs: ``compile`` (:func:`compile_param_dtype_maps`) and ``model_policy``. No
module names a type of a module above it, ``TYPE_CHECKING`` imports included.
"""
