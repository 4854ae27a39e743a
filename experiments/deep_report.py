"""Tables and figures of the deep-net experiments (docs/deep.md): Table 3's layout, the attackers, every
row against θ₀, the probing and attack curves, the (i)/(ii) trade-off. Functions take the result
dictionaries of experiments/deep_pipeline.py and return Markdown or draw one figure; nothing here
computes a metric. Figures keep their legend beside the axes (never over the data) and name the
data and the model in their title; a method that failed is named in the figure, not left out.
"""
from __future__ import annotations

import numpy as np

from pycore.report import METHOD_LABELS, fmt, pm, save_figure

HARDENING_LABELS = {"rotate": "rotated", "label_subspace": "label-subspace hardened"}
ATTACKER_LABELS = {"gd": "linear probe, GD step 1/L (paper)",
                   "adam": "linear probe, Adam (best lr × {scaled, standardised})",
                   "adam_whitened": "linear probe, Adam on whitened features (adaptive)",
                   "finetune": "fine-tune last stage + layer + new head, Adam"}
SHORT = {"gd": "GD 1/L", "adam": "Adam", "adam_whitened": "whitened Adam", "finetune": "fine-tune"}


def label(key: str) -> str:
    """Label of a row key: a method, or ``"<method>+<hardening>"``."""
    method, _, kind = key.partition("+")
    text = METHOD_LABELS.get(method, method)
    return f"{text}, {HARDENING_LABELS.get(kind, kind)}" if kind else text


def _bold(key: str) -> str:
    return f"**{label(key)}**" if key.split("+")[0] == "ours" else label(key)


def _failures(result: dict) -> dict:
    """``{method: ["seed N: message"]}`` of the runs that stopped."""
    out = {}
    for seed, errs in result["errors"].items():
        for m, e in errs.items():
            out.setdefault(m, []).append(f"seed {seed[4:]}: {e['message']}")
    return out


def _delta(result: dict, key: str, get) -> "str":
    """Per-seed ``get(row) − get(θ₀'s row)``, as mean ± std over the seeds that have both."""
    per = [get(s["rows"][key]) - get(s["rows"]["init"]) for s in result["per_seed"]
           if key in s["rows"] and "init" in s["rows"] and get(s["rows"][key]) is not None]
    return f"{np.mean(per):+.1f} ± {np.std(per):.1f}" if per else ""


def _attack_at(name: str, epoch: int):
    return lambda row: row["attacks"][name][epoch] if epoch < len(row["attacks"].get(name, ())) else None


def table_markdown(result: dict, paper: "dict | None" = None) -> str:
    """Table 3's layout (beside the paper's numbers when given), the (i) decomposition, the attackers after
    each scored epoch, and every row minus θ₀ seed by seed; failed runs are listed, not left out."""
    rows, seeds, rc = result["rows"], result["seeds"], result["run_config"]
    lines = [f"# Deep-net immunization: {result['config']} — {result['model_text']} on {result['data']}", "",
             f"Immunized: {result['scope']}; seeds {seeds}; {result['threads']} threads. Mean ± std over seeds; per "
             f"seed RIR_θ₀ against a frozen θ₀ is the mean over {rc['rir_groups']} groups of {rc['rir_group_size']} "
             "samples. D_P top-1 on D_P's validation split. Def. 3.1: seeds with (i) > 1 and (ii) < 1.", "",
             "| method | (i) κ ratio on D_H ↑ | (ii) κ ratio on D_P ↓ | RIR_θ₀ ↑ | Def. 3.1 | D_P top-1 % | GD probe "
             f"on D_H, epoch 10 ↓ | epoch {rc['probe_epochs']} ↓ |" + (" paper RIR_θ₀ | paper D_P % |" if paper else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if paper else "")]
    for m, fails in _failures(result).items():
        lines.append(f"| {label(m)} | failed: {'; '.join(fails)} |")
    for m, r in rows.items():
        p = (paper or {}).get(m)
        lines.append(f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | {pm(r['rir_theta0'])} | "
                     f"{r['immunized_count']}/{len(r['seeds'])} | {pm(r['dp_top1'])} | {pm(r['probe_acc_epoch10'])} | "
                     f"{pm(r['probe_acc_last'])} |" + ((f" {p[2]} | {p[3]} |" if p else " | |") if paper else ""))
    lines += ["", "(i) decomposed on D_H groups of the same size: the largest and the smallest nonzero eigenvalue "
              "of H_H relative to its median, each divided by θ₀'s (geometric means; their quotient is the groups' "
              "κ ratio). top > 1: the largest eigenvalue rose above the rest; bottom < 1: the smallest fell below.",
              "", "| method | (i) ↑ | top ratio | bottom ratio |", "|---|---|---|---|"]
    lines += [f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['harmful_top_ratio'])} | "
              f"{pm(r['harmful_bottom_ratio'])} |" for m, r in rows.items()]
    epochs = rc["attack_epochs"]
    attackers = [a for a in ATTACKER_LABELS if any(a in r["attacks"] for r in rows.values())]
    if not attackers:
        return "\n".join(lines) + "\n"
    lines += ["", f"D_H test accuracy (%) of each attacker after {' / '.join(map(str, epochs))} epochs (↓ = harder "
              "for the attacker; mean over seeds):", "",
              "| method | " + " | ".join(ATTACKER_LABELS[a] for a in attackers) + " |", "|---|" + "---|" * len(attackers)]
    for m, r in rows.items():
        lines.append(f"| {_bold(m)} | " + " | ".join(" / ".join(fmt(r["attacks"][a][f"epoch{e}"]["mean"], 3)
                                                              for e in epochs) if a in r["attacks"] else ""
                                                     for a in attackers) + " |")
    cols = [("D_P top-1", lambda r: r["dp_top1"]), ("GD @10", lambda r: r["probe_acc_epoch10"])]
    cols += [(f"{SHORT[a]} @{e}", _attack_at(a, e)) for a in attackers[1:] for e in (1, 5) if e in epochs]
    lines += ["", "Each row minus θ₀ on the same seed (points; mean ± std over seeds); attacker columns are D_H "
              "test accuracy, negative = slower than on θ₀.", "",
              "| method | Def. 3.1 | " + " | ".join(c for c, _ in cols) + " |", "|---|---|" + "---|" * len(cols)]
    lines += [f"| {_bold(m)} | {r['immunized_count']}/{len(r['seeds'])} | "
              + " | ".join(_delta(result, m, get) for _, get in cols) + " |" for m, r in rows.items() if m != "init"]
    return "\n".join(lines) + "\n"


def _style(m: str) -> dict:
    base = m.split("+")[0]
    return {"lw": 2.2 if base in ("ours", "init") else 1.3, "ls": "--" if base == "init" else (":" if "+" in m else "-")}


def _figure(panels: int, title: str, failed: dict):
    """Axes for ``panels`` panels and one more column, without axes, holding the legend and the failures."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, panels + 1, figsize=(4.4 * panels + 3.2, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3] * panels + [2.2]})
    side = axes[0][-1]
    side.axis("off")
    if failed:
        side.text(0, 0.02, "failed (no curve):\n" + "\n".join(f"{label(m)} ({len(v)} seed(s))" for m, v in failed.items()),
                  fontsize=7, va="bottom", color="firebrick", transform=side.transAxes)
    fig.suptitle(title, fontsize=9)
    return fig, list(axes[0][:-1]), side


def _legend(ax, side) -> None:
    handles, labels = ax.get_legend_handles_labels()
    side.legend(handles, labels, loc="upper left", fontsize=7, frameon=False)


def plot_probing(result: dict, path) -> None:
    """Figure 3: seed-mean D_H test accuracy of the paper's probe per epoch, band = min..max over seeds."""
    fig, (ax,), side = _figure(1, f"Linear probing on D_H (full-batch GD, step 1/L): {result['model_text']}, "
                               f"{result['data']}, {len(result['seeds'])} seed(s), band min–max", _failures(result))
    for m, r in result["rows"].items():
        c = r["probe_curve"]
        line, = ax.plot(range(len(c["mean"])), c["mean"], label=label(m), **_style(m))
        if len(r["seeds"]) > 1:
            ax.fill_between(range(len(c["mean"])), c["min"], c["max"], color=line.get_color(), alpha=0.12, lw=0)
    ax.set(xlabel="probing epoch", ylabel="D_H test accuracy (%)  ↓ better")
    ax.grid(alpha=0.3)
    _legend(ax, side)
    save_figure(fig, path)


def plot_attacks(result: dict, path) -> None:
    """One panel per attacker: seed-mean D_H test accuracy per epoch, band = min..max over seeds. Curves
    scored at a few epochs only (fine-tuning) are drawn as markers at those epochs, not joined by lines."""
    rows = result["rows"]
    attackers = [a for a in ATTACKER_LABELS if any(a in r["attacks"] for r in rows.values())]
    fig, axes, side = _figure(len(attackers), f"Attackers on D_H: {result['model_text']}, {result['data']}, "
                              f"{len(result['seeds'])} seed(s), band min–max", _failures(result))
    for ax, a in zip(axes, attackers):
        for m, r in rows.items():
            if a not in r["attacks"]:
                continue
            c = {k: np.asarray(v, dtype=float) for k, v in r["attacks"][a]["curve"].items()}
            x = np.flatnonzero(np.isfinite(c["mean"]))
            sparse = len(x) < len(c["mean"])
            style = {**_style(m), **({"ls": "none", "marker": "o", "ms": 4} if sparse else {})}
            line, = ax.plot(x, c["mean"][x], label=label(m), **style)
            if len(r["seeds"]) > 1:
                if sparse:
                    ax.vlines(x, c["min"][x], c["max"][x], color=line.get_color(), alpha=0.4, lw=2)
                else:
                    ax.fill_between(x, c["min"][x], c["max"][x], color=line.get_color(), alpha=0.12, lw=0)
        ax.set_title(ATTACKER_LABELS[a], fontsize=8)
        ax.set_xlabel("epoch" + (" (scored at the marked epochs)" if a == "finetune" else ""))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("D_H test accuracy (%)  ↓ better")
    _legend(axes[0], side)
    save_figure(fig, path)


# --- the (i)/(ii) trade-off -------------------------------------------------------------------

def _points(result: dict, method: str, variant: str):
    """Seed means of each sweep point of ``variant``: [(b, b_ill, mean dict or None, seeds)]."""
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


def _variants(result: dict, m: str) -> list:
    return sorted({v for per in result["runs"][m].values() for p in per for v in p if v != "seed"},
                  key=lambda v: ("+" in v, v))


TRADEOFF_COLS = ("harmful_ratio", "pretrain_ratio", "rir_theta0", "dp_top1", "probe_acc_epoch10", "adam_acc_epoch1",
                 "adam_acc_epoch5", "adam_whitened_acc_epoch1", "adam_whitened_acc_epoch5")


def tradeoff_markdown(result: dict) -> str:
    """One line per (row, b, b_ill): seed means of (i), (ii), Def. 3.1, D_P top-1 and the probes; θ₀ first."""
    t0, n, c = list(result["theta0"].values()), len(result["seeds"]), TRADEOFF_COLS
    lines = [f"# (i)/(ii) trade-off: {result['model_text']} on {result['data']} (seeds {result['seeds']}, "
             f"{result['threads']} threads; seed means)", "",
             "| row | b | b_ill | (i) ↑ | (ii) ↓ | RIR_θ₀ | Def. 3.1 | D_P top-1 % | GD @10 ↓ | Adam @1 ↓ | Adam @5 ↓ "
             "| whitened Adam @1 ↓ | @5 ↓ |", "|" + "---|" * 13,
             f"| {METHOD_LABELS['init']} | | | 1 | 1 | 1 | 0/{n} | "
             + " | ".join(fmt(float(np.mean([v.get(k, np.nan) for v in t0])), 3) for k in c[3:]) + " |"]
    for m in result["methods"]:
        for v in _variants(result, m):
            for b, bi, mean, count in _points(result, m, v):
                head = f"| {label(v)} | {b:g} | {'' if bi is None else f'{bi:g}'} | "
                lines.append(head + ("diverged |" + " |" * 9 if mean is None else
                                     " | ".join(fmt(mean.get(k, np.nan), 4) for k in c[:3])
                                     + f" | {mean['immunized']}/{count} | "
                                     + " | ".join(fmt(mean.get(k, np.nan), 3) for k in c[3:]) + " |"))
    return "\n".join(lines) + "\n"


def plot_tradeoff(result: dict, path) -> None:
    """Left: (i) against (ii) per sweep point (seed means, log axes; Definition 3.1 is the quadrant (i) > 1,
    (ii) < 1). Middle and right: D_P top-1 and the Adam probe at epoch 5 against (i), θ₀ dashed."""
    fig, axes, side = _figure(3, f"(i)/(ii) trade-off: {result['model_text']}, {result['data']}, "
                              f"{len(result['seeds'])} seed(s); labels b / b_ill", {})
    for m in result["methods"]:
        for v in _variants(result, m):
            pts = [p for p in _points(result, m, v) if p[2] is not None]
            if not pts:
                continue
            x = [p[2]["harmful_ratio"] for p in pts]
            kw = {"marker": "s" if "+" in v else "o", "ls": "none", "label": label(v)}
            line, = axes[0].plot(x, [p[2]["pretrain_ratio"] for p in pts], **kw)
            kw["color"] = line.get_color()
            for ax, k in ((axes[1], "dp_top1"), (axes[2], "adam_acc_epoch5")):
                ax.plot(x, [p[2].get(k, np.nan) for p in pts], **{**kw, "label": None})
            for p, xi in zip(pts, x):
                axes[0].annotate(f"{p[0]:g}" + (f"/{p[1]:g}" if p[1] is not None else ""), (xi, p[2]["pretrain_ratio"]),
                                 fontsize=6, alpha=0.7)
    axes[0].axvline(1, color="k", lw=0.8)
    axes[0].axhline(1, color="k", lw=0.8)
    axes[0].set(xscale="log", yscale="log", xlabel="(i) κ ratio on D_H ↑", ylabel="(ii) κ ratio on D_P ↓")
    t0 = list(result["theta0"].values())
    for ax, k, ylab in ((axes[1], "dp_top1", "D_P top-1 %"), (axes[2], "adam_acc_epoch5", "Adam probe @5, D_H %")):
        ax.axhline(float(np.mean([v.get(k, np.nan) for v in t0])), color="k", ls="--", lw=1, label="θ₀" if k == "dp_top1" else None)
        ax.set(xscale="log", xlabel="(i) κ ratio on D_H ↑", ylabel=ylab)
    for ax in axes:
        ax.grid(alpha=0.3)
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    side.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=7, frameon=False)
    save_figure(fig, path)
