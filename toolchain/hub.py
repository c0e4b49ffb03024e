"""Config and tokenizer files of a Hugging Face Hub model, for planning before the weights are at hand.

Only the files `toolchain plan` and model-repo read are fetched (no weights), through
huggingface_hub, into a directory that appears only once complete.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir

# config.json for the planner, generation_config.json for EOS, the tokenizer in its usual spellings.
CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "chat_template.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text))


def _short(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else 'no detail'}"


def fetch_config(repo_id: str, dest: Path) -> Path:
    """Download `repo_id`'s config and tokenizer files into `dest` (replacing it only once complete)."""
    import huggingface_hub
    from huggingface_hub import constants

    try:
        with atomic_dir(dest) as tmp:
            huggingface_hub.snapshot_download(repo_id, local_dir=tmp,
                                              allow_patterns=CONFIG_FILES)
            if not (tmp / "config.json").is_file():
                raise ToolchainError(f"hub model '{repo_id}' has no config.json",
                                     "pass the id of a transformers model repository")
            # snapshot_download keeps its bookkeeping in local_dir/.cache; the model directory needs none of it.
            shutil.rmtree(tmp / ".cache", ignore_errors=True)
    except ToolchainError:
        raise
    except Exception as err:  # offline, DNS, proxy, 401/404: all one line, with what to do instead
        gated = type(err).__name__ in ("GatedRepoError", "RepositoryNotFoundError")
        raise ToolchainError(
            f"cannot fetch '{repo_id}' from the Hugging Face Hub ({constants.ENDPOINT}): {_short(err)}",
            "check the id and log in (HF_TOKEN) for a gated model" if gated else
            "no network here? download config.json and the tokenizer files elsewhere and pass that directory") \
            from None
    return dest
