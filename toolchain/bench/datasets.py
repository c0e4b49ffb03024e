"""What to send: sessions of turns, built from the workload spec and a seed.

A *session* is one or more turns sent one after another (multi-turn carries
the history); a single request is a one-turn session. Sources:

- synthetic: prompts of exact token length (workload.PromptFactory), lengths
  normal around a mean, output length normal around output_tokens;
- shared prefix: N system prompts x M user prompts, requests pick a pair;
- a JSONL prompt file, one object a line (see `parse_line`).

Traffic classes get their share of sessions by a seeded weighted draw and may
set their own lengths, priority and LoRA adapter. Every random choice comes from one
`random.Random` seeded with (seed, level), so a run is reproducible and each
sweep level gets its own prompts (repeating prompts across levels would let a
prefix cache flatter the later ones).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from toolchain.bench.workload import PromptFactory, count_tokens, sample_lengths
from toolchain.errors import ToolchainError

HISTORY_JOIN = "\n"


@dataclass
class Turn:
    text: str | None = None
    """User message (text protocols)."""
    ids: list[int] | None = None
    """The same message as token ids (token-id contract)."""
    messages: list[dict] | None = None
    """A whole chat context from a prompt file (chat protocol; replaces text)."""
    max_tokens: int = 32
    cancel_after: int | None = None
    """Cancel after this many output tokens (None: run to the end)."""


@dataclass
class Session:
    index: int
    cls: str = "default"
    priority: int = 0
    adapter: str | None = None
    """The class's LoRA adapter (a lora.adapters name); None: the base model."""
    system: str | None = None
    system_ids: list[int] | None = None
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Prompt:
    """One request's input, assembled from a session's turn and its history."""

    text: str | None
    messages: list[dict] | None
    ids: list[int] | None
    isl: int
    adapter: str | None = None
    """The LoRA adapter the request asks for (the session's); None: the base model."""


class Plan:
    """Builds sessions for each level; `token_ids` makes prompts as id lists too."""

    def __init__(self, wl, tokenizer, *, max_input: int, max_seq: int, token_ids: bool = False, chat: bool = False):
        self.wl, self.tok = wl, tokenizer
        self.max_input, self.max_seq = max_input, max_seq
        self.token_ids, self.chat = token_ids, chat
        self.classes = [(c.name, c.share, c.priority, c.input_tokens, c.output_tokens, c.adapter)
                        for c in wl.classes]
        self.adapter_of = {c.name: c.adapter for c in wl.classes}
        self.file_entries = load_prompts_file(wl.prompts_file) if wl.prompts_file else None
        sp = wl.shared_prefix
        self.prefixes: list[str] = []
        self.users: list[list[str]] = []
        if sp.num_prefixes and self.file_entries is None:
            factory = PromptFactory(tokenizer)
            factory.rng = random.Random(_seed(wl.seed, "prefix"))  # a str seed, as in sessions()
            self.prefixes = [factory.make(min(sp.prefix_tokens, max_input - 1)).text for _ in range(sp.num_prefixes)]
            user_len = max(1, min(wl.input_tokens, max_input - sp.prefix_tokens - 1))
            self.users = [[factory.make(user_len).text for _ in range(sp.users_per_prefix)]
                          for _ in range(sp.num_prefixes)]
        # Tokenising the corpus is the slow part of a factory: build it once, reseed it per level.
        self._factory = PromptFactory(tokenizer, seed=0) if self._needs_factory() else None

    # ---- sessions ------------------------------------------------------------------------------------------
    def sessions_for(self, num_requests: int) -> int:
        turns = self.wl.multi_turn.turns
        return max(1, -(-num_requests // turns))

    def sessions(self, level: int | str, count: int | None) -> Iterator[Session]:
        """`count` sessions for `level` (None: endless, for duration-bound closed loops)."""
        rng = random.Random(_seed(self.wl.seed, level))
        factory = self._factory
        if factory is not None:
            factory.rng = random.Random(rng.randrange(1 << 30))
        i = 0
        while count is None or i < count:
            yield self._session(i, level, rng, factory)
            i += 1

    def _needs_factory(self) -> bool:
        return self.file_entries is None and (not self.prefixes or self.wl.multi_turn.turns > 1)

    def _class(self, rng: random.Random):
        if not self.classes:
            return "default", 0, None, None, None
        total = sum(c[1] for c in self.classes)
        x, acc = rng.random() * total, 0.0
        for name, share, prio, isl, osl, adapter in self.classes:
            acc += share
            if x < acc:
                return name, prio, isl, osl, adapter
        name, _, prio, isl, osl, adapter = self.classes[-1]
        return name, prio, isl, osl, adapter

    def _session(self, i: int, level, rng: random.Random, factory: PromptFactory | None) -> Session:
        wl = self.wl
        name, prio, cls_isl, cls_osl, adapter = self._class(rng)
        s = Session(index=i, cls=name, priority=prio, adapter=adapter)
        isl_mean = cls_isl or wl.input_tokens
        osl_mean = cls_osl or wl.output_tokens
        if self.file_entries is not None:
            entry = self.file_entries[(i + _level_offset(level, len(self.file_entries))) % len(self.file_entries)]
            s.cls = entry.get("class", s.cls)
            s.adapter = self.adapter_of.get(s.cls, s.adapter)  # a line naming a class takes its adapter
            s.priority = int(entry.get("priority", s.priority))
            texts = entry["turns"]
            osl = entry.get("output_tokens") or osl_mean
            for text in texts:
                turn = Turn(text=text if isinstance(text, str) else None, max_tokens=int(osl))
                if isinstance(text, list) and text and isinstance(text[0], int):
                    turn.ids, turn.text = list(text), self.tok.decode(text, skip_special_tokens=True)
                elif isinstance(text, list):
                    turn.messages = text
                    turn.text = HISTORY_JOIN.join(str(m.get("content", "")) for m in text)
                s.turns.append(turn)
        elif self.prefixes:
            p = rng.randrange(len(self.prefixes))
            s.system = self.prefixes[p]
            s.turns.append(Turn(text=self.users[p][rng.randrange(len(self.users[p]))]))
            for _ in range(wl.multi_turn.turns - 1):
                assert factory is not None  # _needs_factory(): later turns are synthetic
                s.turns.append(Turn(text=factory.make(self._len(isl_mean, rng)).text))
        else:
            assert factory is not None  # _needs_factory(): no file, no prefixes
            for _ in range(wl.multi_turn.turns):
                s.turns.append(Turn(text=factory.make(self._len(isl_mean, rng)).text))
        for turn in s.turns:
            if self.file_entries is None or not turn.max_tokens:
                turn.max_tokens = sample_lengths(osl_mean, wl.output_tokens_stddev, 1, rng, self.max_seq - 1)[0]
            if wl.cancel_fraction and rng.random() < wl.cancel_fraction and turn.max_tokens >= 2:
                turn.cancel_after = rng.randint(1, turn.max_tokens - 1)
            if self.token_ids and turn.ids is None:
                assert turn.text is not None  # every turn made above has its text
                turn.ids = self._encode(turn.text)
        if self.token_ids and s.system:
            s.system_ids = self._encode(s.system + HISTORY_JOIN)
        return s

    def _len(self, mean: int, rng: random.Random) -> int:
        return sample_lengths(mean, self.wl.input_tokens_stddev, 1, rng, self.max_input)[0]

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    # ---- prompts -------------------------------------------------------------------------------------------
    def prompt(self, s: Session, k: int, history: list[tuple[Turn, str, list[int]]]) -> Prompt:
        """Turn k of session s after `history` [(turn, reply text, reply ids)], oldest turns
        dropped until it fits max_input; ISL counted with the deployment tokenizer."""
        turn = s.turns[k]
        while True:
            p = self._assemble(s, turn, history)
            p.adapter = s.adapter
            if p.isl <= self.max_input or not history:
                # prompt + output must fit the engine's sequence limit
                turn.max_tokens = min(turn.max_tokens, max(1, self.max_seq - p.isl))
                return p
            history = history[1:]

    def _assemble(self, s: Session, turn: Turn, history) -> Prompt:
        if self.token_ids:
            ids = list(s.system_ids or [])
            for t, _, reply_ids in history:
                ids += t.ids + reply_ids
            assert turn.ids is not None  # _session() encodes every turn when token_ids is set
            ids += turn.ids
            return Prompt(None, None, ids, len(ids))
        if self.chat:
            msgs = [{"role": "system", "content": s.system}] if s.system else []
            for t, reply, _ in history:
                msgs += (t.messages or [{"role": "user", "content": t.text}]) + [{"role": "assistant", "content": reply}]
            msgs += turn.messages or [{"role": "user", "content": turn.text}]
            # ISL as genai-perf counts chat: message contents joined (the chat template is not counted).
            joined = HISTORY_JOIN.join(m["content"] for m in msgs)
            return Prompt(None, msgs, None, count_tokens(self.tok, joined))
        parts = [s.system] if s.system else []
        for t, reply, _ in history:
            parts += [t.text, reply]
        assert turn.text is not None  # every turn _session() makes has its text
        parts.append(turn.text)
        text = HISTORY_JOIN.join(parts)
        return Prompt(text, None, None, count_tokens(self.tok, text))


def _seed(seed: int, level) -> str:
    # str seeds hash deterministically (sha512) across runs and machines
    return f"{seed}:{level}"


def _level_offset(level, n: int) -> int:
    return 0 if not isinstance(level, int) else (level * 7919) % n


def parse_line(obj, where: str) -> dict:
    """One JSONL object -> {"turns": [...], "output_tokens"?, "class"?, "priority"?}.

    Accepted: {"prompt"|"text": str}, {"messages": [{"role", "content"}, ...]},
    {"input_ids": [int, ...]}, {"turns": [str, ...]}; optional "output_tokens"
    (or "max_tokens"), "class", "priority"."""
    if not isinstance(obj, dict):
        raise ToolchainError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    out: dict = {}
    if isinstance(obj.get("prompt", obj.get("text")), str):
        out["turns"] = [obj.get("prompt", obj.get("text"))]
    elif isinstance(obj.get("messages"), list) and obj["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in obj["messages"]):
        out["turns"] = [obj["messages"]]
    elif isinstance(obj.get("input_ids"), list) and obj["input_ids"] and all(
            isinstance(t, int) and t >= 0 for t in obj["input_ids"]):
        out["turns"] = [obj["input_ids"]]
    elif isinstance(obj.get("turns"), list) and obj["turns"] and all(isinstance(t, str) for t in obj["turns"]):
        out["turns"] = list(obj["turns"])
    else:
        raise ToolchainError(f"{where}: needs a non-empty 'prompt' string, 'messages' list of {{role, content}}, "
                             "'input_ids' list of token ids or 'turns' list of strings")
    osl = obj.get("output_tokens", obj.get("max_tokens"))
    if osl is not None:
        if not isinstance(osl, int) or isinstance(osl, bool) or osl < 1:
            raise ToolchainError(f"{where}: 'output_tokens' must be a positive integer, got {osl!r}")
        out["output_tokens"] = osl
    if "class" in obj:
        out["class"] = str(obj["class"])
    if "priority" in obj:
        if not isinstance(obj["priority"], int) or obj["priority"] < 0:
            raise ToolchainError(f"{where}: 'priority' must be a non-negative integer")
        out["priority"] = obj["priority"]
    return out


def load_prompts_file(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ToolchainError(f"prompts file not found: {path}", "set validation.workload.prompts_file to a JSONL file")
    entries = []
    with path.open(encoding="utf-8", errors="strict") as fh:
        try:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ToolchainError(f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno})",
                                         "write one JSON object a line") from None
                entries.append(parse_line(obj, f"{path}:{n}"))
        except UnicodeDecodeError as err:
            raise ToolchainError(f"{path}: not UTF-8 text ({err.reason})") from None
    if not entries:
        raise ToolchainError(f"prompts file {path} holds no prompts", "write one JSON object a line")
    return entries
