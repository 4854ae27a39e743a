"""What every experiment script does before its first import (docs/cli.md, "Invocation").

Imported first: by the script itself when it runs as a path (``python experiments/x.py``:
Python puts ``experiments/`` on ``sys.path``, so this sibling module is importable even in a
checkout that was never installed), and by ``experiments/__init__.py`` when it runs as a module
(``python -m experiments.x``).  It imports nothing heavy.

* Ctrl-C while the script is still importing (NumPy, SciPy, pandas, torch: seconds) ends it
  with exit 130 and one line instead of a traceback.  :func:`experiments.errors.run_main` hands
  SIGINT back to Python's own handler once the imports are done.
* A checkout that was never installed (``experiments`` or ``pycore`` cannot be found): one line
  saying how to install or run it, exit 1, instead of a ModuleNotFoundError traceback.
"""
import importlib.util
import os
import signal
import sys
from pathlib import Path


def _prog() -> str:
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] not in ("", "-m", "-c") else "python"


def _interrupted(signum, frame):
    # os._exit, not SystemExit: an import done from C (torch imports NumPy so) swallows exceptions,
    # and nothing has been written yet that would need cleaning up.
    print(f"{_prog()}: interrupted (SIGINT)", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


_interrupted.startup_handler = True   # recognised (and replaced) by experiments.errors.run_main

if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # never over SIG_IGN (nohup, &)
    signal.signal(signal.SIGINT, _interrupted)

for _name in ("experiments", "pycore"):
    if importlib.util.find_spec(_name) is None:
        sys.exit(f"{_prog()}: error: cannot import {_name!r}; install the project (bash scripts/install.sh, "
                 "or pip install --no-build-isolation --no-deps -e .) or run from the repository root "
                 "with PYTHONPATH=.")
