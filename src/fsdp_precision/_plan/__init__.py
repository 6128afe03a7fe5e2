"""Layer 5: rules, plans and the planning verbs.

From the bottom: rules and what they claim (``rules``, ``quantized``, ``claims``), the plan's
records (``records``) and cost model (``cost``), where each parameter is used and which modules
can be units (``usage``, ``units``, ``replicated``), building the units (``build``) in either
layout (``separate``), checking and reporting a plan (``preflight``, ``report``), the plan itself
(``plan``, with ``memory``), and the verbs: ``compile`` (:func:`compile_param_dtype_maps`) and
``model_policy``.
"""
