"""Bringing an existing deployment over: a hand-made tensorrtllm_backend repository and its engine read into a
spec (target trtllm), and that spec moved to the LLM-API path (llmapi.py)."""
