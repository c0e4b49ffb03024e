"""`toolchain bench`: a latency harness for served LLMs (Triton gRPC/HTTP, OpenAI-compatible).

Layout (each module small, each step replaceable):

- `records`      per-request raw records with monotonic timestamps (the source of truth)
- `metrics`      every statistic derived offline from those records; `slo` thresholds and verdicts
- `workload`     synthetic prompts of exact token lengths; `datasets` the per-level plan of
                 sessions (synthetic, shared prefix, JSONL prompts, multi-turn, classes, cancellation)
- `schedule`     seeded open-loop arrival schedules (Poisson, gamma, constant)
- `protocols`    transports: triton_grpc, triton_http (generate_stream), openai (SSE)
- `loadgen`      the asyncio driver: closed loop (concurrency) and open loop (rate)
- `failfast`     the request deadline (the spec's, or derived from the workload and SLOs) and the stop
                 on a streak of failed requests, with the line that names the endpoint
- `servermetrics` Triton /metrics scraped around each level; `exporter` the harness's own Prometheus metrics
- `report`, `plots` report.json / requests.csv / console tables / PNGs
- `run`          `run_bench(spec, grpc_url, out_dir, ...) -> dict`
- `mock`         known-timing mock servers for tests and benchmarks/harness_accuracy.py
- `results`      the benchmarks' results JSON, printed and written to `--json PATH`

Metric definitions follow genai-perf (genai_perf/profile_data_parser/llm_profile_data_parser.py)
and vLLM's serving benchmark (vllm/benchmarks/serve.py), with the departures `metrics` lists.
Heavy imports (tritonclient, transformers, matplotlib) live in the
modules that need them so `import toolchain.bench` stays cheap.
"""
