"""Below the plan: the precision advisor and the forward traces it shares with the plan.

Where each parameter is used (``usage``: what call-aware auto-wrap needs), where its values flow
(``flow``: the kinds of sensitive parameter), findings carried from a smaller build
(``stand_in``), the traced advice (``advice``), and what bf16 does to each candidate on real
weights and data (``emulate``: a model computing as a uniform or a kept policy would, one
module's parameters cast at a time; ``measure``: the figures).
"""
