"""Which token ends a generation: end_id, pad_id and the extra stop ids.

Instruct models end a turn with a chat terminator (`<|eot_id|>` 128009 for
Llama-3-Instruct, `<|im_end|>` for Qwen) while config.json's `eos_token_id` may
name the end-of-text token, and `generation_config.json` lists several EOS ids
(TensorRT-LLM issue #2120). The rule: end_id is the chat terminator among the EOS ids
(named by the tokenizer when it is there), else the tokenizer's eos_token, else
config.json's; every other EOS id becomes a stop word; pad_id falls back to
end_id. Tokenizer files are read as JSON, without loading transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CHAT_TERMINATORS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def _ids(value) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TokenizerInfo:
    directory: Path
    names: dict[int, str] = field(default_factory=dict)
    """Special / added tokens: id -> text."""
    eos_token: str | None = None
    pad_token: str | None = None
    size: int | None = None
    """Vocabulary size (base vocabulary plus added tokens) when tokenizer.json says."""

    def id_of(self, text: str | None) -> int | None:
        if text is None:
            return None
        for token_id, name in self.names.items():
            if name == text:
                return token_id
        return None

    def label(self, token_id: int) -> str:
        name = self.names.get(token_id)
        return f"{token_id} ({name})" if name else str(token_id)


def read_tokenizer(directory: Path) -> TokenizerInfo | None:
    """Special tokens and size from tokenizer_config.json / tokenizer.json; None without either."""
    directory = Path(directory)
    cfg_path, tok_path = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not cfg_path.is_file() and not tok_path.is_file():
        return None
    info = TokenizerInfo(directory)
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
            text = _token_text(entry)
            if str(key).isdigit() and text:
                info.names[int(key)] = text
        info.eos_token = _token_text(cfg.get("eos_token"))
        info.pad_token = _token_text(cfg.get("pad_token"))
        if tok_path.is_file():
            tok = json.loads(tok_path.read_text())
            for entry in tok.get("added_tokens") or []:
                if isinstance(entry.get("id"), int) and isinstance(entry.get("content"), str):
                    info.names.setdefault(entry["id"], entry["content"])
            vocab = (tok.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                info.size = max([len(vocab) - 1, *vocab.values(), *info.names]) + 1
            elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
                info.size = max([len(vocab) - 1, *info.names]) + 1
    except (OSError, ValueError, AttributeError):
        return None
    return info


@dataclass(frozen=True)
class EosResolution:
    end_id: int | None
    pad_id: int | None
    stop_ids: tuple[int, ...]
    eos_ids: tuple[int, ...]
    """Every EOS id the config files name, generation_config.json first."""
    tokenizer_eos_id: int | None
    """The tokenizer's eos_token: what the preprocessing model sends as end_id by default."""
    source: str
    tokenizer: TokenizerInfo | None = None

    def label(self, token_id: int | None) -> str:
        if token_id is None:
            return "none"
        return self.tokenizer.label(token_id) if self.tokenizer else str(token_id)

    def describe(self) -> str:
        stops = ", ".join(self.label(i) for i in self.stop_ids) or "none"
        return f"end_id {self.label(self.end_id)}, stop ids [{stops}], pad_id {self.label(self.pad_id)} ({self.source})"

    def as_dict(self) -> dict:
        return {"end_id": self.end_id, "pad_id": self.pad_id, "stop_ids": list(self.stop_ids),
                "eos_ids": list(self.eos_ids), "tokenizer_eos_id": self.tokenizer_eos_id, "source": self.source}


def resolve(hf_config: dict, generation_config: dict | None, tokenizer: TokenizerInfo | None) -> EosResolution:
    # A multimodal checkpoint (Llama4ForConditionalGeneration) names its text model's ids in text_config.
    text = hf_config.get("text_config")
    hf_config = {**text, **hf_config} if isinstance(text, dict) else hf_config
    gen = generation_config or {}
    eos: list[int] = []
    for token_id in _ids(gen.get("eos_token_id")) + _ids(hf_config.get("eos_token_id")):
        if token_id not in eos:
            eos.append(token_id)
    source = "generation_config.json" if _ids(gen.get("eos_token_id")) else "config.json"
    tok_eos = tokenizer.id_of(tokenizer.eos_token) if tokenizer else None
    if not eos and tok_eos is not None:
        eos, source = [tok_eos], "tokenizer eos_token"
    end = None
    if tokenizer:
        end = next((i for i in eos if tokenizer.names.get(i) in CHAT_TERMINATORS), None)
        if end is None and tok_eos in eos:
            end = tok_eos
    if end is None:
        cfg_eos = _ids(hf_config.get("eos_token_id"))
        end = cfg_eos[0] if len(cfg_eos) == 1 else (eos[0] if eos else None)
    pads = _ids(gen.get("pad_token_id")) or _ids(hf_config.get("pad_token_id"))
    pad = pads[0] if pads else (tokenizer.id_of(tokenizer.pad_token) if tokenizer else None)
    if pad is None:
        pad = end
    stops = tuple(i for i in eos if i != end)
    return EosResolution(end, pad, stops, tuple(eos), tok_eos, source, tokenizer)
