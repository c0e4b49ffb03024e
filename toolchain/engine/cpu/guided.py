"""Guided decoding with XGrammar, the library TensorRT-LLM's executor uses (GuidedDecodingParams, xgrammar backend).

A request's `Guide` names what its text must be: any JSON object ("json", the LLM API's json_object), JSON that
follows a schema ("json_schema", `text` is the schema), a regular expression, an EBNF grammar or a structural tag
(executor GuidedDecodingParams::GuideType kJSON, kJSON_SCHEMA, kREGEX, kEBNF_GRAMMAR, kSTRUCTURAL_TAG). One
`GuidedDecoder` per engine compiles guides against the tokenizer (cached by guide); each request gets a
`GrammarMatcher`, whose bitmask the sampler applies before picking and which accepts the picked token. When the
matcher terminates (the grammar is complete and a stop token was picked) the request ends as on end_id.

xgrammar is imported only when a decoder is built, so engines that never guide do not load it.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolchain.remote_code import auto_tokenizer

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")


class GuideError(ValueError):
    """A guide XGrammar rejects; the message is XGrammar's own."""


@dataclass(frozen=True)
class Guide:
    kind: str  # one of GUIDE_TYPES
    text: str = ""  # the schema / regex / EBNF / structural tag JSON ("json" needs none)

    def problem(self) -> str | None:
        if self.kind not in GUIDE_TYPES:
            return f"guide type {self.kind!r} is not one of {', '.join(GUIDE_TYPES)}"
        if not isinstance(self.text, str):
            return f"the {self.kind} guide must be text, got {type(self.text).__name__}"
        if self.kind != "json" and not self.text:
            return f"the {self.kind} guide is empty"
        return None


def tokenizer_info_dict(tokenizer_dir: Path | str, vocab_size: int, trust_remote_code: bool = False) -> dict:
    """The tokenizer-info file the tensorrt_llm backend reads from xgrammar_tokenizer_info_path: keys
    encoded_vocab, tokenizer_str, stop_token_ids (triton_backend/inflight_batcher_llm/src/model_instance_state.cc,
    getGuidedDecodingConfigFromParams). encoded_vocab is the tokenizer's vocabulary by id (padded with "" to
    `vocab_size`, as xgrammar's TokenizerInfo.from_huggingface pads it), tokenizer_str its serialized backend
    tokenizer (from which XGrammar detects the vocabulary's encoding), stop_token_ids its end-of-sequence ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    vocab = [by_id.get(i, "") for i in range(max(vocab_size, max(by_id) + 1))]
    stops = tokenizer.eos_token_id
    stop_ids = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tokenizer_json = Path(tokenizer_dir) / "tokenizer.json"
    text = backend.to_str() if backend is not None else tokenizer_json.read_text() if tokenizer_json.is_file() else ""
    return {"encoded_vocab": vocab, "tokenizer_str": text, "stop_token_ids": stop_ids}


def xgrammar_message(err: Exception) -> str:
    """XGrammar's message on one line, without what its C++ logger puts first ("[hh:mm:ss] /project/cpp/file.cc:line: ",
    "Check failed: (condition) is false: ")."""
    text = " ".join(str(err).split())
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text) or type(err).__name__


class GuidedDecoder:
    """Compiles guides for one tokenizer and hands out matchers."""

    def __init__(self, tokenizer_info: Any):
        import xgrammar as xgr

        self.info = tokenizer_info
        self.vocab_size = int(tokenizer_info.vocab_size)
        self._compiler = xgr.GrammarCompiler(tokenizer_info)
        self._compiled: dict[Guide, Any] = {}
        self._lock = threading.Lock()  # compile from request validation and the batcher thread alike

    @classmethod
    def from_tokenizer_dir(cls, path: Path | str, vocab_size: int, *, trust_remote_code: bool = False) -> "GuidedDecoder":
        import xgrammar as xgr

        tokenizer = auto_tokenizer(path, trust_remote_code=trust_remote_code)
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))

    @classmethod
    def from_info_file(cls, path: Path | str, vocab_size: int | None = None) -> "GuidedDecoder":
        """From the backend's xgrammar_tokenizer_info_path JSON (`tokenizer_info_dict`'s keys)."""
        import xgrammar as xgr

        data = json.loads(Path(path).read_text())
        # As the C++ backend does: the vocabulary's encoding and prefix space detected from tokenizer_str.
        metadata: dict[str, Any] = {"vocab_type": xgr.VocabType.RAW, "add_prefix_space": False}
        if data.get("tokenizer_str"):
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(data["tokenizer_str"])
        vocab = data["encoded_vocab"]
        info = xgr.TokenizerInfo(vocab, metadata["vocab_type"], vocab_size=vocab_size or len(vocab),
                                 stop_token_ids=data.get("stop_token_ids") or None,
                                 add_prefix_space=bool(metadata["add_prefix_space"]))
        return cls(info)

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar (cached); GuideError with XGrammar's message when it rejects the guide."""
        with self._lock:
            if guide in self._compiled:
                return self._compiled[guide]
            c = self._compiler
            try:
                if guide.kind == "json":
                    compiled = c.compile_builtin_json_grammar()
                elif guide.kind == "json_schema":
                    # Without free whitespace between tokens, as TensorRT-LLM compiles schemas (UNVERIFIED, from
                    # _torch/pyexecutor/grammar_matcher.py XGrammarMatcherFactory.create and the C++
                    # batch_manager/guidedDecoder.cpp: any_whitespace=False); with it a small model can fill
                    # max_tokens with newlines inside the object.
                    compiled = c.compile_json_schema(guide.text, any_whitespace=False)
                elif guide.kind == "regex":
                    compiled = c.compile_regex(guide.text)
                elif guide.kind == "ebnf_grammar":
                    compiled = c.compile_grammar(guide.text)
                else:
                    compiled = self._structural_tag(guide.text)
            except Exception as err:  # XGrammar raises RuntimeError / ValueError / its own types
                raise GuideError(xgrammar_message(err)) from err
            self._compiled[guide] = compiled
            return compiled

    def _structural_tag(self, text: str) -> Any:
        """A structural tag in XGrammar's own form ({"type": "structural_tag", "format": ...}), or in the
        {"structures": [{"begin", "schema", "end"}], "triggers": [...]} form TensorRT-LLM's LLM API sends (its
        xgrammar matcher factory calls the two-argument compile_structural_tag then; UNVERIFIED against its source)."""
        import xgrammar as xgr

        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict) and "format" not in data and {"structures", "triggers"} <= set(data):
            try:
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                         for s in data["structures"]]
            except (KeyError, TypeError) as err:
                raise ValueError("each of a structural tag's structures needs begin, schema and end") from err
            return self._compiler.compile_structural_tag(items, data["triggers"])
        return self._compiler.compile_structural_tag(text)

    def matcher(self, guide: Guide) -> "GuideMatcher":
        import xgrammar as xgr

        return GuideMatcher(xgr.GrammarMatcher(self.compile(guide)), self.vocab_size)


class GuideMatcher:
    """One request's grammar state: the mask of allowed tokens, and the tokens picked."""

    def __init__(self, matcher: Any, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] float32 with the tokens the grammar forbids now at -inf (a copy)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.clone()[None]
        width = out.shape[-1]
        self._xgr.apply_token_bitmask_inplace(out, self._bitmask, vocab_size=width)
        return out[0]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar does not accept token {token}")

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
