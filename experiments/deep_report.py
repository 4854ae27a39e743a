"""Tables and figures of the deep-net experiments from experiments/deep_pipeline.py's results
(nothing here computes a metric). Figures keep the legend beside the axes, name the data and the
model in their title and a method that failed; attackers scored at a few epochs are markers at
those epochs."""

from __future__ import annotations

import numpy as np

from pycore.report import METHOD_LABELS, fmt, pm, save_figure

HARDENING_LABELS = {"rotate": "rotated", "label_subspace": "label-subspace hardened"}
ATTACKER_LABELS = {
    "gd": "linear probe, GD step 1/L (paper)",
    "adam": "linear probe, Adam (best lr × {scaled, standardised})",
    "adam_whitened": "linear probe, Adam on whitened features (adaptive)",
    "finetune": "fine-tune last stage + layer + new head, Adam",
}
SHORT = {"gd": "GD 1/L", "adam": "Adam", "adam_whitened": "whitened Adam", "finetune": "fine-tune"}


def label(key: str) -> str:
    """Label of a row key ``<method>[@<b>[/<b_ill>]][+<hardening>]``."""
    row, _, kind = key.partition("+")
    method, _, point = row.partition("@")
    text = METHOD_LABELS.get(method, method) + (f", b = {point}" if point else "")
    return f"{text}, {HARDENING_LABELS.get(kind, kind)}" if kind else text


def _bold(key: str) -> str:
    return f"**{label(key)}**" if key.startswith("ours") else label(key)


def _failures(result: dict) -> dict:
    out = {}
    for seed, errs in result["errors"].items():
        for m, e in errs.items():
            out.setdefault(m, []).append(f"seed {seed[4:]}: {e['message']}")
    return out


def _delta(result: dict, key: str, get) -> str:
    """``get(row) − get(θ₀'s row)`` per seed, mean ± std over the seeds that have both."""
    per = [
        get(s["rows"][key]) - get(s["rows"]["init"])
        for s in result["per_seed"]
        if key in s["rows"]
    ]
    return f"{np.mean(per):+.1f} ± {np.std(per):.1f}" if per else ""


def table_markdown(result: dict, paper: "dict | None" = None) -> str:
    """Table 3's layout (beside the paper's numbers when given; failed runs listed), the (i)
    decomposition, each attacker after each scored epoch, and every row minus θ₀ seed by seed."""
    rows, rc, n = result["rows"], result["run_config"], len(result["seeds"])
    p_cols = " paper RIR_θ₀ | paper D_P % |" if paper else ""
    lines = [
        f"# Deep-net immunization: {result['config']} — {result['model_text']} on "
        f"{result['data']}",
        "",
        f"Immunized: {result['scope']}; seeds {result['seeds']}; {result['threads']} "
        "threads. Mean ± "
        f"std over seeds; per seed RIR_θ₀ against θ₀ is the mean over {rc['rir_groups']} "
        "groups of "
        f"{rc['rir_group_size']} samples; D_P top-1 on D_P's validation split; Def. 3.1: "
        "seeds with "
        "(i) > 1 and (ii) < 1.",
        "",
        "| method | (i) κ ratio on D_H ↑ | (ii) κ ratio on D_P ↓ | RIR_θ₀ ↑ | Def. 3.1 "
        "| D_P top-1 % | "
        f"GD probe on D_H, epoch 10 ↓ | epoch {rc['probe_epochs']} ↓ |{p_cols}",
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if paper else ""),
    ]
    lines += [f"| {label(m)} | failed: {'; '.join(f)} |" for m, f in _failures(result).items()]
    for m, r in rows.items():
        p = (paper or {}).get(m)
        lines.append(
            f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | "
            f"{pm(r['rir_theta0'])} | {r['immunized_count']}/{n} | {pm(r['dp_top1'])} | "
            f"{pm(r['probe_acc_epoch10'])} | {pm(r['probe_acc_last'])} |"
            + ((f" {p[2]} | {p[3]} |" if p else " | |") if paper else "")
        )
    lines += [
        "",
        "(i) decomposed: the largest and the smallest nonzero eigenvalue of H_H relative to its "
        "median, each divided by θ₀'s (geometric means over the RIR groups; their quotient is the "
        "groups' κ ratio).",
        "",
        "| method | (i) ↑ | top ratio | bottom ratio |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['harmful_top_ratio'])} | "
        f"{pm(r['harmful_bottom_ratio'])} |"
        for m, r in rows.items()
    ]
    epochs = rc["attack_epochs"]
    attackers = [a for a in ATTACKER_LABELS if any(a in r["attacks"] for r in rows.values())]
    lines += [
        "",
        f"D_H test accuracy (%) after {' / '.join(map(str, epochs))} epochs (↓ = harder for the "
        "attacker; mean over seeds):",
        "",
        "| method | " + " | ".join(ATTACKER_LABELS[a] for a in attackers) + " |",
        "|---|" + "---|" * len(attackers),
    ]
    at = lambda r, a: " / ".join(fmt(r["attacks"][a][f"epoch{e}"]["mean"], 3) for e in epochs)  # noqa: E731
    lines += [
        f"| {_bold(m)} | "
        + " | ".join(at(r, a) if a in r["attacks"] else "" for a in attackers)
        + " |"
        for m, r in rows.items()
    ]
    cols = [("D_P top-1", lambda r: r["dp_top1"]), ("GD @10", lambda r: r["probe_acc_epoch10"])]
    cols += [
        (f"{SHORT[a]} @{e}", lambda r, a=a, e=e: r["attacks"][a][e])
        for a in attackers[1:]
        for e in (1, 5)
        if e in epochs
    ]
    lines += [
        "",
        "Each row minus θ₀ on the same seed (mean ± std over seeds; attacker columns: D_H test "
        "accuracy, negative = slower than on θ₀):",
        "",
        "| method | Def. 3.1 | " + " | ".join(c for c, _ in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    deltas = lambda m: " | ".join(_delta(result, m, g) for _, g in cols)  # noqa: E731
    lines += [
        f"| {_bold(m)} | {r['immunized_count']}/{n} | {deltas(m)} |"
        for m, r in rows.items()
        if m != "init"
    ]
    return "\n".join(lines) + "\n"


def _figure(result: dict, panels: int, what: str):
    """``panels`` axes and a last column without axes for the legend and the failed methods."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(
        1,
        panels + 1,
        figsize=(4.4 * panels + 3.2, 4.2),
        squeeze=False,
        gridspec_kw={"width_ratios": [3] * panels + [2.2]},
    )
    side = axes[0][-1]
    side.axis("off")
    if failed := _failures(result):
        text = "\n".join(f"{label(m)} ({len(v)} seed(s))" for m, v in failed.items())
        side.text(
            0,
            0.02,
            "failed (no curve):\n" + text,
            fontsize=7,
            va="bottom",
            color="firebrick",
            transform=side.transAxes,
        )
    fig.suptitle(
        f"{what}: {result['model_text']}, {result['data']}, {len(result['seeds'])} seed(s), band "
        "min–max",
        fontsize=9,
    )
    return fig, list(axes[0][:-1]), side


def _finish(fig, axes, side, path) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    side.legend(list(handles.values()), list(handles), loc="upper left", fontsize=7, frameon=False)
    save_figure(fig, path)


def _style(m: str) -> dict:
    base = m.split("+")[0]
    return {
        "lw": 2.2 if base in ("ours", "init") else 1.3,
        "ls": "--" if base == "init" else (":" if "+" in m else "-"),
    }


def plot_probing(result: dict, path) -> None:
    """Figure 3: seed-mean D_H test accuracy of the paper's probe per epoch, band = min..max
    over seeds."""
    fig, (ax,), side = _figure(result, 1, "Linear probing on D_H (full-batch GD, step 1/L)")
    for m, r in result["rows"].items():
        c = r["probe_curve"]
        (line,) = ax.plot(range(len(c["mean"])), c["mean"], label=label(m), **_style(m))
        if len(r["seeds"]) > 1:
            ax.fill_between(
                range(len(c["mean"])), c["min"], c["max"], color=line.get_color(), alpha=0.12, lw=0
            )
    ax.set(xlabel="probing epoch", ylabel="D_H test accuracy (%)  ↓ better")
    _finish(fig, [ax], side, path)


def plot_attacks(result: dict, path) -> None:
    """One panel per attacker: seed-mean D_H test accuracy per epoch, band (or bar) = min..max
    over seeds."""
    rows = result["rows"]
    attackers = [a for a in ATTACKER_LABELS if any(a in r["attacks"] for r in rows.values())]
    fig, axes, side = _figure(result, len(attackers), "Attackers on D_H")
    for ax, a in zip(axes, attackers):
        for m, r in ((m, r) for m, r in rows.items() if a in r["attacks"]):
            c = {k: np.asarray(v, dtype=float) for k, v in r["attacks"][a]["curve"].items()}
            x = np.flatnonzero(np.isfinite(c["mean"]))
            sparse = len(x) < len(c["mean"])  # scored at a few epochs: no line between them
            style = {**_style(m), **({"ls": "none", "marker": "o"} if sparse else {})}
            (line,) = ax.plot(x, c["mean"][x], label=label(m), **style)
            if len(r["seeds"]) > 1 and sparse:
                ax.vlines(x, c["min"][x], c["max"][x], color=line.get_color(), alpha=0.4, lw=2)
            elif len(r["seeds"]) > 1:
                ax.fill_between(
                    x, c["min"][x], c["max"][x], color=line.get_color(), alpha=0.12, lw=0
                )
        ax.set_title(ATTACKER_LABELS[a], fontsize=8)
        ax.set_xlabel("epoch" + (" (scored at the marked epochs)" if a == "finetune" else ""))
    axes[0].set_ylabel("D_H test accuracy (%)  ↓ better")
    _finish(fig, axes, side, path)


def plot_tradeoff(result: dict, path) -> None:
    """The balance sweep: (i) against (ii) and D_P top-1 against (i), seed means, one marker per
    row (θ₀ at (1, 1)); Definition 3.1 holds right of (i) = 1 and below (ii) = 1."""
    fig, axes, side = _figure(result, 2, "(i)/(ii) trade-off over the balance b / b_ill")
    for m, r in result["rows"].items():
        kw = {"marker": "s" if "+" in m else "o", "ls": "none", "label": label(m)}
        (line,) = axes[0].plot(r["harmful_ratio"]["mean"], r["pretrain_ratio"]["mean"], **kw)
        axes[1].plot(
            r["harmful_ratio"]["mean"], r["dp_top1"]["mean"], **{**kw, "color": line.get_color()}
        )
    for v in (axes[0].axvline, axes[0].axhline):
        v(1, color="k", lw=0.8)
    axes[0].set(
        xscale="log", yscale="log", xlabel="(i) κ ratio on D_H ↑", ylabel="(ii) κ ratio on D_P ↓"
    )
    axes[1].set(xscale="log", xlabel="(i) κ ratio on D_H ↑", ylabel="D_P top-1 %")
    _finish(fig, axes, side, path)
