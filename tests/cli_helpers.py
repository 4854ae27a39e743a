"""What the command-line tests share: one in-process call of a script's ``main`` and the check
that an error is one clear line (docs/cli.md)."""

from __future__ import annotations

# An error line must be none of: a traceback, a raw OS error ("[Errno 16] ..."), or the mark the
# `tripwire` fixture (tests/conftest.py) leaves when the computation started.
NOT_IN_AN_ERROR = ("Traceback", "[Errno", "COMPUTED")


def call(capsys, mod, argv):
    """``(exit code, stderr)`` of ``mod.main(argv)``."""
    rc = mod.main(argv)
    return rc, capsys.readouterr().err


def one_line(err: str, *words) -> str:
    """The error is one line, names every one of ``words`` and is none of ``NOT_IN_AN_ERROR``."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not any(bad in err for bad in NOT_IN_AN_ERROR), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]
