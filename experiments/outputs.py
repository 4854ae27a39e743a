"""What a command leaves behind and how it ends (docs/cli.md "Errors, exit codes, signals" and
"Outputs"): output files written whole or not at all (:func:`write_outputs`, checked before any
compute by :func:`check_out`), and :func:`main`, the exit-code policy: one line per error, 2 for a
usage error (:class:`UsageError`), 1 for a failed run (:class:`RunError`), 130/143 after SIGINT or
SIGTERM (:class:`Terminated`).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path

from pycore import ParameterError

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A flag value that cannot work (exit 2); ``flag`` is the flag as typed (``"--seeds"``)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag


class RunError(Exception):
    """A run that finished but must not count as a success (exit 1), e.g. a method that failed."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread while :func:`main` runs."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (figures go to files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_out(out, names=()) -> Path:
    """Before any compute: ``out`` is (or can be made) a writable folder with no folder and no
    symbolic link (dangling or not) in ``names``."""
    out = Path(out).expanduser()
    # out, or where it will be made
    first = next(p for p in (out, *out.parents) if os.path.lexists(p))
    if not first.is_dir() or not os.access(first, os.W_OK | os.X_OK):
        raise UsageError(
            f"{first} is {'not a folder' if not first.is_dir() else 'not writable'}", "--out"
        )
    blocked = _blocked(out, names)
    if blocked:
        raise UsageError(blocked, "--out")
    return out


def _blocked(out: Path, names) -> str | None:
    """Why an output name cannot be replaced, or None: a folder, or a symbolic link (replacing
    it would drop the link the user made; following it would write over its target)."""
    for n in names:
        p = out / n
        if p.is_symlink():
            return f"{p} is a symbolic link (to {os.readlink(p)}), where this run writes a file"
        if p.is_dir():
            return f"{p} is a folder, where this run writes a file"
    return None


def write_run(out, table: str, result: dict, files: dict) -> None:
    """``table.md``, ``files`` (a None value: not written) and ``results.json`` (last) into ``out``
    (:func:`write_outputs`); then the table on stdout."""
    from pycore.report import dumps_json

    files = {
        "table.md": table,
        **{k: v for k, v in files.items() if v is not None},
        "results.json": dumps_json(result, indent=2) + "\n",
    }
    print(table + "\nwrote " + ", ".join(map(str, write_outputs(out, files))))


def write_outputs(out, files) -> list[Path]:
    """Write ``files`` (name → str, bytes, or a function writing the file at the path it is given)
    into ``out`` in order, each under a temporary name then ``os.replace``d over ``out/name``: a
    reader never sees half a file, and nothing is deleted but this call's own failed temporary.
    A folder or symbolic link at any name is refused before the first file is written; an error
    names the output, never the temporary file."""
    out = Path(out)
    blocked = _blocked(out, files)
    if blocked:
        raise RunError(f"{blocked}; nothing was written")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        final = out / name
        tmp = final.with_name(f".{final.stem}.{os.getpid()}-{secrets.token_hex(4)}{final.suffix}")
        try:
            with open(tmp, "xb") as fh:  # exclusive: never another run's file
                if not callable(content):
                    fh.write(content.encode() if isinstance(content, str) else content)
            if callable(content):
                content(tmp)
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            _raise_for_output(exc, tmp, final)
            raise
        written.append(final)
    return written


def _raise_for_output(exc: BaseException, tmp: Path, final: Path) -> None:
    """Raise ``exc`` again naming ``final`` where it named the temporary file ``tmp`` (nothing
    when it did not: interrupts and unrelated errors go on as they are)."""
    if (
        isinstance(exc, OSError)
        and exc.filename is not None
        and os.fspath(exc.filename) == str(tmp)
    ):
        raise OSError(exc.errno, exc.strerror, str(final)) from None
    if isinstance(exc, Exception) and str(tmp) in str(exc):
        raise RunError(f"{final}: " + str(exc).replace(str(tmp), str(final))) from None


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def describe(exc: BaseException, parser) -> str:
    """One line for ``exc``, led by the flag that sets its ``.parameter`` where there is one
    (``parser``: the command's :class:`experiments.flags.Parser`, which knows its flags)."""
    # "No space left on device: PATH", not "[Errno 28] ..."
    if isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        msg = " ".join(str(exc).split()) or type(exc).__name__
    parameter = getattr(exc, "parameter", None)
    if parameter:
        flag = parser.flag_for(parameter)
        msg = f"{flag}: {msg}" if flag else f"{msg} (setting {parameter!r})"
    # what a user or their data can cause
    expected = (
        isinstance(exc, (ValueError, OSError, FloatingPointError, RunError))
        or type(exc).__module__.split(".")[0] == "pycore"
    )
    return (
        msg if expected else f"{type(exc).__name__}: {msg} (rerun with --debug for the traceback)"
    )


def main(parser, body, argv=None) -> int:
    """``body(parser.parse_args(argv))`` (None: 0) under the exit-code policy of docs/cli.md
    (``parser``: an :class:`experiments.flags.Parser`). SIGINT is never touched (an inherited
    SIG_IGN stays); SIGTERM raises :class:`Terminated` unless ignored."""
    as_script, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
    term = (
        signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    if term is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    show, prog = warnings.showwarning, parser.prog
    warnings.showwarning = lambda m, *a, **k: print(
        f"{prog}: warning: {' '.join(str(m).split())}", file=sys.stderr, flush=True
    )
    code, line, err = EXIT_OK, None, None
    try:
        code = int(body(parser.parse_args(argv)) or 0)
    except SystemExit as exc:  # --help
        code = exc.code if isinstance(exc.code, int) else 0
    except (KeyboardInterrupt, Terminated) as exc:
        sig = "SIGINT" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"
        code, err = 128 + getattr(signal, sig), exc
        line = f"interrupted ({sig}); earlier outputs left as they were"
    except UsageError as exc:
        code, line, err = EXIT_USAGE, f"error: {' '.join(str(exc).split())}", exc
    except Exception as exc:  # noqa: BLE001 -- the policy: one line, the traceback only with --debug
        code = EXIT_USAGE if isinstance(exc, ParameterError) else EXIT_RUNTIME
        line, err = f"error: {describe(exc, parser)}", exc
    finally:
        warnings.showwarning = show
        if term is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, term)
    if line:
        if "--debug" in argv:
            traceback.print_exception(err)
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
    if as_script and code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        _stop_past_threads(code)
    return code


def _stop_past_threads(code: int) -> None:
    """After a signal, end the process even if a thread is stuck in a system call (an image
    decoder reading from a network file): the interpreter would wait for it at exit, after
    "interrupted" was printed, until SIGKILL.  Nothing is left to clean up: outputs are written
    only at the end and their temporary files were removed as the exception passed."""
    current = threading.current_thread()
    if any(t is not current and not t.daemon and t.is_alive() for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        os._exit(code)
