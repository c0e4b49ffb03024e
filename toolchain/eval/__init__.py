"""`toolchain eval`: the converted model against the original HF model on
held-out text: perplexity of both and greedy-token agreement.

Format-agnostic: `evaluate` takes two logits functions, so any checkpoint the
CPU engine runs (unquantized or quantized) is compared with the same code.
"""

from toolchain.eval.metrics import Comparison, evaluate
from toolchain.eval.run import run_eval
from toolchain.eval.texts import token_windows

__all__ = ["Comparison", "evaluate", "run_eval", "token_windows"]
