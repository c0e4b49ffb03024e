"""Python-backend model files, copied verbatim into `<model>/1/model.py`.

They run inside Triton's Python stub, not as part of this package: each
imports `triton_python_backend_utils`, which only exists there, so nothing
here imports them.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def source(model_name: str) -> Path:
    """The model.py source for a repository model name."""
    path = HERE / f"{model_name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no Python-backend source for model '{model_name}'")
    return path
