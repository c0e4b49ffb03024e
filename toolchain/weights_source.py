"""Where the weights of a converted deployment came from.

On a GPU host the README's sequence gives the weights once, to `convert`
(`--set model.checkpoint=/models/X`), while the spec's own `model.checkpoint`
stays the config-only directory it was planned from. `convert` records the
source it read (checkpoint and tokenizer directories) in its manifest; the later
stages, run with the plain spec, take the weights from that record when the
spec's directory holds none, so they neither look for weights that are not
there nor read another tokenizer than the one convert used.

A spec whose own directory holds weights is used as it is: those weights win
(and a changed input reconverts, as before).
"""

from __future__ import annotations

from pathlib import Path

from toolchain.manifest import Manifest
from toolchain.spec import DeploymentSpec
from toolchain.workspace import Workspace

# A sharded Hugging Face checkpoint's index (transformers' SAFE_WEIGHTS_INDEX_NAME).
INDEX = "model.safetensors.index.json"


def has_weights(directory: Path | str) -> bool:
    """True when `directory` holds safetensors weights (one file or a sharded index)."""
    directory = Path(directory)
    return (directory / INDEX).is_file() or any(directory.glob("*.safetensors"))


def source_record(spec: DeploymentSpec) -> dict[str, str]:
    """What `convert` writes under outputs.source: the directories it read, absolute."""
    return {"checkpoint": str(Path(spec.model.checkpoint).resolve()),
            "tokenizer": str(Path(spec.model.tokenizer_dir).resolve())}


def recorded_source(spec: DeploymentSpec, workspace: Workspace) -> dict[str, str] | None:
    """The source recorded by the last complete `convert` of this spec's name, if any."""
    manifest = Manifest.read(workspace.checkpoint_dir(spec))
    source = manifest.outputs.get("source") if manifest is not None else None
    if not isinstance(source, dict) or not isinstance(source.get("checkpoint"), str):
        return None
    return source


def with_converted_source(spec: DeploymentSpec, workspace: Workspace) -> tuple[DeploymentSpec, str | None]:
    """`spec` with model.checkpoint (and model.tokenizer, unless the spec sets one) taken from what
    `convert` recorded, when the spec's own checkpoint directory holds no weights and the recorded
    one does; else `spec` unchanged. The second value is the note to show when it was replaced."""
    own = Path(spec.model.checkpoint)
    if has_weights(own):
        return spec, None
    source = recorded_source(spec, workspace)
    if source is None or not has_weights(source["checkpoint"]):
        return spec, None
    checkpoint = Path(source["checkpoint"])
    update: dict = {"checkpoint": checkpoint}
    tokenizer = source.get("tokenizer")
    if spec.model.tokenizer is None and tokenizer and Path(tokenizer) != checkpoint:
        update["tokenizer"] = Path(tokenizer)
    model = spec.model.model_copy(update=update)
    note = (f"{own} holds no weights; using {checkpoint}, which `toolchain convert` read for "
            f"{workspace.checkpoint_dir(spec)} (recorded in its manifest)")
    return spec.model_copy(update={"model": model}), note
