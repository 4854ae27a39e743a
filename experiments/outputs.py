"""Atomic output sets (docs/cli.md): the files of one run, staged and swapped into ``--out``.

* Checked BEFORE any compute (:class:`OutputSet`): ``--out`` is absent or a real folder (not a
  symbolic link: dangling, looping or not), every entry in it is a regular file this experiment
  writes (an earlier run's output; a folder or a link named ``results.json`` is a user's, never
  touched), and the folder that will receive the staging folder is writable (a real ``mkdir``).
* :meth:`OutputSet.commit` swaps the staging folder with ``--out`` in one
  ``renameat2(RENAME_EXCHANGE)`` (two renames where the kernel or filesystem lacks it).  Where a
  swap is impossible (``--out`` is a mount point, as in ``docker -v host:/out``: EBUSY; another
  filesystem: EXDEV) the files are replaced in place, one atomic rename each, staged inside
  ``--out`` itself so that they are on its filesystem.
* Nothing of this module deletes a file it did not write: an earlier set is removed file by file
  (only regular files with this experiment's output names), and a finished set that could not be
  moved into place is kept: renamed to a visible ``NAME.rescued-…`` folder with a ``.rescued``
  note, which no later run deletes, and named in the error.
* Leaving the ``with`` block without :meth:`commit` (a failed or interrupted run) deletes the
  staging folder and touches nothing else; the staging folder of a run that was killed outright
  (SIGKILL, power loss) is deleted by the next run into the same ``--out``.
"""
from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import re
import shutil
import stat
import sys
import time
import warnings
from pathlib import Path

from experiments.errors import RunError, UsageError
from pycore.report import write_json

RESCUED_NOTE = ".rescued"   # inside a kept staging folder: never deleted by a later run


class OutputSet:
    """The files of one run, staged in a hidden folder and moved into ``final`` together.

    Created BEFORE any compute (see the module docstring for the checks, which name ``flag``).
    ``owned``: the names (glob patterns) this experiment writes.  ``path`` is the staging
    folder to write into (None with ``create=False``: a check only).
    """

    def __init__(self, final, owned, *, flag: str = "--out", create: bool = True):
        self.final = Path(os.path.abspath(Path(final).expanduser()))
        self.owned = tuple(owned)
        self.flag = flag
        self.path: Path | None = None
        self.in_place = False   # --out is a mount point: stage inside it, replace file by file
        self._check()
        if create:
            self._stage()

    # --- checks -----------------------------------------------------------------------------

    def _check(self):
        f = self.final
        if os.path.islink(f):
            raise UsageError(_symlink_problem(f), self.flag)
        if f.exists() and not f.is_dir():
            raise UsageError(f"{f} exists and is not a folder", self.flag)
        if f.is_dir():
            self.in_place = _is_mount_point(f)
            problem = self._entries_problem()
            if problem:
                raise UsageError(f"{f} {problem}; pass a new or empty folder", self.flag)
            if not os.access(f, os.W_OK | os.X_OK):
                raise UsageError(f"{f} is not writable", self.flag)
            if self.in_place:
                return  # the staging folder goes inside --out: its parent need not be writable
        parent = f.parent
        ancestor = next((a for a in (parent, *parent.parents) if a.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            raise UsageError(f"{ancestor} is a file, not a folder", self.flag)
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {parent}: {exc.strerror or exc}", self.flag) from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{parent} is not writable", self.flag)

    def _owned(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in self.owned)

    def _entries_problem(self) -> str:
        """What in ``final`` is not an earlier output of this experiment ("" if nothing): a
        name it does not write, or one of its names held by a folder, a link or a device."""
        foreign, wrong_kind = [], []
        for e in sorted(os.listdir(self.final)):
            if self._is_staging(e):
                continue    # in-place staging folder of a live run (or a stale one, deleted later)
            if not self._owned(e):
                foreign.append(e)
            elif not stat.S_ISREG(os.lstat(self.final / e).st_mode):
                wrong_kind.append(e)
        if wrong_kind:
            e = wrong_kind[0]
            return (f"holds {e!r}, which is {_kind(self.final / e)}, not an output file of this experiment "
                    "(never replaced)")
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            return f"holds files this experiment does not write ({shown})"
        return ""

    def _is_staging(self, entry: str) -> bool:
        return self.in_place and re.fullmatch(rf"\.{re.escape(self.final.name)}\.partial-\d+-\d+", entry) \
            is not None and (self.final / entry).is_dir() and not (self.final / entry).is_symlink()

    # --- staging ----------------------------------------------------------------------------

    @property
    def _stage_dir(self) -> Path:
        return self.final if self.in_place else self.final.parent

    def _stage(self):
        where, name = self._stage_dir, self.final.name
        _remove_stale_staging(where, name)
        staging = where / f".{name}.partial-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        try:
            staging.mkdir(mode=0o777)  # the umask applies, like a folder the user made
        except OSError as exc:
            raise UsageError(f"cannot write in {where}: {exc.strerror or exc}", self.flag) from None
        self.path = staging

    def relocate(self, obj):
        """``obj`` with every string path inside the staging folder rewritten to ``final``."""
        if isinstance(obj, dict):
            return {k: self.relocate(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.relocate(v) for v in obj]
        if isinstance(obj, str) and self.path is not None and obj.startswith(str(self.path)):
            return str(self.final) + obj[len(str(self.path)):]
        return obj

    # --- commit -----------------------------------------------------------------------------

    def commit(self) -> Path:
        """Move the staged set into ``final``; a RunError naming the kept folder if impossible."""
        staging, final = self.path, self.final
        # Checked again: the folder may have changed during a long run.
        if os.path.islink(final) or (final.exists() and not final.is_dir()):
            self._rescue(f"{final} is no longer a folder")
        if final.is_dir():
            problem = self._entries_problem()
            if problem:
                self._rescue(f"{final} {problem.replace('holds', 'gained', 1)}")
        if self.in_place:
            self._replace_in_place()
        elif not final.exists():
            try:
                os.rename(staging, final)
            except OSError as exc:
                self._rescue(f"cannot move the outputs into {final} ({_why(exc)})")
        else:
            try:
                old = self._swap()
            except OSError as exc:
                warnings.warn(f"{self.flag} {final}: cannot be swapped as a whole ({_why(exc)}; a mount "
                              "point?); replacing its files one by one instead", stacklevel=2)
                self._replace_in_place()
            else:
                self._remove_earlier_outputs(old, keep=())
                _rmdir_if_empty(old)
        self.path = None
        return final

    def _swap(self) -> Path:
        """Exchange the staging folder and ``final``; returns where the previous set now is.
        An OSError means nothing changed."""
        staging, final = self.path, self.final
        if _exchange(staging, final):
            return staging
        old = staging.with_name(staging.name + ".old")
        os.rename(final, old)
        try:
            os.rename(staging, final)
        except OSError:
            os.rename(old, final)
            raise
        return old

    def _replace_in_place(self):
        """Move each staged file into ``final`` (one atomic rename each, or copy + rename across
        filesystems), then remove the earlier outputs the new set does not have."""
        staging, final = self.path, self.final
        names = sorted(os.listdir(staging))
        try:
            for n in names:
                _move_file(staging / n, final / n)
        except OSError as exc:
            done = [n for n in names if not (staging / n).exists()]
            self._rescue(f"cannot write into {final} ({_why(exc)})"
                         + (f"; {', '.join(done)} already replaced there" if done else ""))
        self._remove_earlier_outputs(final, keep=names)
        try:
            shutil.rmtree(staging) if staging.exists() else None   # only copies of what was moved
        except OSError:
            pass

    def _remove_earlier_outputs(self, folder: Path, keep) -> None:
        """Delete the regular files of ``folder`` that carry this experiment's output names and
        are not in ``keep``: an earlier run's outputs, never anything else."""
        for e in os.listdir(folder):
            p = folder / e
            if e not in keep and self._owned(e) and stat.S_ISREG(os.lstat(p).st_mode):
                p.unlink()

    def _rescue(self, reason: str):
        """Keep the finished set where no later run deletes it, and raise RunError naming it."""
        staging = self.path
        self.path = None    # whatever happens next, discard() must not delete it
        try:
            (staging / RESCUED_NOTE).write_text(
                f"A complete output set that could not be moved into {self.final}: {reason}.\n"
                "Kept here; no later run deletes this folder.\n")
        except OSError:
            pass
        kept = staging.with_name(f"{self.final.name}.rescued-{staging.name.split('.partial-')[1]}")
        try:
            os.rename(staging, kept)
        except OSError:
            kept = staging
        raise RunError(f"{self.flag}: {reason}; this run's outputs are in {kept}")

    def discard(self):
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.discard()
        return False


def _why(exc: OSError) -> str:
    return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}" if exc.errno else str(exc)


def _kind(p: Path) -> str:
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    return "not a regular file"


def _symlink_problem(f: Path) -> str:
    target = os.readlink(f)
    try:
        os.stat(f)
    except FileNotFoundError:
        return f"{f} is a dangling symbolic link (to {target}, which does not exist); pass a folder"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{f} is a symbolic link loop (to {target}); pass a folder"
        return f"{f} is a symbolic link to {target} that cannot be followed ({_why(exc)})"
    return f"{f} is a symbolic link (to {target}); pass the folder itself"


def _mount_points() -> set[str]:
    """Mount points of this process's mount namespace (Linux /proc/self/mountinfo, field 5)."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return set()
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
    return {unescape(line.split()[4]) for line in text.splitlines() if len(line.split()) > 4}


def _is_mount_point(p: Path) -> bool:
    """A folder that cannot be renamed: a mount point (``ismount`` misses a bind mount of the
    same filesystem, /proc/self/mountinfo does not)."""
    return os.path.ismount(p) or os.path.realpath(p) in _mount_points()


def _move_file(src: Path, dst: Path) -> None:
    """``src`` over ``dst`` atomically: a rename, or across filesystems a copy to a temporary
    name beside ``dst`` and a rename."""
    try:
        os.replace(src, dst)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    src.unlink()


def _rmdir_if_empty(p: Path) -> None:
    try:
        p.rmdir()
    except OSError:
        pass   # something that is not an earlier output: left where it is


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_stale_staging(where: Path, name: str) -> None:
    """Delete staging folders of runs that were killed outright (SIGKILL, power loss): a dead
    process's, never one holding the :data:`RESCUED_NOTE` of a set reported to the user."""
    for d in where.glob(f".{glob_escape(name)}.partial-*"):
        m = re.fullmatch(rf"\.{re.escape(name)}\.partial-(\d+)-\d+(\.old)?", d.name)
        if (m and not _alive(int(m.group(1))) and d.is_dir() and not d.is_symlink()
                and not (d / RESCUED_NOTE).exists()):
            shutil.rmtree(d, ignore_errors=True)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_set(outs: OutputSet, result: dict, table: str, plot=None,
              plot_name: str | None = None) -> list[Path]:
    """``results.json``, ``table.md`` and the figure into the staging folder of ``outs``;
    ``result`` gets ``wall_seconds_with_plot`` (the run plus table and figure)."""
    t0 = time.perf_counter()
    names = ["results.json", "table.md"]
    if plot is not None:
        plot(result, outs.path / plot_name)
        names.append(plot_name)
    if "wall_seconds" in result:
        result["wall_seconds_with_plot"] = result["wall_seconds"] + (time.perf_counter() - t0)
    write_json(outs.path / "results.json", outs.relocate(result))
    (outs.path / "table.md").write_text(table)
    return [outs.final / n for n in names]
