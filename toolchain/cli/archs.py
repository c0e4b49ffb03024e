"""`toolchain archs`: the Hugging Face architectures the converter supports, each with its family and the paths
that serve it."""

from __future__ import annotations

import click
from toolchain.archs import Family, get_family, supported
from toolchain.targets import ENGINE, LLMAPI


class _AnyModel:
    """Stands for "some model of this architecture" when asking a family's llmapi_refusal: it has a name and
    nothing else, so a refusal that reads the model's shape (tp, quantization, a vision tower) cannot answer for
    the family and the path counts as serving it; only a refusal of every model answers."""

    def __init__(self, architecture: str):
        self.architecture = architecture

    def __getattr__(self, name: str):
        raise AttributeError(name)


def paths(architecture: str, family: Family) -> list[str]:
    """The paths that serve the family: the engine path unless its `engine_refusal` says trtllm-build of the pinned
    release cannot build it; the LLM-API path unless its `llmapi_refusal` refuses every model of it (that
    refusal is per model: `toolchain plan` says for one checkpoint, at its tp and quantization)."""
    out = [] if family.engine_refusal else [ENGINE]
    refusal = family.llmapi_refusal
    try:
        refused_always = refusal is not None and refusal(_AnyModel(architecture), 1, False) is not None
    except AttributeError:  # it depends on the model
        refused_always = False
    return out if refused_always else [*out, LLMAPI]


@click.command()
def command() -> None:
    """List supported Hugging Face architectures (config.json `architectures[0]`), each with its family and the
    paths that serve it: engine (targets trtllm and cpu) and llmapi (targets llmapi and llmapi-cpu); llmapi may
    still refuse one model of a family (`toolchain plan` says why)."""

    rows = [(name, get_family(name)) for name in supported()]
    width = max(len(name) for name, _ in rows)
    fam_width = max(len(f.name) for _, f in rows)
    for name, family in rows:
        click.echo(f"{name:<{width}}  {family.name:<{fam_width}}  {' '.join(paths(name, family))}")
