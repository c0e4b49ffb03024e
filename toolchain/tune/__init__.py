"""`toolchain tune`: the search over deployments of a spec (candidates.py), its planning, checks, prediction,
SLO filter, ranking and Pareto front (search.py), what it prints and writes (report.py), and `--measure`, which
deploys the best through the pipeline and picks by measured goodput (measure.py)."""
