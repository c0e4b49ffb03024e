"""The `toolchain` command: a thin Click group over the library stages.

Each noun lives in its own module and registers one command here. Errors a
user can fix are printed as one line (exit 2); `--debug` shows tracebacks.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from toolchain import __version__
from toolchain.cli._common import Context
from toolchain.errors import ToolchainError
from toolchain.stopsignals import Stopped

# command name -> module under toolchain.cli holding a Click command `command`
COMMANDS = {
    "init": "init",
    "import": "import_",
    "schema": "schema",
    "archs": "archs",
    "plan": "plan",
    "probe-host": "probe_host",
    "calibrate": "calibrate",
    "tune": "tune",
    "tiny-model": "tiny_model",
    "medusa-heads": "medusa_heads",
    "smollm2": "smollm2",
    "tiny-mixtral": "tiny_mixtral",
    "tiny-lora": "tiny_lora",
    "convert": "convert",
    "build-engine": "build_engine",
    "model-repo": "model_repo",
    "serve": "serve",
    "bench": "bench",
    "deploy": "deploy",
    "eval": "eval",
    "dynamo": "dynamo",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="toolchain")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Directory holding engines/, model_repo/ and reports/.")
@click.pass_context
def cli(click_ctx: click.Context, debug: bool, root: Path) -> None:
    """HF checkpoint -> TensorRT-LLM checkpoint -> engine -> Triton repository -> server -> latency report."""
    click_ctx.obj = Context(debug=debug, root=root)


for _name, _module in COMMANDS.items():
    try:
        cli.add_command(importlib.import_module(f"toolchain.cli.{_module}").command, _name)
    except ModuleNotFoundError as exc:  # a stage not built yet must not break the others
        if exc.name != f"toolchain.cli.{_module}":
            raise


def main(argv: list[str] | None = None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        rc = cli.main(args=argv, prog_name="toolchain", standalone_mode=False)
    except ToolchainError as err:
        if debug:
            raise
        click.echo(f"error: {err}", err=True)
        return err.exit_code
    except click.exceptions.Abort as err:
        if isinstance(err.__cause__, Stopped):  # click turns a KeyboardInterrupt into Abort
            click.echo(f"{err.__cause__}: everything it started is stopped", err=True)
            return err.__cause__.exit_code
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as err:
        err.show()
        return 2
    except Stopped as err:
        click.echo(f"{err}: everything it started is stopped", err=True)
        return err.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    except Exception as err:  # last resort: still one line unless --debug
        if debug:
            raise
        click.echo(f"error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", err=True)
        return 1
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
