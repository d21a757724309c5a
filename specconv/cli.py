"""The `specconv` process entry point: runs the click group (specconv/commands/app.py) and turns every
way a run can end into one line and an exit status: a SpecconvError -> `error: ...`, exit 2; a usage
error -> click's message, exit 2; Ctrl-C (SIGINT) at any time, start-up included -> `Aborted.`, exit
130; anything else -> `error: Type: ...`, exit 1 (`--debug` shows the traceback).

Ctrl-C before the commands run (importing click, the command's module, torch) ends the process at
once: nothing is open yet. While a command runs, SIGINT raises KeyboardInterrupt as usual, so writers
unwind and remove their temporary files; the message is printed after that.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ABORTED = "Aborted."
ABORT_STATUS = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C


def _abort_now(signum, frame):
    """SIGINT where nothing needs unwinding (start-up, the exit path): the message and the status, at once."""
    os.write(2, f"{ABORTED}\n".encode())
    os._exit(ABORT_STATUS)


def __getattr__(name):  # `specconv.cli.cli` (the click group) for tests and callers that invoke it
    if name in ("cli", "COMMANDS"):
        from specconv.commands import app

        return getattr(app, name)
    raise AttributeError(name)


def main(argv=None):
    """Run `specconv ARGS` (argv None: the process's own arguments; a list: in-process, e.g. tests, whose
    SIGINT handler is given back afterwards)."""
    handle_sigint = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if handle_sigint else None
    if handle_sigint:
        signal.signal(signal.SIGINT, _abort_now)
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        from specconv.commands.app import cli

        if handle_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, Ctrl-C unwinds
        cli.main(args=argv, standalone_mode=False)
    except BaseException as exc:  # noqa: BLE001 - every ending becomes one line and a status
        if handle_sigint:
            signal.signal(signal.SIGINT, _abort_now)  # a second Ctrl-C while exiting: no traceback
        _exit_for(exc, debug)
    finally:
        if handle_sigint and argv is not None:
            signal.signal(signal.SIGINT, previous)
    if handle_sigint and argv is None:
        signal.signal(signal.SIGINT, _abort_now)  # the interpreter's shutdown


def _exit_for(exc: BaseException, debug: bool):
    import click

    from specconv.errors import SpecconvError

    if isinstance(exc, (KeyboardInterrupt, click.exceptions.Abort)):
        click.echo(ABORTED, err=True)
        sys.exit(ABORT_STATUS)
    if isinstance(exc, SystemExit):
        raise exc
    if isinstance(exc, click.ClickException):
        exc.show()
        sys.exit(exc.exit_code)
    if isinstance(exc, SpecconvError):
        if debug:
            raise exc
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if debug or not isinstance(exc, Exception):
        raise exc
    click.echo(f"error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
