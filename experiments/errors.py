"""Error policy of the command lines (docs/cli.md): exit codes, one line on stderr, signals.

* Exit codes: 0 success, 1 data or runtime error, 2 usage error (a flag value that cannot
  work), 130 Ctrl-C, 143 SIGTERM.
* One line on stderr, ``SCRIPT: error: --flag: what is wrong``; a traceback only with
  ``--debug``.  A library error whose ``.parameter`` names a setting (``ParameterError``,
  ``DivergenceError``) is reported with the flag that sets it (:meth:`Parser.flag_for
  <experiments.flags.Parser.flag_for>`), also when it was raised in a worker process: the
  library's exceptions pickle with their attributes (:class:`pycore.validation.PicklableError`).
* Warnings (``pycore.validation.OutlierWarning`` and the rest) are one line too:
  ``SCRIPT: warning: ...``.
* SIGTERM (what ``timeout`` and job schedulers send) is handled exactly like Ctrl-C.
"""
from __future__ import annotations

import signal
import sys
import traceback
import warnings

from pycore.validation import ParameterError, PicklableError

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


class UsageError(PicklableError, Exception):
    """A flag value that cannot work (exit 2).  ``flag`` is the flag as typed (``"--seeds"``)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag

    def __str__(self):
        msg = super().__str__()
        return f"{self.flag}: {msg}" if self.flag else msg


class RunError(Exception):
    """A run that finished but must not count as a success (exit 1), e.g. a method that failed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout`` and job schedulers send), handled exactly like Ctrl-C."""


def describe(exc: BaseException, parser=None) -> str:
    """One line for an exception: a flag named where the exception names a parameter.

    ``parser`` is an :class:`experiments.flags.Parser` (for ``flag_for`` / ``name_flags``) or None."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if parser is not None:
        msg = parser.name_flags(msg)
    parameter = getattr(exc, "parameter", None)
    if parameter:
        flag = parser.flag_for(parameter) if parser is not None else None
        if flag and not msg.startswith(flag):
            msg = f"{flag}: {msg}"
        elif not flag:
            msg = f"{msg} (setting {parameter!r})"
    if not _expected(exc):
        msg = f"{type(exc).__name__}: {msg} (rerun with --debug for the traceback)"
    return msg


def _expected(exc: BaseException) -> bool:
    """Errors a user or their data can cause; anything else is reported as an internal error."""
    if isinstance(exc, (ValueError, OSError, FloatingPointError, UsageError, RunError)):
        return True
    return type(exc).__module__.split(".")[0] == "pycore"


def run_main(parser, body, argv=None) -> int:
    """Parse ``argv`` with ``parser`` and call ``body(args)`` under the error policy of this
    module; returns the exit code (``body`` returns None or an int)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = parser.prog
    debug = "--debug" in argv
    previous = _install_handlers()
    show = warnings.showwarning
    warnings.showwarning = _one_line_warning(prog)
    try:
        args = parser.parse_args(argv)
        return int(body(args) or 0)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt as exc:
        sig = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        if debug:
            traceback.print_exc()
        print(f"{prog}: interrupted ({sig}); outputs of earlier runs left as they were", file=sys.stderr)
        return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT
    except UsageError as exc:
        _report(prog, str(exc), exc, debug)
        return EXIT_USAGE
    except ParameterError as exc:
        _report(prog, describe(exc, parser), exc, debug)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 -- the policy: one line, traceback only with --debug
        _report(prog, describe(exc, parser), exc, debug)
        return EXIT_RUNTIME
    finally:
        warnings.showwarning = show
        _restore_handlers(previous)


def _report(prog, line, exc, debug):
    if debug:
        # A worker's exception carries the worker's traceback as its __cause__ (concurrent.futures).
        traceback.print_exception(exc)
    print(f"{prog}: error: {line}", file=sys.stderr)


def _one_line_warning(prog):
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)
    return show


def _raise_terminated(signum, frame):
    # Once: a second SIGTERM during the clean-up must not interrupt the clean-up itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _install_handlers():
    """SIGTERM raises :class:`Terminated`; the start-up SIGINT handler of
    :mod:`experiments._startup` (it only covers the imports) gives way to Python's own, which
    raises KeyboardInterrupt.  Returns the previous handlers, or None outside the main thread
    (signals are then left alone)."""
    try:
        term = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread
        return None
    sigint = signal.getsignal(signal.SIGINT)
    if getattr(sigint, "startup_handler", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    else:
        sigint = None
    return term, sigint


def _restore_handlers(previous):
    if previous is not None:
        signal.signal(signal.SIGTERM, previous[0])
        if previous[1] is not None:
            signal.signal(signal.SIGINT, previous[1])
