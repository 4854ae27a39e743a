"""Tables and figures of the deep-net experiments from experiments/deep_pipeline.py's results
(nothing here computes a metric). Figures keep the legend beside the axes, name the data and the
model in their title and a method that failed; attackers scored at a few epochs are markers at
those epochs."""

from __future__ import annotations

import numpy as np

from pycore.report import METHOD_LABELS, fmt, pm, save_figure

HARDENING_LABELS = {"rotate": "rotated", "label_subspace": "label-subspace hardened"}
DEEP_LABELS = {"closed_form": "Closed-form layer (theory §10)"}
OPERATOR_LABELS = {
    "gd": "linear probe, GD step 1/L (paper)",
    "adam": "linear probe, Adam (lr × {scaled, standardised})",
    "adam_whitened": "linear probe, Adam on whitened features",
    "finetune_upper": "fine-tune last stage + layer + new head",
    "finetune_full": "fine-tune the whole network + new head",
}
SHORT = {
    "gd": "GD 1/L",
    "adam": "Adam",
    "adam_whitened": "whitened",
    "finetune_upper": "FT upper",
    "finetune_full": "FT full",
}


def operator_label(op: str, short: bool = False) -> str:
    """``lora_r8`` → "LoRA r = 8" (every other operator by its table)."""
    if op.startswith("lora_r"):
        return f"LoRA r{op[6:]}" if short else f"LoRA rank {op[6:]} (peft) + new head"
    return (SHORT if short else OPERATOR_LABELS).get(op, op)


def label(key: str) -> str:
    """Label of a row key ``<method>[@<b>[/<b_ill>]][+<hardening>]``."""
    row, _, kind = key.partition("+")
    method, _, point = row.partition("@")
    text = DEEP_LABELS.get(method, METHOD_LABELS.get(method, method))
    text += f", b = {point}" if point else ""
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


def _signed(summary: dict, scale: float = 1.0, digits: int = 1) -> str:
    m, sd = summary["mean"] * scale, summary["std"] * scale
    return f"{m:+.{digits}f} ± {sd:.{digits}f}"


def _worst(r: dict) -> str:
    """The worst operator of a row: the one most seeds name, its signed deficit over seeds."""
    names = r["worst"]
    top = max(dict.fromkeys(names), key=names.count)
    n = f" ({names.count(top)}/{len(names)} seeds)" if len(names) > 1 else ""
    return f"{_signed(r['worst_deficit'])} ({operator_label(top, True)}{n})"


def table_markdown(result: dict, paper: "dict | None" = None) -> str:
    """Table 3's layout (beside the paper's numbers when given; failed runs listed) with (i),
    (ii) on the whole pools and by the paper's groups, the closed form's window per seed, the (i)
    decomposition, the operator-transfer matrix (signed deficit, signed RFD, RFD, worst case) and
    each operator's D_H accuracy at each scored epoch."""
    rows, rc, n = result["rows"], result["run_config"], len(result["seeds"])
    p_cols = " paper RIR_θ₀ | paper D_P % |" if paper else ""
    pool = "all" if rc["rir_pool"] is None else str(rc["rir_pool"])
    # the GD probe's columns: epochs it was run to (10, or fewer, and its last)
    probe = sorted({min(10, rc["probe_epochs"]), rc["probe_epochs"]})
    probe_keys = ["probe_acc_epoch10", "probe_acc_last"][-len(probe) :]
    lines = [
        f"# Deep-net immunization: {result['config']} — {result['model_text']} on "
        f"{result['data']}",
        "",
        f"Immunized: {result['scope']}; seeds {result['seeds']}; {result['threads']} threads. "
        f"Mean ± std over seeds. (i), (ii), RIR_θ₀ and Def. 3.1 ((i) > 1 and (ii) < 1): exact κ's "
        f"of the features of the pools ({pool} training rows per task), the linear problem the "
        f"layer is; 'groups': the paper's protocol, means over {rc['rir_groups']} groups of "
        f"{rc['rir_group_size']} rows of the same pools. D_P top-1 on D_P's validation split.",
        "",
        "| method | (i) κ ratio on D_H ↑ | (ii) κ ratio on D_P ↓ | RIR_θ₀ ↑ | Def. 3.1 "
        "| groups (i) | groups (ii) | groups Def. 3.1 | D_P top-1 % | "
        + " | ".join(f"GD probe on D_H, epoch {e} ↓" for e in probe)
        + f" |{p_cols}",
        "|---|---|---|---|---|---|---|---|---|"
        + "---|" * len(probe)
        + ("---|---|" if paper else ""),
    ]
    lines += [f"| {label(m)} | failed: {'; '.join(f)} |" for m, f in _failures(result).items()]
    for m, r in rows.items():
        p = (paper or {}).get(m)
        lines.append(
            f"| {_bold(m)} | {pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | "
            f"{pm(r['rir_theta0'])} | {r['immunized_count']}/{n} | "
            f"{pm(r['groups_harmful_ratio'])} | {pm(r['groups_pretrain_ratio'])} | "
            f"{r['immunized_groups_count']}/{n} | {pm(r['dp_top1'])} | "
            + " | ".join(pm(r[k]) for k in probe_keys)
            + " |"
            + ((f" {p[2]} | {p[3]} |" if p else " | |") if paper else "")
        )
    windows = [s.get("attainability") for s in result["per_seed"] if s.get("attainability")]
    if windows:
        lines += [
            "",
            "What any θ of the layer can do on θ₀'s pool features (docs/theory.md §10): the "
            "range-restricted RIR ceiling and the closed form's Definition 3.1 window of "
            "exponents (empty: no linear layer meets Definition 3.1 on these features).",
            "",
            "| seed | RIR ceiling | window | |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {s['seed']} | {fmt(w['ceiling'])} | "
            + (
                "κ(C) = 1"
                if w["window"] is None
                else f"[{fmt(w['window']['low'])}, {fmt(w['window']['high'])})"
                + (" empty" if w["window"]["empty"] else "")
            )
            + f" | {w['why']} |"
            for s, w in zip(result["per_seed"], windows)
        ]
    lines += [
        "",
        "(i) decomposed: the largest and the smallest nonzero eigenvalue of H_H relative to its "
        "median, each divided by θ₀'s (geometric means over the groups; their quotient is the "
        "groups' κ ratio).",
        "",
        "| method | groups (i) ↑ | top ratio | bottom ratio |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {_bold(m)} | {pm(r['groups_harmful_ratio'])} | {pm(r['harmful_top_ratio'])} | "
        f"{pm(r['harmful_bottom_ratio'])} |"
        for m, r in rows.items()
    ]
    ops = list(next(iter(rows.values()))["operators"]) if rows else []
    epochs = rc["attack_epochs"]
    head = "| method | " + " | ".join(operator_label(o, True) for o in ops)
    rule = "|---|" + "---|" * len(ops)
    grid = _grids(result)
    lines += [
        "",
        "Operator-transfer matrix: the signed deficit, D_H test accuracy of the operator on θ₀ "
        f"minus on the row's model, in points, averaged over epochs {', '.join(map(str, epochs))} "
        "(> 0: the defense slowed that attacker; < 0: it helped). Worst case: the operator of "
        "highest accuracy against the row's model, and its deficit. Each operator trains on "
        f"{rc['attack_train']} D_H images at the best setting on {rc['attack_val']} more "
        f"(its validation split): {grid}.",
        "",
        head + " | worst case |",
        rule + "---|",
    ]
    lines += [
        f"| {_bold(m)} | "
        + " | ".join(_signed(r["operators"][o]["mean_deficit"]) for o in ops)
        + f" | {_worst(r)} |"
        for m, r in rows.items()
        if m != "init"
    ]
    lines += [
        "",
        "Signed relative deficit (%): per epoch (θ₀ − model)/θ₀, averaged over the epochs (RFD "
        "without the absolute value); RFD (with it) in brackets.",
        "",
        head + " |",
        rule,
    ]
    lines += [
        f"| {_bold(m)} | "
        + " | ".join(
            f"{_signed(r['operators'][o]['signed_rfd'], 100)} "
            f"[{r['operators'][o]['rfd']['mean'] * 100:.1f}]"
            for o in ops
        )
        + " |"
        for m, r in rows.items()
        if m != "init"
    ]
    lines += [
        "",
        f"D_H test accuracy (%) of each operator after epochs {' / '.join(map(str, epochs))} "
        "(mean over seeds; ↓ = harder for the attacker):",
        "",
        head + " |",
        rule,
    ]
    at = lambda c: " / ".join(fmt(v, 3) for v in c["mean"])  # noqa: E731
    lines += [
        f"| {_bold(m)} | " + " | ".join(at(r["operators"][o]["model"]) for o in ops) + " |"
        for m, r in rows.items()
    ]
    lines += [
        "",
        "Each row minus θ₀ on the same seed (mean ± std over seeds):",
        "",
        f"| method | Def. 3.1 | D_P top-1 | GD probe @{probe[0]} |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {_bold(m)} | {r['immunized_count']}/{n} | "
        f"{_delta(result, m, lambda r: r['dp_top1'])} | "
        f"{_delta(result, m, lambda r: r[probe_keys[0]])} |"
        for m, r in rows.items()
        if m != "init"
    ]
    return "\n".join(lines) + "\n"


def _grids(result: dict) -> str:
    """Each operator's grid as run (from the first row of the first seed)."""
    seed = result["per_seed"][0]["rows"]
    first = next(iter(seed.values()))["operators"]
    return "; ".join(
        f"{operator_label(o, True)} {{{', '.join(k for k, _ in c['grid'])}}}"
        for o, c in first.items()
    )


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


def plot_operators(result: dict, path) -> None:
    """One panel per operator: the best-so-far D_H test accuracy of each row per scored epoch
    (the attacker keeps its best epoch), seed means, bars min..max over seeds."""
    rows = result["rows"]
    ops = list(next(iter(rows.values()))["operators"]) if rows else []
    fig, axes, side = _figure(result, len(ops), "Operators on D_H (best so far)")
    for ax, op in zip(axes, ops):
        for m, r in rows.items():
            c, x = r["operators"][op]["best_so_far_model"], r["operators"][op]["epochs"]
            (line,) = ax.plot(x, c["mean"], marker="o", label=label(m), **_style(m))
            if len(r["seeds"]) > 1:
                ax.vlines(x, c["min"], c["max"], color=line.get_color(), alpha=0.4, lw=2)
        ax.set_title(operator_label(op), fontsize=8)
        ax.set_xlabel("epoch")
    if axes:
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
