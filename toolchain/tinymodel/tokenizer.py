"""A byte-level BPE tokenizer trained on the corpus.

Byte-level means every string round-trips and there is no unknown token, so
prompts of any language reach the model. It is saved through
`PreTrainedTokenizerFast` so `AutoTokenizer.from_pretrained` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2 in this order

# Pieces BPE may merge within, shaped for code: a word or an operator run
# keeps the one space after it ("def ", "= "), and a newline keeps the
# indentation that follows it. GPT-2's split puts the space before the next
# word instead, so a prompt ending in a space ("def ") ends in a token the
# model never saw followed by a name, and greedy output degenerates.
CODE_SPLIT = r"\n[ \t]*|\w+ ?|[^\s\w]+ ?|\s+"

# A base model trained on source files has no dialogue format: a chat request's messages
# become one document, each message's content on its own lines, which is what the model
# continues. It lets OpenAI chat clients (and AIPerf's chat endpoint) talk to it.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}{% endif %}")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CODE_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Llama convention: encoding a prompt starts it with <s>, as in training.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[int]:
    """One token stream: each document as <s> ... </s>, so the model learns
    where files start and end."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if bos is None or eos is None:
        raise ValueError(f"the tokenizer has no {BOS} or no {EOS} token")
    stream: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.append(bos)
        stream.extend(enc.ids)
        stream.append(eos)
    return stream


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                      model_max_length=model_max_length,
                                      # code is whitespace-sensitive: never "clean up" spaces on decode
                                      clean_up_tokenization_spaces=False)
    wrapped.save_pretrained(out_dir)
    # transformers 5 records its own backend class name, which 4.x cannot
    # resolve; the generic fast-tokenizer name loads in both.
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
