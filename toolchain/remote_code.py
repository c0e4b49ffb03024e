"""Hugging Face `from_pretrained` loads that run no code from the model directory.

A tokenizer or config directory may carry an `auto_map` naming Python files beside it;
transformers imports (runs) them only with `trust_remote_code=True`. Left unset
(None), transformers asks on a terminal and refuses elsewhere, so every call here
passes the spec's `model.trust_remote_code` explicitly (False unless the user opted in)
and turns the refusal into one line saying which spec field to set.
"""

from __future__ import annotations

from pathlib import Path

from toolchain.errors import ToolchainError

HINT = "set model.trust_remote_code: true in the spec if you trust that code"


def needs_remote_code(err: BaseException) -> bool:
    """Whether `err` is transformers refusing a directory whose loading needs its own code
    (resolve_trust_remote_code's ValueError asks for `trust_remote_code=True`)."""
    return isinstance(err, ValueError) and "trust_remote_code" in str(err)


def refusal(directory: Path | str, what: str = "tokenizer") -> ToolchainError:
    return ToolchainError(f"the {what} in {directory} needs Python code from that directory (auto_map) to load, "
                          "and remote code is not run by default", HINT)


def auto_tokenizer(directory: Path | str, *, trust_remote_code: bool = False, **kwargs):
    """`AutoTokenizer.from_pretrained` on `directory`, trust_remote_code given explicitly."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=bool(trust_remote_code), **kwargs)
    except ValueError as err:
        if needs_remote_code(err):
            raise refusal(directory) from None
        raise


def auto_config(directory: Path | str, *, trust_remote_code: bool = False, **kwargs):
    """`AutoConfig.from_pretrained` on `directory`, trust_remote_code given explicitly."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=bool(trust_remote_code), **kwargs)
    except ValueError as err:
        if needs_remote_code(err):
            raise refusal(directory, "model config") from None
        raise
