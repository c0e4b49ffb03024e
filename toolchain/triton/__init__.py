"""Triton: the model repository rendered from typed configs, the Python-backend
models it ships, and the tritonserver launcher."""
