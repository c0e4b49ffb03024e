"""Plan before you build: memory per rank, the GPU table, and preflight checks.

`build_context(spec)` loads what the planner needs from config files only;
`run_checks` / `run_preflight` run the registered checks (each with a stable
id); `plan_memory` is the per-rank memory math. Nothing here imports torch
itself or touches weights.
"""
