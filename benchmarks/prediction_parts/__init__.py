"""Parts of benchmarks/prediction.py that run on their own too."""
