"""Triton Python model `preprocessing` (TensorRT-LLM 1.2 contract): text -> token ids.

QUERY [B,1] is tokenized with the tokenizer in the `tokenizer_dir` parameter
and returned right-padded with the pad id as INPUT_ID [B,L] plus
REQUEST_INPUT_LEN [B,1]. Stop/bad word strings become the `[B,2,N]` word lists
of TensorRT-LLM (row 0: the words' ids concatenated, row 1: cumulative end
offsets padded with -1). END_ID/PAD_ID default to the tokenizer's EOS/PAD
(PAD := EOS when the tokenizer has none). Copied into <repo>/preprocessing/1/model.py.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(config, key):
    """A string parameter, or None when missing, empty or an unfilled `${...}`."""
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    if value is None or value == "" or value.startswith("${"):
        return None
    return value


def _flag(text, default):
    if text is None:
        return default
    return text.strip().lower() in ("1", "true", "t", "yes", "y")


def _load_tokenizer(auto_tokenizer, tokenizer_dir, trust_remote_code):
    """The tokenizer, running code from its directory only when the `trust_remote_code` parameter
    (the spec's model.trust_remote_code) says so. Passed explicitly: left unset, transformers would
    prompt on a terminal. This file runs inside Triton's stub, without the toolchain package, hence the copy
    of toolchain.remote_code's message."""
    try:
        return auto_tokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ValueError(f"the tokenizer in {tokenizer_dir} needs Python code from that directory (auto_map) to "
                             "load, and remote code is not run by default (set model.trust_remote_code: true in the "
                             "spec if you trust that code)") from None
        raise


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        # tensorrtllm_backend's preprocessing indexes these two without a fallback:
        # a config without them fails there, so it fails here too.
        for key in ("tokenizer_dir", "multimodal_model_path"):
            if key not in config.get("parameters", {}):
                raise ValueError(f"preprocessing: config.pbtxt has no parameter {key!r} (add it; empty means unset)")
        if _param(config, "multimodal_model_path") is not None:
            raise ValueError("preprocessing: multimodal_model_path is set, but this CPU model serves text only; "
                             "leave it empty")
        tokenizer_dir = _param(config, "tokenizer_dir")
        if tokenizer_dir is None or not os.path.isdir(tokenizer_dir):
            # A missing directory would otherwise be taken for a Hub id and downloaded.
            raise ValueError(f"preprocessing: tokenizer_dir {tokenizer_dir!r} is not a directory")
        self.add_special_tokens = _flag(_param(config, "add_special_tokens"), True)
        self.tokenizer = _load_tokenizer(AutoTokenizer, tokenizer_dir, _flag(_param(config, "trust_remote_code"), False))
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.end_id = -1 if eos is None else int(eos)
        self.pad_id = self.end_id if pad is None else int(pad)
        if self.pad_id < 0:
            self.pad_id = 0
        self.vocab_size = len(self.tokenizer)
        # The repository renders the end id resolved from generation_config.json
        # (an instruct model's chat terminator) and its other EOS ids; requests
        # that send END_ID or stop words still win or add to these.
        end_id = _param(config, "end_id")
        if end_id is not None and end_id.lstrip("-").isdigit():
            self.end_id = int(end_id)
        stops = _param(config, "stop_token_ids") or ""
        self.stop_ids = [int(t) for t in stops.split(",") if t.strip().lstrip("-").isdigit()]
        self.max_chars = self._max_prompt_chars(_param(config, "gpt_model_path"))

    def _max_prompt_chars(self, engine_dir):
        """The longest text that could still fit the engine's max_input_len: that many tokens of the
        vocabulary's longest piece. Longer text is refused before tokenizing it, which for a
        megabyte-sized prompt would hold this (single) instance, and every request behind it, for seconds."""
        try:
            with open(os.path.join(engine_dir or "", "config.json")) as fh:
                max_input_len = int(json.load(fh)["build_config"]["max_input_len"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no engine to read (yet): the tensorrt_llm model still refuses long prompts
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        longest = max((len(self.tokenizer.convert_tokens_to_string([p])) for p in pieces if p), default=1)
        return max_input_len * max(longest, 1)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._process(request)))
            except Exception as err:  # one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"preprocessing: {err}")))
        return responses

    def _process(self, request):
        for name in ("IMAGE_BYTES", "IMAGE_URL", "IMAGES", "VIDEO_BYTES"):
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise ValueError(f"{name}: multimodal inputs are not supported by this deployment")
        query = _input(request, "QUERY")
        batch = query.shape[0]
        end_id = _input(request, "END_ID")
        pad_id = _input(request, "PAD_ID")
        end_id = np.full((batch, 1), self.end_id, np.int32) if end_id is None else end_id.reshape(batch, 1)
        pad_id = np.full((batch, 1), self.pad_id, np.int32) if pad_id is None else pad_id.reshape(batch, 1)

        input_ids, input_lens = self._encode(query, pad_id)
        decoder_query = _input(request, "DECODER_QUERY")
        if decoder_query is not None:
            decoder_ids, decoder_lens = self._encode(decoder_query, pad_id)
        else:  # decoder-only: a one-token placeholder, as the 1.2 preprocessing sends it
            decoder_ids = pad_id.astype(np.int32).reshape(batch, 1)
            decoder_lens = np.ones((batch, 1), np.int32)

        outputs = [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", input_lens),
            pb_utils.Tensor("DECODER_INPUT_ID", decoder_ids),
            pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", decoder_lens),
            pb_utils.Tensor("BAD_WORDS_IDS", self._word_lists(_input(request, "BAD_WORDS_DICT"), batch)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._word_lists(
                _input(request, "STOP_WORDS_DICT"), batch, () if _input(request, "END_ID") is not None else self.stop_ids)),
            pb_utils.Tensor("EMBEDDING_BIAS", self._embedding_bias(
                _input(request, "EMBEDDING_BIAS_WORDS"), _input(request, "EMBEDDING_BIAS_WEIGHTS"), batch)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", _input(request, "REQUEST_OUTPUT_LEN").astype(np.int32)),
            pb_utils.Tensor("OUT_END_ID", end_id.astype(np.int32)),
            pb_utils.Tensor("OUT_PAD_ID", pad_id.astype(np.int32)),
        ]
        extra_id = _input(request, "PROMPT_TABLE_EXTRA_ID")
        if extra_id is not None:
            # Ids past the vocabulary address the prompt table; tag those with the extra id.
            extra = np.where(input_ids >= self.vocab_size, extra_id.reshape(batch, 1), 0).astype(np.uint64)
            outputs.append(pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", extra))
        return outputs

    def _encode(self, texts, pad_id):
        texts = [_text(row.reshape(-1)[0]) for row in texts]
        for text in texts:
            if self.max_chars is not None and len(text) > self.max_chars:
                raise ValueError(f"prompt of {len(text)} characters cannot fit the engine's max_input_len (at most "
                                 f"{self.max_chars} characters with this tokenizer); shorten it")
        rows = [self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens) for text in texts]
        width = max(1, max(len(r) for r in rows))
        ids = np.empty((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            ids[i, :] = pad_id[i, 0]
            ids[i, :len(row)] = row
        return ids, np.array([[len(r)] for r in rows], np.int32)

    def _word_lists(self, words, batch, extra_ids=()):
        if words is None and not extra_ids:
            return np.empty((batch, 2, 0), np.int32)
        rows = words.reshape(batch, -1) if words is not None else [()] * batch
        flat, offsets = [], []
        for row in rows:
            ids, ends = [], []
            for token in extra_ids:  # single-token stop words
                ids.append(token)
                ends.append(len(ids))
            for word in row:
                word_ids = self.tokenizer.encode(_text(word), add_special_tokens=False)
                if word_ids:
                    ids += word_ids
                    ends.append(len(ids))
            flat.append(ids)
            offsets.append(ends)
        width = max(1, max(len(r) for r in flat))
        out = np.zeros((batch, 2, width), np.int32)
        out[:, 1, :] = -1
        for i, (ids, ends) in enumerate(zip(flat, offsets, strict=False)):
            out[i, 0, :len(ids)] = ids
            out[i, 1, :len(ends)] = ends
        return out

    def _embedding_bias(self, words, weights, batch):
        if words is None or weights is None:
            return np.empty((batch, 0), np.float32)
        bias = np.zeros((batch, self.vocab_size), np.float32)
        for i, (row_words, row_weights) in enumerate(zip(words.reshape(batch, -1), weights.reshape(batch, -1), strict=False)):
            if len(row_words) != len(row_weights):
                raise ValueError("EMBEDDING_BIAS_WORDS and EMBEDDING_BIAS_WEIGHTS differ in length")
            for word, weight in zip(row_words, row_weights, strict=False):
                for token in self.tokenizer.encode(_text(word), add_special_tokens=False):
                    bias[i, token] += weight
        return bias

    def finalize(self):
        self.tokenizer = None
