"""The `specconv` click group. Sub-commands live in `specconv/commands/<name>.py`, each exposing a click
command named `command`; they are imported lazily so that `specconv --help` stays fast and a command's
heavy imports (torch, transformers) are paid only when it runs. The process entry point, with its
error and Ctrl-C handling, is specconv/cli.py."""

from __future__ import annotations

import importlib

import click

# command name -> module under specconv.commands (each defines `command`)
COMMANDS: dict[str, str] = {
    "compare": "compare",
    "convert": "convert",
    "demo": "demo",
    "generate": "generate",
    "imatrix": "imatrix",
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
