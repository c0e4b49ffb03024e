"""`toolchain bench`: a streaming latency harness for the deployed Triton model.

Layout (each module small, each step replaceable):

- `records`  per-request raw records with monotonic timestamps (the source of truth)
- `metrics`  every statistic derived offline from those records
- `workload` synthetic prompts of exact token lengths
- `client`   closed-loop gRPC streaming load generator
- `report`   report.json / requests.csv / console table
- `run`      `run_bench(spec, grpc_url, out_dir, tokenizer_dir=None) -> dict`

Metric definitions follow section (a) of the latency-harness reference notes.
Heavy imports (tritonclient, transformers) live in the modules that need them
so `import toolchain.bench` stays cheap.
"""
