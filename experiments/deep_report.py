"""Tables and figures of the deep-net experiments (docs/deep.md): the Table 3 layout, the
attackers, the comparison with θ₀, the probing and attack curves and the (i)/(ii) trade-off.

Functions take the result dictionaries of :mod:`pycore.deep.evaluate` and return Markdown
strings or write one figure each; nothing here computes a metric.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pycore.report import METHOD_LABELS, fmt, pm, save_figure

__all__ = ["METHOD_LABELS", "HARDENING_LABELS", "ATTACKER_LABELS", "label", "table_markdown", "plot_probing",
           "plot_attacks", "tradeoff_markdown", "plot_tradeoff"]

HARDENING_LABELS = {"rotate": "rotated", "label_subspace": "label-subspace hardened"}
ATTACKER_LABELS = {"gd": "linear probe, GD step 1/L (paper)",
                   "adam": "linear probe, Adam (best lr × {scaled, standardised})",
                   "adam_whitened": "linear probe, Adam on whitened features (adaptive)",
                   "finetune": "fine-tune last stage + layer + new head, Adam"}
_SHORT = {"gd": "GD 1/L", "adam": "Adam", "adam_whitened": "whitened Adam", "finetune": "fine-tune"}


def label(key: str) -> str:
    """Table label of a row key: a method, or ``"<method>+<hardening>"``."""
    method, _, kind = key.partition("+")
    text = METHOD_LABELS.get(method, method)
    return f"{text}, {HARDENING_LABELS.get(kind, kind)}" if kind else text


def _bold(key: str) -> str:
    return f"**{label(key)}**" if key.split("+")[0] == "ours" else label(key)


def _order(rows: dict) -> list[str]:
    plain = [k for k in rows if "+" not in k]
    return plain + [k for k in rows if "+" in k]


def _delta(result: dict, key: str, get) -> "dict | None":
    """Per-seed difference ``get(row) − get(θ₀'s row)``, summarised over the seeds both have."""
    per = []
    for s in result["per_seed"]:
        rows = s["rows"]
        if key in rows and "init" in rows:
            a, b = get(rows[key]), get(rows["init"])
            if a is not None and b is not None:
                per.append(a - b)
    if not per:
        return None
    a = np.asarray(per, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std())}


def _attack_at(name: str, epoch: int):
    def get(row):
        curve = row["attacks"].get(name)
        return None if curve is None or epoch >= len(curve) else curve[epoch]
    return get


def table_markdown(result: dict, paper: "dict | None" = None) -> str:
    """The configuration's tables: Table 3's layout (with the paper's numbers when ``paper`` is
    given), the attackers after each scored epoch, and every row against θ₀ seed by seed."""
    rows, seeds, rc = result["rows"], result["seeds"], result["run_config"]
    n_groups, group_size = rc["rir_groups"], rc["rir_group_size"]
    order = _order(rows)
    lines = [f"# Deep-net immunization: {result['config']} (backbone {result['backbone']}, immunized: "
             f"{result['scope']}, seeds {seeds}, {result['threads']} threads)", "",
             f"Mean ± std over {len(seeds)} seed(s); per seed, RIR_θ₀ against a frozen copy of θ₀ is the "
             f"mean over {n_groups} groups of {group_size} samples. D_P top-1 on the D_P validation split. "
             "Def. 3.1: seeds with (i) > 1 and (ii) < 1.", "",
             "| method | (i) κ ratio on D_H ↑ | (ii) κ ratio on D_P ↓ | RIR_θ₀ ↑ | Def. 3.1 | D_P top-1 % | "
             f"GD probe on D_H, epoch 10 ↓ | epoch {rc['probe_epochs']} ↓ |"
             + (" paper RIR_θ₀ | paper D_P % |" if paper else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if paper else "")]
    for m in ["init", *rc["methods"]]:
        if m not in rows:
            fails = [f"seed {k[4:]}: {v[m]['message']}" for k, v in result["errors"].items() if m in v]
            if fails:
                lines.append(f"| {label(m)} | failed: {'; '.join(fails)} |")
    for m in order:
        r = rows[m]
        line = (f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | "
                f"{pm(r['rir_theta0'])} | {r['immunized_count']}/{len(r['seeds'])} | {pm(r['dp_top1'])} | "
                f"{pm(r['probe_acc_epoch10'])} | {pm(r['probe_acc_last'])} |")
        if paper:
            p = paper.get(m)
            line += f" {p[2]} | {p[3]} |" if p else " | |"
        lines.append(line)
    if all("harmful_top_ratio" in rows[m] for m in order):
        lines += ["", "(i) decomposed (D_H groups of the same size; scale-free): the largest and the "
                  "smallest nonzero eigenvalue of H_H relative to its median eigenvalue, each divided by "
                  "θ₀'s (geometric means; their quotient is the groups' κ ratio). top > 1: the largest "
                  "eigenvalue rose above the rest; bottom < 1: the smallest fell below them.", "",
                  "| method | (i) ↑ | top ratio | bottom ratio |", "|---|---|---|---|"]
        for m in order:
            r = rows[m]
            lines.append(f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['harmful_top_ratio'])} | "
                         f"{pm(r['harmful_bottom_ratio'])} |")
    epochs = rc["attack_epochs"]
    attackers = [a for a in ATTACKER_LABELS if any(a in r["attacks"] for r in rows.values())]
    if attackers:
        lines += ["", f"D_H test accuracy (%) of each attacker after {' / '.join(map(str, epochs))} epochs "
                  "(↓ = harder for the attacker; mean over seeds):", "",
                  "| method | " + " | ".join(ATTACKER_LABELS[a] for a in attackers) + " |",
                  "|---|" + "---|" * len(attackers)]
        for m in order:
            cells = [" / ".join(fmt(rows[m]["attacks"][a][f"epoch{e}"]["mean"], 3) for e in epochs)
                     if a in rows[m]["attacks"] else "" for a in attackers]
            lines.append(f"| {_bold(m)} | " + " | ".join(cells) + " |")
        cols = [("D_P top-1", lambda r: r["dp_top1"]), ("GD @10", lambda r: r["probe_acc_epoch10"])]
        for a in ("adam", "adam_whitened", "finetune"):
            if a in attackers:
                cols += [(f"{_SHORT[a]} @{e}", _attack_at(a, e)) for e in (1, 5) if e in epochs]
        lines += ["", "Each row minus θ₀ on the same seed (points; mean ± std over seeds). The attacker "
                  "columns are D_H test accuracy: negative = slower than on θ₀.", "",
                  "| method | Def. 3.1 | " + " | ".join(c for c, _ in cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for m in order:
            if m == "init":
                continue
            cells = []
            for _, get in cols:
                d = _delta(result, m, get)
                cells.append("" if d is None else f"{d['mean']:+.1f} ± {d['std']:.1f}")
            lines.append(f"| {_bold(m)} | {rows[m]['immunized_count']}/{len(rows[m]['seeds'])} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _style(m):
    base = m.split("+")[0]
    return {"lw": 2.2 if base in ("ours", "init") else 1.3, "ls": "--" if base == "init" else
            (":" if "+" in m else "-")}


def plot_probing(result: dict, path: Path) -> None:
    """Figure 3: seed-mean D_H test accuracy of the paper's probe per epoch, band = min..max over seeds."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in _order(result["rows"]):
        r = result["rows"][m]
        c = r["probe_curve"]
        x = range(len(c["mean"]))
        line, = ax.plot(x, c["mean"], label=label(m), **_style(m))
        if len(r["seeds"]) > 1:
            ax.fill_between(x, c["min"], c["max"], color=line.get_color(), alpha=0.12, lw=0)
    ax.set_xlabel("linear-probing epoch (full-batch GD, step 1/L)")
    ax.set_ylabel("D_H test accuracy (%)  ↓ better")
    ax.set_title(f"Linear probing on D_H: {result['config']} ({len(result['seeds'])} seeds, band min–max)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5)
    save_figure(fig, path)


def plot_attacks(result: dict, path: Path) -> None:
    """One panel per attacker: seed-mean D_H test accuracy per epoch, band = min..max over seeds."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = result["rows"]
    attackers = [a for a in ATTACKER_LABELS if any(a in r["attacks"] for r in rows.values())]
    fig, axes = plt.subplots(1, len(attackers), figsize=(4.4 * len(attackers), 3.9), squeeze=False)
    for ax, a in zip(axes[0], attackers):
        for m in _order(rows):
            r = rows[m]
            if a not in r["attacks"]:
                continue
            c = {k: np.asarray(v, dtype=float) for k, v in r["attacks"][a]["curve"].items()}
            x = np.flatnonzero(np.isfinite(c["mean"]))  # the fine-tuning attacker is scored at a few epochs
            line, = ax.plot(x, c["mean"][x], label=label(m), marker="o" if len(x) < 8 else None, ms=3,
                            **_style(m))
            if len(r["seeds"]) > 1:
                ax.fill_between(x, c["min"][x], c["max"][x], color=line.get_color(), alpha=0.12, lw=0)
        ax.set_title(ATTACKER_LABELS[a], fontsize=8)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("D_H test accuracy (%)  ↓ better")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"Attackers on D_H: {result['config']}", fontsize=10)
    save_figure(fig, path)


# --- the (i)/(ii) trade-off -------------------------------------------------------------------

def _points(result: dict, method: str, variant: str):
    """Seed-mean of each sweep point of ``variant`` (a row key): [(b, b_ill, mean dict or None)]."""
    out = []
    for k, per in result["runs"][method].items():
        b, bi = k.split(",")
        vals = [p[variant] for p in per if variant in p]
        ok = [v for v in vals if "error" not in v]
        mean = ({f: float(np.mean([v[f] for v in ok])) for f in ok[0] if not isinstance(ok[0][f], bool)}
                if ok and len(ok) == len(vals) else None)
        if mean is not None:
            mean["immunized"] = sum(bool(v["immunized"]) for v in ok)
        out.append((float(b), float(bi) if bi else None, mean, len(vals)))
    return out


def tradeoff_markdown(result: dict) -> str:
    """One line per (method variant, b, b_ill): seed means of (i), (ii), Def. 3.1, D_P top-1 and the
    probes, θ₀'s seed means first."""
    t0 = [v for v in result["theta0"].values()]
    mean0 = {k: float(np.mean([v[k] for v in t0])) for k in t0[0] if not isinstance(t0[0][k], bool)}
    n = len(result["seeds"])
    cols = ("harmful_ratio", "pretrain_ratio", "rir_theta0", "dp_top1", "probe_acc_epoch10",
            "adam_acc_epoch1", "adam_acc_epoch5", "adam_whitened_acc_epoch1", "adam_whitened_acc_epoch5")
    head = ("| row | b | b_ill | (i) ↑ | (ii) ↓ | RIR_θ₀ | Def. 3.1 | D_P top-1 % | GD @10 ↓ | Adam @1 ↓ | "
            "Adam @5 ↓ | whitened Adam @1 ↓ | @5 ↓ |")
    lines = [f"# (i)/(ii) trade-off: {result['config']} (seeds {result['seeds']}, {result['threads']} "
             "threads; seed means)", "", head, "|" + "---|" * 13,
             f"| {METHOD_LABELS['init']} | | | 1 | 1 | 1 | " + f"0/{n} | "
             + " | ".join(fmt(mean0.get(c, float("nan")), 3) for c in cols[3:]) + " |"]
    for m in result["methods"]:
        variants = sorted({v for per in result["runs"][m].values() for p in per for v in p if v != "seed"},
                          key=lambda v: ("+" in v, v))
        for v in variants:
            for b, bi, mean, count in _points(result, m, v):
                if mean is None:
                    bi_text = "" if bi is None else f"{bi:g}"
                    lines.append(f"| {label(v)} | {b:g} | {bi_text} | diverged |" + " |" * 9)
                    continue
                lines.append(f"| {label(v)} | {b:g} | {'' if bi is None else f'{bi:g}'} | "
                             + " | ".join(fmt(mean.get(c, float("nan")), 4) for c in cols[:3])
                             + f" | {mean['immunized']}/{count} | "
                             + " | ".join(fmt(mean.get(c, float("nan")), 3) for c in cols[3:]) + " |")
    return "\n".join(lines) + "\n"


def plot_tradeoff(result: dict, path: Path) -> None:
    """Left: log (i) against log (ii) per sweep point (seed means); Definition 3.1 is the quadrant
    (i) > 1, (ii) < 1. Middle and right: D_P top-1 and the Adam probe at epoch 5 against (i), θ₀ dashed."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.0))
    t0 = list(result["theta0"].values())
    for m in result["methods"]:
        variants = sorted({v for per in result["runs"][m].values() for p in per for v in p if v != "seed"})
        for v in variants:
            pts = [p for p in _points(result, m, v) if p[2] is not None]
            if not pts:
                continue
            x = [p[2]["harmful_ratio"] for p in pts]
            kw = {"marker": "s" if "+" in v else "o", "ls": "none", "label": label(v)}
            line, = axes[0].plot(x, [p[2]["pretrain_ratio"] for p in pts], **kw)
            kw["color"] = line.get_color()
            axes[1].plot(x, [p[2]["dp_top1"] for p in pts], **kw)
            axes[2].plot(x, [p[2].get("adam_acc_epoch5", np.nan) for p in pts], **kw)
            for p, xi in zip(pts, x):
                axes[0].annotate(f"{p[0]:g}" + (f"/{p[1]:g}" if p[1] is not None else ""),
                                 (xi, p[2]["pretrain_ratio"]), fontsize=6, alpha=0.7)
    axes[0].axvline(1, color="k", lw=0.8)
    axes[0].axhline(1, color="k", lw=0.8)
    axes[0].set(xscale="log", yscale="log", xlabel="(i) κ ratio on D_H ↑", ylabel="(ii) κ ratio on D_P ↓",
                title="labels: b / b_ill; Def. 3.1 holds right of x = 1 and below y = 1")
    for ax, key, ylab in ((axes[1], "dp_top1", "D_P top-1 %"),
                          (axes[2], "adam_acc_epoch5", "Adam probe @5, D_H %")):
        ax.axhline(float(np.mean([v[key] for v in t0])), color="k", ls="--", lw=1, label="θ₀")
        ax.set(xscale="log", xlabel="(i) κ ratio on D_H ↑", ylabel=ylab)
        ax.grid(alpha=0.3)
    axes[0].grid(alpha=0.3)
    axes[0].title.set_fontsize(8)
    axes[2].legend(fontsize=6)
    fig.suptitle(f"(i)/(ii) trade-off: {result['config']} ({len(result['seeds'])} seed(s))", fontsize=10)
    save_figure(fig, path)
