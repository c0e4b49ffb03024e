"""Text <-> tokens for the OpenAI server: the model directory's Hugging Face
tokenizer, its chat template, incremental detokenization and stop strings.

The tokenizer is loaded as the Triton preprocessing/postprocessing models load
it (`AutoTokenizer.from_pretrained` on a directory that must exist, so a typo
is never taken for a Hub id), and the end id / extra stop ids are resolved from
the same config files by `toolchain.eos`, so the OpenAI server stops where
the Triton deployment stops. Those Triton models cannot be imported outside
Triton's Python stub, hence this small shared helper.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.openai.protocol import ApiError
from toolchain.eos import read_tokenizer, resolve
from toolchain.remote_code import auto_tokenizer


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


class TextCodec:
    def __init__(self, tokenizer_dir: Path | str, chat_template: str | None = None, trust_remote_code: bool = False):
        self.directory = Path(tokenizer_dir)
        if not self.directory.is_dir():
            raise ToolchainError(f"tokenizer directory {self.directory} does not exist",
                                 "pass the Hugging Face model directory that holds tokenizer.json")
        self.trust_remote_code = trust_remote_code
        self.tokenizer = auto_tokenizer(self.directory, trust_remote_code=trust_remote_code)
        self.chat_template = chat_template  # the server's override of the tokenizer's own
        eos = resolve(_read_json(self.directory / "config.json") or {},
                      _read_json(self.directory / "generation_config.json"), read_tokenizer(self.directory))
        self.end_id = -1 if eos.end_id is None else int(eos.end_id)
        self.stop_ids = [int(i) for i in eos.stop_ids]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True):
        """(step, state) decoding one token at a time in the Rust tokenizer (tokenizers' DecodeStream
        keeps its own prefix / read offsets), or None where that text could differ from `decode`'s:
        a slow tokenizer, or one whose decode cleans up tokenization spaces afterwards."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return None
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(backend, token_id)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, template: str | None = None,
                    kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        """The prompt text; `tools` (the request's, OpenAI's shape) go to the template as trtllm-serve passes them."""
        template = template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(f"the tokenizer in {self.directory} has no chat template, so /v1/chat/completions cannot "
                           "build a prompt; add `chat_template` to its tokenizer_config.json, start the server with "
                           "--chat-template FILE, or use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=template, tools=tools, **(kwargs or {}))
        except Exception as err:  # a template that raises on these messages (jinja errors, raise_exception)
            raise ApiError(f"the chat template failed on these messages: {type(err).__name__}: {err}") from None


class Detokenizer:
    """Text of a growing token list, piece by piece, so that streamed pieces
    concatenate to the text of the whole list. Each new token is decoded once, in
    the tokenizer's own incremental decoder where the codec has one
    (`decode_stream`); otherwise decoding restarts a few tokens back (`prefix`)
    because a token's text can depend on its neighbours (leading spaces,
    byte-fallback pieces). Either way a piece that ends in an incomplete UTF-8
    character is held back until the next token completes it."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True):
        self.codec, self.skip = codec, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # decoding restarts here
        self.read = 0  # text up to here has been returned
        self.text = ""  # everything returned so far
        self.step = codec.decode_stream(skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        if self.step is not None:
            piece = "".join(filter(None, map(self.step, new_ids)))
            self.text += piece
            return piece
        before = self.codec.decode(self.ids[self.prefix:self.read], self.skip)
        now = self.codec.decode(self.ids[self.prefix:], self.skip)
        if now.endswith("\ufffd") or not now.startswith(before):
            return ""  # wait for the rest of the character (or a decodable boundary)
        self.prefix, self.read = self.read, len(self.ids)
        piece = now[len(before):]
        self.text += piece
        return piece

    def finish(self) -> str:
        """What the whole list decodes to beyond the pieces already returned."""
        full = self.codec.decode(self.ids, self.skip)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        return piece


class StopStrings:
    """OpenAI stop strings over streamed text: the output ends just before the first
    stop string; text that could be the start of one is held back until it is not."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = stops
        self.include = include  # include_stop_str_in_output: the stop string ends the text
        self.pending = ""  # text not yet released
        self.hit: str | None = None

    def feed(self, piece: str) -> str:
        """Text safe to release after `piece`; sets `hit` when a stop string appears."""
        if self.hit is not None:
            return ""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        found = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if found:
            at, self.hit = min(found)
            out, self.pending = self.pending[:at + (len(self.hit) if self.include else 0)], ""
            return out
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        out, self.pending = ("" if self.hit is not None else self.pending), ""
        return out
