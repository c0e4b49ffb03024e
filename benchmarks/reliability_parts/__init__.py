"""The parts of benchmarks/reliability.py, one module each, and what they share.

`common` holds the deployment, /proc and /metrics readings and the HTTP and gRPC clients; `hostile` is
part (a), `cancellation` (b), `soak` (c), `crash` (d) and `dying` (e). benchmarks/reliability.py runs
them; this folder is not itself a benchmark (`make bench` runs benchmarks/*.py only).
"""
