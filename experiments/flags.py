"""The experiments' command-line types and option flags (docs/cli.md "Bounds"), in plain
argparse: bounded flag types that fail at once (:func:`count`, :func:`real`, :func:`comma_list`,
:data:`seeds`, :func:`existing`), :class:`Parser` (one-line usage errors, no abbreviations,
``--debug``), the flags several commands share, and the library's options as flags, which only
convert text: the library checks each value (:func:`add_option`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from experiments.outputs import UsageError
from experiments.pool import MAX_JOBS, usable_cores

MAX_SEEDS = 10_000  # a typo such as --seeds 10000000 must fail at once, not run for weeks
MAX_ITEMS = 1000  # items of a comma list


def flag_type(name: str, bound: str | None, convert):
    """An argparse ``type`` whose ValueError message is the flag's error; ``bound`` is shown by
    ``--help``."""

    def parse(text):
        try:
            return convert(str(text).strip())
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__, parse.bound = name, bound
    return parse


def count(lo: int = 0, hi: int | None = None):
    """An integer in ``[lo, hi]``.  Give every count a ``hi``: ``--orders 1e9`` must fail at
    once."""
    bound = f"from {lo} to {hi}" if hi is not None else f"≥ {lo}"

    def convert(t):
        n = int(t) if t.lstrip("+-").isdecimal() else None
        if n is None or n < lo or (hi is not None and n > hi):
            raise ValueError(f"expected an integer {bound}, got {t!r}")
        return n

    return flag_type("count", bound, convert)


def real(lo: float | None = None, hi: float | None = None, *, lo_open=False, hi_open=False):
    """A finite float in the interval from ``lo`` to ``hi`` (open ends where asked)."""
    parts = [
        f"{'>' if lo_open else '≥'} {lo:g}" if lo is not None else "",
        f"{'<' if hi_open else '≤'} {hi:g}" if hi is not None else "",
    ]
    bound = " and ".join(p for p in parts if p) or None

    def convert(t):
        x = float(t)
        if not (
            math.isfinite(x)
            and (lo is None or x > lo or (x == lo and not lo_open))
            and (hi is None or x < hi or (x == hi and not hi_open))
        ):
            raise ValueError(f"expected a finite number{' ' + bound if bound else ''}, got {t!r}")
        return x

    return flag_type("real", bound, convert)


def comma_list(item=str, *, choices=None, max_items: int = MAX_ITEMS):
    """Distinct comma-separated items (at most ``max_items``), each parsed by ``item``, in
    ``choices``."""
    inner = getattr(item, "bound", None)
    bound = (
        "from " + ",".join(choices)
        if choices is not None
        else f"at most {max_items} items" + (f", each {inner}" if inner else "")
    )

    def convert(t):
        parts = [p.strip() for p in t.split(",")]
        if not t:
            raise ValueError(
                "is empty: give one item or more, comma-separated"
                + (f" (from {','.join(choices)})" if choices is not None else "")
            )
        if not all(parts):
            raise ValueError(f"an empty item in {t[:80]!r} (a comma too many?)")
        if len(parts) > max_items:
            raise ValueError(f"{len(parts)} items; at most {max_items}")
        values = [item(p) for p in parts]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or len(set(values)) != len(values):
            raise ValueError(
                f"unknown item {bad[0]!r}; choose from {','.join(choices)}"
                if bad
                else f"repeated item in {t!r}"
            )
        return values

    return flag_type("list", bound, convert)


def _seeds(t: str) -> list[int]:
    try:
        if "," in t:
            return comma_list(count(0), max_items=MAX_SEEDS)(t)
        if "-" in t[1:]:
            a, b = (count(0)(s) for s in t.split("-", 1))
            if b < a or b - a >= MAX_SEEDS:
                raise ValueError(f"range {t!r} is empty or holds more than {MAX_SEEDS} seeds")
            return list(range(a, b + 1))
        return list(range(count(1, MAX_SEEDS)(t)))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{exc} (seeds: a count N, a list A,B,C or a range A-B)") from None


seeds = flag_type("seeds", f"at most {MAX_SEEDS} seeds ≥ 0", _seeds)


def existing(kind: str = "file"):
    """A path that exists and is a ``file`` or a ``folder``."""

    def convert(t):
        p = Path(t).expanduser()
        if not (p.is_file() if kind == "file" else p.is_dir()):
            raise ValueError(f"no such {kind}: {t}" if not p.exists() else f"not a {kind}: {t}")
        return p

    return flag_type("path", None, convert)


def distinct_roots(dp_root, dh_root) -> None:
    """``--dh-root`` is not ``--dp-root``'s folder: the attacker's images must be disjoint from
    every image the defense saw (the reports say they are)."""
    if dp_root and dh_root and Path(dp_root).resolve() == Path(dh_root).resolve():
        raise UsageError(
            f"{dh_root} is --dp-root's folder too: D_H's images (the attacker's) must be another "
            "task's, disjoint from D_P's",
            "--dh-root",
        )


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its bound (the action's or its type's ``bound``) and default
    (the action's ``shown``, else its default)."""

    def _get_help_string(self, action):
        default = getattr(action, "shown", action.default)
        if isinstance(default, (list, tuple)):  # as typed: a comma list
            default = ",".join(map(str, default))
        notes = [getattr(action, "bound", None) or getattr(action.type, "bound", None)]
        if not any(default is x for x in (None, False, argparse.SUPPRESS)):
            notes.append(
                f"default {default:g}" if isinstance(default, float) else f"default {default}"
            )
        notes = "; ".join(n for n in notes if n).replace("%", "%%")
        return (action.help or "") + (f" ({notes})" if notes else "")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (a :class:`UsageError`), no prefix abbreviations
    (``--seed`` is not ``--seeds``) and ``--debug``."""

    def __init__(self, prog: str, description: str | None = None, epilog: str | None = None):
        super().__init__(
            prog=prog,
            description=description,
            epilog=epilog and textwrap.fill(epilog, 79),  # the raw formatter keeps lines
            formatter_class=_Help,
            allow_abbrev=False,
        )
        self.add_argument("--debug", action="store_true", help="on error, print the traceback")

    def error(self, message):
        raise UsageError(message.removeprefix("argument "))

    def flag_for(self, name: str | None) -> str | None:
        """The flag whose value lands in ``args.<name>``, or None."""
        return next(
            (
                max(a.option_strings, key=len)
                for a in self._actions
                if name and a.dest == name and a.option_strings
            ),
            None,
        )


def add_seeds(parser, default: str, what: str = "seeds") -> None:
    parser.add_argument(
        "--seeds",
        type=seeds,
        default=default,
        metavar="N|A,B,C|A-B",
        help=f"{what}: a count N (0..N-1), a list or a range",
    )


def add_out(parser, default: str) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default),
        help="output folder (only this run's files, by name, are replaced)",
    )


def add_run_flags(parser, seeds: str, out: str, what: str = "seeds") -> None:
    """``--seeds``, ``--out`` and ``--jobs`` of the linear commands."""
    add_seeds(parser, seeds, what)
    add_out(parser, out)
    parser.add_argument(
        "--jobs",
        type=count(1, MAX_JOBS),
        default=min(2, usable_cores()),
        help="worker processes (never more than the tasks or the usable cores)",
    )


def add_house_price_data(
    parser, data_help="Kaggle House Prices train.csv (default: the packaged copy)"
):
    """``--data``, ``--on-outlier`` and ``--n-train`` of the House Prices commands."""
    parser.add_argument("--data", type=existing("file"), help=data_help)
    parser.add_argument(
        "--on-outlier",
        choices=("warn", "error"),
        default="warn",
        help="a cell > 1e6 × its column's median magnitude: warn or refuse the file",
    )
    parser.add_argument(
        "--on-missing",
        choices=("fill", "error"),
        default="fill",
        help="an empty input cell: set it to 0 (counted in one line and in results.json) or "
        "refuse the file",
    )
    parser.add_argument(
        "--n-train", type=count(2, 1_000_000), default=200, help="training rows per split"
    )


def thread_count(asked: int, prog: str) -> int:
    """``--threads`` capped at the usable cores (more threads than cores only contend; a result is
    recorded with the count it ran with), saying so when it caps."""
    cores = usable_cores()
    if asked > cores:
        print(
            f"{prog}: warning: --threads {asked} capped at the {cores} usable core(s)",
            file=sys.stderr,
            flush=True,
        )
    return min(asked, cores)


# ---------------------------------------------------------------- library options as flags
#
# Every option flag is written out (timm's train.py style) and only converts its text to a Python
# value: the library checks each value once, when the command builds its options before any
# compute, and its refusal names the option, hence the flag
# (:func:`experiments.outputs.describe`). A flag is absent from ``args`` unless typed
# (``default=SUPPRESS``), so the preset or the library's default stays the one source of every
# value.


def int_or_none(text: str) -> int | None:
    """An int, or None for ``none``."""
    return None if text == "none" else int(text)


def float_or_none(text: str) -> float | None:
    """A float, or None for ``none``."""
    return None if text == "none" else float(text)


def float_or_word(text: str) -> float | str:
    """A float, or a word such as ``auto`` (the library says which words an option takes)."""
    return text if text.isalpha() else float(text)


def add_option(group, flag: str, options, *, shown=None, **kwargs) -> argparse.Action:
    """``group.add_argument(flag, **kwargs)`` for the option that ``flag`` names (``--lambda-h``
    sets ``lambda_h``) of the :class:`pycore._options.Options` class ``options``, absent unless
    typed; ``--help`` adds the library's rule and ``shown``, the default it prints."""
    dest = flag.removeprefix("--").replace("-", "_")
    action = group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, **kwargs)
    action.shown = shown
    if not isinstance(action, argparse.BooleanOptionalAction):  # --x/--no-x says it already
        action.bound = options.describe(dest)
    return action


def given_options(args, names) -> dict:
    """``{option: value}`` of the option flags among ``names`` the user typed (``none`` too: a
    value, not a gap)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def add_immunize_options(parser, preset: str | None, *, own_table: bool = False) -> None:
    """A flag per option of every linear method (``--help`` shows ``preset``'s values, and with
    ``own_table`` the values a table of one's own runs), ``--certified`` and ``--harden``."""
    from pycore import HARDENINGS, PRESETS, LinearOptions

    shown = (_shown_defaults(preset) if own_table else PRESETS[preset]) if preset else {}
    g = parser.add_argument_group(
        "immunization options (pycore.immunize; each one typed beats the preset)"
    )

    def option(flag, **kwargs):
        dest = flag.removeprefix("--").replace("-", "_")
        add_option(g, flag, LinearOptions, shown=shown.get(dest), **kwargs)

    option("--epochs", type=int, metavar="N", help="epochs (the adaptive Algorithm 1: steps)")
    option("--lr", type=float, metavar="X", help="learning rate of Adam or GD")
    option(
        "--batch-size",
        type=int_or_none,
        metavar="N|none",
        help="D_P mini-batch of the loss term (none: the full batch)",
    )
    option("--init", metavar="WORD", help="θ's start: identity, or random (nn.Linear's)")
    option("--optimizer", metavar="WORD", help="adam, or gd (Algorithm 1 as printed)")
    option("--adam-eps", type=float, metavar="X", help="Adam's ε")
    option(
        "--lambda-p",
        type=float_or_word,
        metavar="X|auto",
        help="λ_P, weight of R_well(H_P); auto with --lambda-h auto: the adaptive Algorithm 1",
    )
    option("--lambda-h", type=float_or_word, metavar="X|auto", help="λ_H, weight of R_ill(H_H)")
    option("--precond", metavar="WORD", help="preconditioner of the regularizer gradients")
    option("--ridge", type=float, metavar="X", help="λ of --precond ridge: (K + λI)⁻¹")
    option(
        "--patience",
        type=int,
        metavar="N",
        help="adaptive Algorithm 1: steps without progress before lr/3 (twice), then stop",
    )
    option(
        "--safety",
        type=float,
        metavar="X",
        help="R_ill only and --certified: the fraction of each step bound taken",
    )
    option("--inner-steps", type=int, metavar="N", help="IMMA: unrolled attacker steps")
    option("--inner-lr", type=float, metavar="X", help="IMMA: attacker step in units of 1/L")
    option("--lambda-kappa", type=float, metavar="X", help="Opt κ: weight of κ(H_P) − κ(H_H)")
    option("--log", action=argparse.BooleanOptionalAction, help="Opt κ: on log κ")
    option(
        "--exponent",
        type=float_or_word,
        metavar="X|auto",
        help="closed form: s² = λ_C^a; auto: the balanced exponent of the Definition 3.1 window",
    )
    parser.add_argument("--certified", action="store_true", help="ours in certified-monotone mode")
    parser.add_argument(
        "--harden",
        choices=HARDENINGS["linear"],
        default="none",
        help="θ → θQ after the method (pycore.harden_result, docs/findings.md §5)",
    )


def add_deep_options(parser) -> None:
    """A flag per field of :class:`pycore.deep.DeepOptions` (``--lambda-h`` sets ``lambda_h``),
    absent unless typed: the configuration's options stay the default of every one. Each rule
    comes from :mod:`experiments.deep_catalog` (``--help`` imports no torch); the library checks
    the values."""
    from experiments.deep_catalog import DEEP_OPTIONS

    g = parser.add_argument_group("immunization options (default: the configuration's)")
    rules = SimpleNamespace(describe=DEEP_OPTIONS.__getitem__)  # a flag of no field: KeyError

    def option(flag, **kwargs):
        add_option(g, flag, rules, **kwargs)

    flag = argparse.BooleanOptionalAction
    option(
        "--rule",
        metavar="WORD",
        help="ours: adaptive (the linear default's rule on the layer) or sgd (the paper's loop)",
    )
    option("--adaptive-steps", type=int, metavar="N", help="the adaptive rule's step budget")
    option("--patience", type=int, metavar="N", help="the adaptive rule's patience (steps)")
    option(
        "--adaptive-lr",
        type=float_or_none,
        metavar="X|none",
        help="the adaptive rule's Adam lr (none: 0.27/√D)",
    )
    option("--epochs", type=int, metavar="N", help="epochs of the paired D_P/D_H loader")
    option("--max-steps", type=int_or_none, metavar="N|none", help="step cap")
    option("--batch-size", type=int, metavar="N", help="samples per task and step, per rank")
    option("--lr", type=float, metavar="X", help="the loop's learning rate")
    option("--optimizer", metavar="WORD", help="the loop's optimizer: sgd (the paper's) or adam")
    option("--momentum", type=float, metavar="X", help="SGD momentum")
    option("--nesterov", action=flag, help="Nesterov momentum")
    option("--weight-decay-extractor", type=float, metavar="X", help="weight decay of θ")
    option("--weight-decay-classifier", type=float, metavar="X", help="of the classifier")
    option("--label-smoothing", type=float, metavar="X", help="of the D_P cross-entropy")
    option("--lambda-p", type=float, metavar="X", help="R_well weight (with --balance none)")
    option("--lambda-h", type=float, metavar="X", help="R_ill weight (with --balance none)")
    option("--lambda-kappa", type=float, metavar="X", help="Opt κ weight")
    option("--lambda-imma", type=float, metavar="X", help="IMMA harmful-loss weight")
    option(
        "--balance",
        type=float_or_none,
        metavar="X|none",
        help="λ = b·‖∇CE‖/‖∇term‖ (App. C.2); none: the fixed --lambda-* values",
    )
    option(
        "--balance-every", type=int, metavar="N", help="steps between balances (0: step 0 only)"
    )
    option(
        "--balance-ill",
        type=float_or_none,
        metavar="X|none",
        help="the balance of the R_ill term alone (the trade-off sweep)",
    )
    option("--imma-inner-steps", type=int, metavar="N", help="IMMA: unrolled attacker steps")
    option("--kstep-steps", type=int, metavar="N", help="kstep: the GD probe's steps k of E_k")
    option("--imma-inner-lr", type=float, metavar="X", help="IMMA: attacker step (1/λ_max units)")
    option(
        "--ridge-rel", type=float, metavar="X", help="preconditioner ridge, relative to tr(XᵀX)/N"
    )
    option(
        "--scope",
        metavar="WORD",
        help="layer: the immunization layer alone; tail: also the backbone's last --stages stages",
    )
    option("--stages", type=int, metavar="N", help="--scope tail: the backbone's last stages")
    option("--virtual-ranks", type=int, metavar="N", help="reproduce N ranks' objective in one")
    option("--harden", metavar="WORD", help="also measure every row hardened this way")
    option("--harden-scale", type=float, metavar="X", help="strength of --harden")
    option("--normalize", action=flag, help="steps in unit-scale features")
    option(
        "--fold-batchnorm",
        action=flag,
        help="scope tail: fold the trained BatchNorms into their convolutions first",
    )
    option(
        "--dp-tolerance",
        type=float_or_none,
        metavar="X|none",
        help="end on the last state within this many %% of D_P's top-1",
    )


def _shown_defaults(preset: str) -> dict:
    """``--help``'s default of each option: the preset's value, and where a table of one's own
    runs another (the library's defaults, e.g. "auto" λ's), that one too, per method."""
    from pycore import METHODS, PRESETS
    from pycore._immunization import resolve_options

    def text(v):
        return f"{v:g}" if isinstance(v, float) else str(v)

    own: dict = {}  # option → {method: its value with the library's defaults}
    for m in METHODS:
        defaults = resolve_options(m)  # resolved: ours' epochs None → 5000 with "auto" λ's
        for f in dataclasses.fields(defaults):
            own.setdefault(f.name, {})[m] = text(getattr(defaults, f.name))
    shown = dict(PRESETS[preset])
    for name, per_method in own.items():
        values = list(per_method.values())
        common = max(values, key=values.count)
        odd = [f"{m} {v}" for m, v in per_method.items() if v != common]
        mine = common + (f" ({', '.join(odd)})" if odd else "")
        if name not in shown:
            shown[name] = mine
        elif odd or common != text(shown[name]):
            shown[name] = (
                f"{text(shown[name])} on the paper's data (preset {preset}), {mine} on a table "
                "of one's own"
            )
    return shown
