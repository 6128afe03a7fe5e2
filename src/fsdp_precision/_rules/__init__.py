"""Below the advisor: precision rules, the user's vocabulary (``rules``): root-relative globs,
module classes, the model's keep-in-fp32 declarations and the advisor's rules, with their
precedence. The advisor writes them, the plan compiles them.
"""
