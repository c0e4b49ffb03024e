"""Live-deployment SLO checks (marker perf, run by make perf)."""
