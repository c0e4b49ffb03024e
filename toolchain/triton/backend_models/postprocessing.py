"""Triton Python model `postprocessing` (TensorRT-LLM 1.2 contract): token ids -> text.

TOKENS_BATCH [B, beams, L] and SEQUENCE_LENGTH [B, beams] become OUTPUT
[B, beams] strings via `batch_decode(tokens[:len], skip_special_tokens=...)`.
Each call decodes only what it is given, so a streamed response yields the
text of its own tokens. Copied into <repo>/postprocessing/1/model.py.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(config, key):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    if value is None or value == "" or value.startswith("${"):
        return None
    return value


def _load_tokenizer(auto_tokenizer, tokenizer_dir, trust_remote_code):
    """As preprocessing's: code from the tokenizer directory runs only when the `trust_remote_code`
    parameter (model.trust_remote_code) says so, passed explicitly so transformers never prompts."""
    try:
        return auto_tokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ValueError(f"the tokenizer in {tokenizer_dir} needs Python code from that directory (auto_map) to "
                             "load, and remote code is not run by default (set model.trust_remote_code: true in the "
                             "spec if you trust that code)") from None
        raise


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        tokenizer_dir = _param(config, "tokenizer_dir")
        if tokenizer_dir is None or not os.path.isdir(tokenizer_dir):
            raise ValueError(f"postprocessing: tokenizer_dir {tokenizer_dir!r} is not a directory")
        skip = _param(config, "skip_special_tokens")
        self.skip_special_tokens = True if skip is None else skip.strip().lower() in ("1", "true", "t", "yes", "y")
        trust = (_param(config, "trust_remote_code") or "").strip().lower() in ("1", "true", "t", "yes", "y")
        self.tokenizer = _load_tokenizer(AutoTokenizer, tokenizer_dir, trust)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT", self._decode(tokens, lengths))]))
            except Exception as err:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"postprocessing: {err}")))
        return responses

    def _decode(self, tokens, lengths):
        if tokens.ndim == 2:  # [B, L] from a caller that dropped the beam axis
            tokens = tokens[:, None, :]
        batch, beams = tokens.shape[0], tokens.shape[1]
        lengths = lengths.reshape(batch, beams)
        seqs = [[int(t) for t in tokens[b, k, :max(0, int(lengths[b, k]))] if t >= 0]
                for b in range(batch) for k in range(beams)]
        texts = self.tokenizer.batch_decode(seqs, skip_special_tokens=self.skip_special_tokens)
        return np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(batch, beams)

    def finalize(self):
        self.tokenizer = None
