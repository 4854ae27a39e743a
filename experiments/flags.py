"""Flag syntax shared by every experiment script (docs/cli.md): the parser and the flag types.

* :class:`Parser`: ``argparse`` with one-line usage errors, no prefix abbreviations, ``--debug``
  and the field ↔ flag map of the flags generated from configuration dataclasses
  (:mod:`experiments.config_flags`).
* Flag types that check before any compute and name the problem: :func:`integer`,
  :func:`real`, :func:`choice_list`, :func:`number_list`, :func:`existing_path`, the seeds
  syntax (:func:`parse_seeds`, ``--seeds N|A,B,C|A-B``) and MNIST digit pairs (:data:`pairs`).
  Numbers are ASCII only: Python's ``int`` and ``float`` also read other scripts' digits
  (``int("١") == 1``), which a flag must not accept silently.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from experiments.errors import UsageError


class Parser(argparse.ArgumentParser):
    """``argparse`` with one-line usage errors (raised as :class:`UsageError`, never printed
    with the usage block), no prefix abbreviations (``--seed`` must not silently mean
    ``--seeds``), a ``--debug`` flag, and the field ↔ flag map of the generated flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.config_fields: dict[str, str] = {}   # dataclass field → flag, for generated flags
        self.zero_is_none: set[str] = set()
        self.add_argument("--debug", action="store_true", help="on error, print the full traceback")

    def error(self, message):
        # "argument --seeds: ..." → "--seeds: ..."; argparse already names the flag.
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        # a library message that already starts with the flag ("--pairs '3-3': ...") names it once
        raise UsageError(re.sub(r"^(--[\w-]+): \1:? ?", r"\1: ", message))

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        self._reject_space_separated_lists(argv)
        return super().parse_args(argv, namespace)

    def _reject_space_separated_lists(self, argv):
        """``--seeds 0 1 2`` (the old syntax of one script) would parse as ``--seeds 0`` and an
        error about ``0``; say what is wrong instead.  No script takes positional arguments."""
        i = 0
        while i < len(argv):
            tok = argv[i]
            if tok == "--":
                return
            action = self._option_string_actions.get(tok)
            if action is None or action.nargs == 0 or "=" in tok:
                i += 1
                continue
            j = i + 2
            extra = []
            while j < len(argv) and (not argv[j].startswith("-") or re.fullmatch(r"-\d[\d.e+-]*", argv[j])):
                extra.append(argv[j])
                j += 1
            if extra and i + 1 < len(argv):
                raise UsageError(f"takes one value, got {' '.join([argv[i + 1], *extra])!r}; lists are "
                                 f"comma-separated: {tok} {','.join([argv[i + 1], *extra])}", tok)
            i = j

    def flag_for(self, name: str | None) -> str | None:
        """The flag that sets ``name`` (a config field or an ``args`` attribute), or None."""
        if not name:
            return None
        if name in self.config_fields:
            return self.config_fields[name]
        flag = "--" + name.replace("_", "-")
        return flag if flag in self._option_string_actions else None

    def name_flags(self, message: str) -> str:
        """Spell the snake_case names of flags in a library message as the flags (``n_train`` →
        ``--n-train``), so the user reads what to change.  Names without an underscore are left
        alone: words like ``epochs`` or ``seeds`` are also prose."""
        def sub(m):
            flag = self.flag_for(m.group(0))
            return flag if flag else m.group(0)
        return re.sub(r"(?<![\w-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w-])", sub, message)


def _type(name: str, convert):
    """An argparse ``type`` whose ``ValueError`` message becomes the flag's error message."""
    def parse(text):
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = name
    return parse


def ascii_int(text, what: str = "an integer") -> int:
    """``int(text)`` for ASCII digits only (``int`` alone also reads ``"١"`` as 1)."""
    t = str(text).strip()
    if not t.isascii():
        raise ValueError(f"must be {what} written with ASCII digits 0-9, got {text!r}")
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"must be {what}, got {text!r}") from None


def _float(text) -> float:
    t = str(text).strip()
    if not t.isascii():
        raise ValueError(f"must be a number written with ASCII digits 0-9, got {text!r}")
    try:
        x = float(t)
    except ValueError:
        raise ValueError(f"must be a number, got {text!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"must be finite, got {text!r}")
    return x


def integer(lo: int | None = None, hi: int | None = None):
    """Flag type: an integer in ``[lo, hi]``.  Give every count a ``hi``: a typo such as
    ``--probe-steps 1000000000`` must fail at once, not allocate and run for days."""
    def convert(text):
        n = ascii_int(text)
        if lo is not None and n < lo:
            raise ValueError(f"must be ≥ {lo}, got {n}")
        if hi is not None and n > hi:
            raise ValueError(f"must be ≤ {hi}, got {n}")
        return n
    return _type("integer", convert)


def real(lo: float | None = None, *, above: bool = False, hi: float | None = None, below: bool = False):
    """Flag type: a finite float ≥ ``lo`` (> ``lo`` when ``above``), ≤ ``hi`` (< when ``below``)."""
    def convert(text):
        x = _float(text)
        if lo is not None and (x <= lo if above else x < lo):
            raise ValueError(f"must be {'>' if above else '≥'} {lo:g}, got {text}")
        if hi is not None and (x >= hi if below else x > hi):
            raise ValueError(f"must be {'<' if below else '≤'} {hi:g}, got {text}")
        return x
    return _type("real", convert)


SEEDS_SYNTAX = "a count N (seeds 0..N-1), a list A,B,C or a range A-B"
MAX_SEEDS = 100_000  # a typo such as --seeds 10000000 must fail at once, not allocate and run


def parse_seeds(text: str) -> list[int]:
    """``"5"`` → [0..4]; ``"0,3,7"`` → [0, 3, 7]; ``"2-4"`` → [2, 3, 4].  Never empty, no
    negative seed (a ``numpy`` seed is ≥ 0), no repeated seed (it would double-count a run)."""
    t = str(text).strip()
    syntax = f"give {SEEDS_SYNTAX}, got {text!r}"
    if not t.isascii():
        raise ValueError(f"seeds are written with ASCII digits 0-9; {syntax}")
    try:
        if "," in t:
            items = [s.strip() for s in t.split(",")]
            if any(not s for s in items):
                raise ValueError(f"empty item in the list; {syntax}")
            seeds = [int(s) for s in items]
        elif "-" in t[1:]:
            a, b = (int(s) for s in t.split("-", 1))
            if b < a:
                raise ValueError(f"empty range {t} (its end {b} is below its start {a}); {syntax}")
            if b - a + 1 > MAX_SEEDS:
                raise ValueError(f"{b - a + 1} seeds, more than {MAX_SEEDS}")
            seeds = list(range(a, b + 1))
        else:
            n = int(t)
            if n < 1:
                raise ValueError(f"a count must be ≥ 1, got {n}; {syntax}")
            if n > MAX_SEEDS:
                raise ValueError(f"{n} seeds, more than {MAX_SEEDS}")
            seeds = list(range(n))
    except ValueError as exc:
        if "invalid literal" in str(exc):
            raise ValueError(syntax) from None
        raise
    bad = [s for s in seeds if s < 0]
    if bad:
        raise ValueError(f"seeds must be ≥ 0, got {bad[0]}")
    dup = sorted({s for s in seeds if seeds.count(s) > 1})
    if dup:
        raise ValueError(f"seed {dup[0]} is repeated")
    return seeds


seeds = _type("seeds", parse_seeds)


def add_seeds(parser: argparse.ArgumentParser, default: str | None, what: str = "seeds", dest: str = "seeds",
              default_help: str | None = None) -> None:
    """The one ``--seeds`` flag of every script (``args.<dest>`` is the list).  ``default=None``
    leaves ``args.<dest>`` None when the flag is not given, for a default that depends on other
    flags (describe it in ``default_help``)."""
    parser.add_argument("--seeds", dest=dest, type=seeds, default=default, metavar="N|A,B,C|A-B",
                        help=f"{what}: {SEEDS_SYNTAX}; default {default_help or default}")


def _pairs(text):
    from pycore.data.mnist import parse_pairs  # noqa: PLC0415 -- NumPy only, but not needed by every script

    return parse_pairs(text)


pairs = _type("pairs", _pairs)  # MNIST ordered digit pairs: all | P-H,P-H,…


def choice_list(choices, what: str = "value"):
    """Flag type: a comma list of distinct items from ``choices`` (at least one)."""
    choices = tuple(choices)

    def convert(text):
        items = [s.strip() for s in str(text).split(",")]
        if not any(items):
            raise ValueError(f"empty list; choose from {','.join(choices)}")
        if any(not s for s in items):
            raise ValueError(f"empty item in {text!r}")
        bad = [s for s in items if s not in choices]
        if bad:
            raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {','.join(choices)}")
        dup = sorted({s for s in items if items.count(s) > 1})
        if dup:
            raise ValueError(f"{what} {dup[0]!r} is repeated")
        return items
    return _type("choice_list", convert)


def number_list(lo=None, hi=None, *, open_interval: bool = False):
    """Flag type: a comma list of distinct finite numbers in ``[lo, hi]`` (open when asked)."""
    item = real(lo, above=open_interval, hi=hi, below=open_interval)

    def convert(text):
        items = [s.strip() for s in str(text).split(",")]
        if any(not s for s in items):
            raise ValueError(f"empty item in {text!r}")
        try:
            values = [item(s) for s in items]
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        if len(set(values)) != len(values):
            raise ValueError(f"repeated value in {text!r}")
        return values
    return _type("number_list", convert)


def existing_path(kind: str = "file"):
    """Flag type: a path that exists (a ``file`` or a ``folder``), checked before any compute."""
    def convert(text):
        p = Path(text).expanduser()
        if not p.exists():
            raise ValueError(f"no such {kind}: {text}")
        if kind == "file" and not p.is_file():
            raise ValueError(f"not a file: {text}")
        if kind == "folder" and not p.is_dir():
            raise ValueError(f"not a folder: {text}")
        return p
    return _type("existing_path", convert)
