"""The ``ckpt`` command line. Each area registers its commands from ``ckpt/commands/``.

Errors of this project print as one clear line (exit 2 for bad input, 1 otherwise); only
unexpected exceptions show a traceback. A refused argument (``BadArgument``, see ``ckpt.args``,
and typer's usage errors: an unknown option, a missing argument) is also recorded in the
catalog's audit as a rejection, as a malformed event is.
"""

from __future__ import annotations

import importlib
import pkgutil
import signal
import sys

import typer
from rich.console import Console
from rich.markup import escape

import ckpt.commands
from core.errors import BadArgument, BadInput, CkptError, ConfigError

# click's own help formatter (rich_markup_mode=None), not typer's rich panels: it reflows each
# paragraph to the terminal and breaks lines between words, where the panels at 80 columns cut
# a long option or variable name short with an ellipsis and keep a docstring's line breaks
app = typer.Typer(name="ckpt", help="Keep training checkpoints safe across storage tiers.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  rich_markup_mode=None)
err = Console(stderr=True)


def _register_commands() -> None:
    for mod in sorted(pkgutil.iter_modules(ckpt.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"ckpt.commands.{mod.name}")
        register = getattr(module, "register", None)
        if register:
            register(app)


_register_commands()


def main() -> None:
    _interruptible()
    try:
        code = app(standalone_mode=False)  # typer's usage errors come here, to be recorded too
    except typer.Abort:
        err.print("Aborted!")
        sys.exit(1)
    except typer.TyperException as exc:  # typer's own: a usage error (exit 2), or help on no command
        if exc.exit_code == 2 and type(exc).__name__ != "NoArgsIsHelpError":  # a usage error
            ctx = getattr(exc, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            err.print(f"[red]error:[/red] {escape(exc.format_message())}{escape(hint)}", soft_wrap=True)
            _record(exc)
        elif hasattr(exc, "show"):
            exc.show()
        else:
            err.print(escape(exc.format_message()))
        sys.exit(exc.exit_code)
    except BadArgument as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        _record(exc)
        sys.exit(2)
    except (BadInput, ConfigError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)
    except CkptError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)  # ``typer.Exit``'s code; a command returns None


def _interruptible() -> None:
    """SIGINT (Ctrl-C) stops a command even when it was started with SIGINT ignored, as a
    non-interactive shell starts a background job (``nohup ckpt up &``, a cron or Slurm script):
    ``ckpt up`` stops its agents with SIGINT, as a user stops ``ckpt up``, and a process that
    ignored it held its shutdown until the SIGTERM after it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _record(exc: BadArgument | typer.TyperException) -> None:
    """Audit the refused command line (``cli:<its arguments>``); a catalog that cannot take the
    record costs the record (a note on stderr), never the error the user is shown."""
    from core.settings import load_settings  # deferred: start-up — pydantic-settings
    from tasks.register import reject_event  # deferred: start-up — SQLAlchemy, Prefect

    try:
        what = " ".join(sys.argv[1:]).encode("unicode_escape").decode()[:300]  # one line, every character seen
        reject_event(load_settings(), what, exc, actor="cli", source="cli")
    except CkptError as failure:
        err.print(f"note: the rejection was not recorded: {escape(str(failure))}", soft_wrap=True)


if __name__ == "__main__":
    main()
