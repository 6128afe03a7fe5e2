"""Below the plan: the precision advisor and the forward traces it shares with the plan.

Where each parameter is used (``usage``: what call-aware auto-wrap needs), where its values flow
(``flow``: the kinds of sensitive parameter), findings carried from a smaller build
(``stand_in``), grouped into globs (``globs``), the traced advice (``advice``), and what bf16
does to each candidate on real weights and data: a model computing as a uniform or a kept policy
would, one module's parameters cast at a time (``emulate``), each candidate's module run again
on the same inputs (``sites``), the model's end against the reference (``ends``), the figures
(``measure``).
"""
