"""The command lines' flags (experiments/flags.py; docs/cli.md): a usage error is exit 2 and one
stderr line naming the flag, before any compute; every linear option has its flag, checked by the
library; every count is bounded.

Each case checks the exit code and that the flag is in the one line, never the message's wording.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import attacks, common, frontier, house_price, mnist
from tests.cli_helpers import call, one_line

SCRIPTS = (house_price, mnist, frontier, attacks)
ROOT = Path(__file__).resolve().parents[1]

USAGE_CASES = [  # (module, argv, the flag the one line must name)
    (house_price, ["--seeds", "4-2"], "--seeds"),
    (house_price, ["--seeds", "0,-1"], "--seeds"),
    (house_price, ["--seeds", "0,0"], "--seeds"),  # a repeated seed would count twice
    (house_price, ["--seeds", "0"], "--seeds"),
    (house_price, ["--seeds", "99999999999"], "--seeds"),
    (house_price, ["--lr", "nan"], "--lr"),
    (house_price, ["--lr", "0"], "--lr"),  # the library's bound, checked before compute
    (house_price, ["--lambda-h", "-inf"], "--lambda-h"),
    (house_price, ["--epochs", "1e9"], "--epochs"),
    (house_price, ["--epochs", "100000000000000000000000"], "--epochs"),
    (house_price, ["--jobs", "0"], "--jobs"),
    (house_price, ["--n-train", "1"], "--n-train"),
    (house_price, ["--probe-steps", "1000000000"], "--probe-steps"),
    (house_price, ["--methods", "ours,bogus"], "--methods"),
    (house_price, ["--methods", "ours,ours"], "--methods"),
    (house_price, ["--methods", ","], "--methods"),
    (house_price, ["--methods", ""], "--methods"),
    (mnist, ["--pairs", ""], "--pairs"),
    (house_price, ["--precond", "magic"], "--precond"),
    (house_price, ["--methods", "closed_form", "--exponent", "nan"], "--exponent"),
    (house_price, ["--methods", "ours", "--precond", "ridge", "--ridge", "0"], "--ridge"),
    (house_price, ["--data", "/nonexistent/train.csv"], "--data"),
    (house_price, ["--seed", "3"], "--seed"),  # no abbreviation of --seeds
    (house_price, ["--bogus"], "--bogus"),
    (mnist, ["--pairs", "3-3"], "--pairs"),
    (mnist, ["--pairs", "0-1,3-8,0-1"], "--pairs"),  # a repeated pair would count twice
    (mnist, ["--n-heldout", "0"], "--n-heldout"),
    (mnist, ["--mnist-dir", "/nonexistent"], "--mnist-dir"),
    (frontier, ["--grid-epochs", "1e9"], "--grid-epochs"),
    (frontier, ["--exponents", ",".join(map(str, range(10_000)))], "--exponents"),
    (frontier, ["--lr-grid", "0.1,-1"], "--lr-grid"),
    (frontier, ["--seeds", "5000"], "--seeds"),  # 5000 × 20 runs: over the bound on runs
    (attacks, ["--orders", "1000000000"], "--orders"),  # a grid of a billion orders
    (attacks, ["--max-steps", "1000000000"], "--max-steps"),
    (attacks, ["--mnist-epochs", "1e9"], "--mnist-epochs"),
    (attacks, ["--eps", "0"], "--eps"),
    (attacks, ["--attackers", "gd_exact,psychic"], "--attackers"),
    (attacks, ["--methods", "ours", "--hardened-methods", "closed_form"], "--hardened-methods"),
    (attacks, ["--mnist-only"], "--mnist-only"),
    (attacks, ["--logistic-ridge", "0"], "--logistic-ridge"),
]


@pytest.mark.parametrize(
    "mod,argv,flag",
    USAGE_CASES,
    ids=[f"{m.__name__.split('.')[-1]}:{' '.join(a)[:40]}" for m, a, _ in USAGE_CASES],
)
def test_a_usage_error_is_exit_2_and_one_line_naming_the_flag_before_compute(
    tripwire, capsys, tmp_path, mod, argv, flag
):
    rc, err = call(capsys, mod, [*argv, "--out", str(tmp_path / "out")])
    assert rc == 2, err
    assert one_line(err, flag).startswith(f"{mod.build_parser().prog}: error: ")
    assert not (tmp_path / "out").exists()


def test_an_option_no_chosen_method_has_is_refused(tripwire, capsys, tmp_path):
    for argv, flag in (
        (["--methods", "ours", "--inner-steps", "5"], "--inner-steps"),
        (["--methods", "identity,closed_form", "--lr", "0.1"], "--lr"),
        (["--methods", "imma", "--certified"], "--certified"),
    ):
        rc, err = call(capsys, house_price, [*argv, "--out", str(tmp_path / "o")])
        assert rc == 2 and one_line(err, flag) and not (tmp_path / "o").exists()
    args = house_price.parse_args(["--methods", "imma,ours", "--inner-steps", "5", "--lr", "0.01"])
    assert args.immunizer.given == {"imma": {"inner_steps": 5, "lr": 0.01}, "ours": {"lr": 0.01}}


@pytest.mark.parametrize("mod", (house_price, mnist, attacks), ids=lambda m: m.__name__)
def test_every_linear_option_has_its_flag_and_the_library_checks_it(mod, tmp_path):
    """A flag per option of every method (Adam's betas pair aside), each reaching the library as
    typed: a value the library refuses is a usage error naming that flag."""
    from pycore import METHODS, options_of
    from pycore._algorithm1 import CertifiedOptions

    parser = mod.build_parser()
    names = {*CertifiedOptions.names(), *(n for m in METHODS for n in options_of(m).names())}
    assert [n for n in names - {"betas"} if parser.flag_for(n) is None] == []
    args = parser.parse_args(["--lambda-h", "2.5", "--batch-size", "none", "--no-log"])
    assert common.given_options(args, names) == {
        "lambda_h": 2.5,
        "batch_size": None,
        "log": False,
    }


@pytest.mark.parametrize("mod", SCRIPTS, ids=lambda m: m.__name__)
def test_every_count_flag_refuses_a_value_past_its_bound(mod):
    """Counts, seeds and comma lists fail at once on a value no run could use (``--orders 1e30``,
    100,000 list items), before any allocation sized by it."""
    parser = mod.build_parser()
    counts = [
        a for a in parser._actions if getattr(a.type, "__name__", "") in ("count", "seeds", "list")
    ]
    assert counts
    huge = {"count": str(10**30), "seeds": str(10**30), "list": ",".join(map(str, range(10**5)))}
    for action in counts:
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(huge[action.type.__name__])


@pytest.mark.parametrize(
    "argv",
    [
        ["experiments/deepnet.py"],
        ["-m", "experiments.audit"],
        ["experiments/house_price.py"],
        ["experiments/mnist.py"],
        ["experiments/attacks.py"],
        ["experiments/frontier.py"],
    ],
    ids=lambda a: a[-1],
)
def test_help_answers_without_importing_torch(argv):
    """``--help`` prints the flags (exit 0) and never loads torch or timm (seconds of imports):
    checked on the modules a fresh interpreter holds after it."""
    run = (
        f"runpy.run_module({argv[1]!r}, run_name='__main__', alter_sys=True)"
        if argv[0] == "-m"
        else f"runpy.run_path({argv[0]!r}, run_name='__main__')"
    )
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{argv[-1]!r}, '--help']\n"
        "try:\n"
        f"    {run}\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "print(sorted(m for m in ('torch', 'timm', 'torchvision') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--out" in proc.stdout and proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_deep_catalog_is_what_the_library_and_configurations_hold():
    """experiments/deep_catalog.py (what the deep --help prints without torch) is current."""
    from scripts import deep_catalog

    assert (ROOT / "experiments" / "deep_catalog.py").read_text() == deep_catalog.render()
