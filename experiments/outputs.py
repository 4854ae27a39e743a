"""What a command leaves behind and how it ends (docs/cli.md "Errors, exit codes, signals" and
"Outputs"): a run's output files written all or none (:func:`write_outputs`, :func:`commit`;
checked before any compute by :func:`check_out`), and :func:`main`, the exit-code policy: one line
per error, 2 for a usage error (:class:`UsageError`), 1 for a failed run (:class:`RunError`),
130/143 after SIGINT or SIGTERM (:class:`Terminated`), the line saying which outputs are new.
"""

from __future__ import annotations

import contextvars
import os
import secrets
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from contextlib import contextmanager
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
    try:  # tried, not asked: root may "access" /proc, where nothing can be made
        os.rmdir(tempfile.mkdtemp(prefix=".out-check-", dir=first))
    except OSError as exc:
        raise UsageError(
            f"nothing can be written in {first} ({exc.strerror or exc})", "--out"
        ) from None
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
    into ``out``, all or none: each in order under a temporary name beside its final one, then
    all moved into place at once (:func:`commit`). A failure or an interrupt before the move
    leaves every earlier output as it was and removes this call's temporaries, nothing else; a
    folder or symbolic link at any name is refused before the first file is written; an error
    names the output, never the temporary file."""
    out = Path(out)
    blocked = _blocked(out, files)
    if blocked:
        raise RunError(f"{blocked}; nothing was written")
    out.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    staged = []
    try:
        for name, content in files.items():
            final = out / name
            tmp = final.with_name(f".{final.stem}.{token}{final.suffix}")
            staged.append((tmp, final))
            try:
                with open(tmp, "xb") as fh:  # exclusive: never another run's file
                    if not callable(content):
                        fh.write(content.encode() if isinstance(content, str) else content)
                if callable(content):
                    content(tmp)
            except BaseException as exc:
                _raise_for_output(exc, tmp, final)
                raise
        commit(staged)
    finally:
        for tmp, _ in staged:  # what was not moved: this call's own temporaries only
            tmp.unlink(missing_ok=True)
    return [final for _, final in staged]


# The outputs a :func:`main` call has moved into place, so that an interrupted run's last line can
# say which files are new (None outside main). A context variable, not an argument:
# the commands write through helpers that main does not see.
_COMMITTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("committed", default=None)


def _file_mode() -> int:
    """The mode a new file gets under this process's umask (``0o666 & ~umask``), read without
    changing the umask where /proc says it."""
    try:
        with open("/proc/self/status") as fh:
            line = next(x for x in fh if x.startswith("Umask:"))
        umask = int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def commit(moves) -> None:
    """Move each staged file ``tmp`` over its ``final`` (``moves``: ``(tmp, final)`` pairs in the
    same folders), all at once: SIGINT and SIGTERM that arrive meanwhile are held until every file
    is in place, then raised, so an interrupted run leaves all its outputs or none. Each file gets
    the umask's mode (safetensors writes 0600). Only a failure of the move itself (or SIGKILL)
    can leave some new and some old: the error names both."""
    moves = [(Path(t), Path(f)) for t, f in moves]
    mode, done = _file_mode(), []
    with _signals_held():
        try:
            for tmp, final in moves:
                os.chmod(tmp, mode)
                os.replace(tmp, final)
                done.append(final)
        except OSError as exc:
            new = ", ".join(str(f) for f in done) or "none"
            old = ", ".join(str(f) for _, f in moves[len(done) :])
            raise RunError(
                f"moving the outputs into place failed at {moves[len(done)][1]} "
                f"({exc.strerror or exc}): new: {new}; left as they were: {old}"
            ) from None
        finally:
            record = _COMMITTED.get()
            if record is not None:
                record += done


@contextmanager
def _signals_held():
    """SIGINT and SIGTERM recorded, not acted on, inside the block, then handled as they would
    have been (a Python handler runs in the main thread between bytecodes: holding them there
    covers a signal delivered to any thread). An ignored or default disposition is left alone,
    and off the main thread nothing can be held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held, seen = {}, []
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            held[sig] = handler
            signal.signal(sig, lambda signum, frame: seen.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        for signum, frame in seen[:1]:  # as the first one would have
            held[signum](signum, frame)


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
    """One line for ``exc``, led by the flag that sets its ``.parameter`` (or gives the data of its
    ``.argument``) where there is one (``parser``: the command's
    :class:`experiments.flags.Parser`, which knows its flags)."""
    # "No space left on device: PATH", not "[Errno 28] ..."
    if isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        msg = " ".join(str(exc).split()) or type(exc).__name__
    parameter = getattr(exc, "parameter", None)
    if parameter:
        flag = parser.flag_for(parameter)
        msg = f"{flag}: {msg}" if flag else f"{msg} (setting {parameter!r})"
    elif parser.flag_for(getattr(exc, "argument", None)):  # data a flag gave (DataError)
        msg = f"{parser.flag_for(exc.argument)}: {msg}"
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
    written = []
    token = _COMMITTED.set(written)
    try:
        code = int(body(parser.parse_args(argv)) or 0)
    except SystemExit as exc:  # --help
        code = exc.code if isinstance(exc.code, int) else 0
    except (KeyboardInterrupt, Terminated) as exc:
        sig = "SIGINT" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"
        code, err = 128 + getattr(signal, sig), exc
        line = f"interrupted ({sig}); {_what_was_written(written)}"
    except UsageError as exc:
        code, line, err = EXIT_USAGE, f"error: {' '.join(str(exc).split())}", exc
    except Exception as exc:  # noqa: BLE001 -- the policy: one line, the traceback only with --debug
        code = EXIT_USAGE if isinstance(exc, ParameterError) else EXIT_RUNTIME
        line, err = f"error: {describe(exc, parser)}", exc
    finally:
        _COMMITTED.reset(token)
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


def _what_was_written(written: list) -> str:
    """What an interrupted run left on disk, in words: its outputs, each whole (they are moved
    into place together, after the computation), or none."""
    if not written:
        return "no output was written: earlier outputs left as they were"
    folders = sorted({str(p.parent) for p in written})
    return (
        f"its outputs were all written first ({', '.join(p.name for p in written)} in "
        f"{', '.join(folders)})"
    )


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
