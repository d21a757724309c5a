"""The `specconv` command-line entry point.

Sub-commands live in `specconv/commands/<name>.py`, each exposing a click command named
`command`. They are imported lazily so that `specconv --help` stays fast and a command's heavy
imports (torch, transformers) are paid only when it runs.
"""

from __future__ import annotations

import importlib
import sys

import click

from specconv.errors import SpecconvError

# command name -> module under specconv.commands (each defines `command`)
COMMANDS: dict[str, str] = {
    "convert": "convert",
    "demo": "demo",
    "generate": "generate",
    "inspect": "inspect",
    "mtp": "mtp",
    "quantize": "quantize",
    "upload": "upload",
    "verify": "verify",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        module = COMMANDS.get(name)
        if module is None:
            return None
        return importlib.import_module(f"specconv.commands.{module}").command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="specconv")
@click.pass_context
def cli(ctx, debug):
    """Convert MTP / draft heads to GGUF, run them, and verify speculative decoding."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv=None):
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SpecconvError as exc:
        if debug:
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except SystemExit:
        raise
    except Exception as exc:  # unexpected: still one line unless --debug
        if debug:
            raise
        click.echo(f"error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
