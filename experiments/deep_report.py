"""Tables and figures of the deep-net experiments from experiments/deep_pipeline.py's results
(nothing here computes a metric). The tables lead with whether each row slows each attacker:
the worst-case slowdown over operators, per seed, beside Definition 3.1 (docs/findings.md §7)."""

from __future__ import annotations

import math

import numpy as np

from pycore.report import METHOD_LABELS, fmt, pm, save_figure

OPERATOR_LABELS = {
    "gd": "linear probe, GD step 1/L (paper)",
    "adam": "linear probe, Adam (lr × {scaled, standardised})",
    "adam_whitened": "linear probe, Adam on whitened features",
    "remove_layer": "layer removed, then the Adam probe",
    "finetune_upper": "fine-tune last stage + layer + new head",
    "finetune_full": "fine-tune the whole network + new head",
    "retrain_tail": "changed stages re-initialised and retrained + new head",
}
SHORT = {
    "gd": "GD 1/L",
    "adam": "Adam",
    "adam_whitened": "whitened",
    "remove_layer": "layer removed",
    "finetune_upper": "FT upper",
    "finetune_full": "FT full",
    "retrain_tail": "retrain",
}


def operator_label(op: str, short: bool = False) -> str:
    """``lora_r8`` → "LoRA r8" (every other operator by its table)."""
    if op.startswith("lora_r"):
        return f"LoRA r{op[6:]}" if short else f"LoRA rank {op[6:]} (peft) + new head"
    return (SHORT if short else OPERATOR_LABELS).get(op, op)


def label(result: dict, key: str) -> str:
    """The row's label from the run's configuration (its method's otherwise)."""
    if key == "init":
        return "Init. θ₀"
    for r in result["run_config"]["rows"]:
        if r["name"] == key and r["label"]:
            return r["label"]
    return METHOD_LABELS.get(key, key)


def _slow(x: float | None, censored: bool | None, cap: float) -> str:
    if x is None:
        return "—"
    return f"≥{fmt(cap, 3)}" if censored else fmt(x, 3)


def _per_seed(op: dict, cap: float) -> str:
    """``a / b / c`` per seed."""
    return " / ".join(_slow(x, c, cap) for x, c in zip(op["slowdown"], op["censored"]))


def _failures(result: dict) -> dict:
    out = {}
    for seed, errs in result["errors"].items():
        for m, e in errs.items():
            out.setdefault(m, []).append(f"seed {seed[4:]}: {e['message']}")
    return out


def _operators(result: dict, key: str = "operators") -> list[str]:
    seen = []
    for r in result["rows"].values():
        src = r[key] if key == "operators" else r[key].get("operators", {})
        seen += [o for o in src if o not in seen]
    return seen


def _images(result: dict) -> dict:
    """The images of each split as run (the first seed's ``images``; the configuration's nominal
    sizes for a results.json without them), the defense's as words, and the groups' size as
    used (capped at the defense's rows)."""
    rc = result["run_config"]
    z = {**rc["sizes"], "more_train": rc["sizes"]["more_data"] * rc["sizes"]["attack_train"]}
    first = result["per_seed"][0] if result.get("per_seed") else {}
    z.update({k: v for k, v in first.get("images", {}).items() if v is not None})
    p, h = z.get("defense_p", z["defense"]), z.get("defense_h", z["defense"])
    z["defense"] = f"{p} per task" if p == h else f"{p} of D_P, {h} of D_H"
    z["group_size"] = first.get("theta0", {}).get("grouped", {}).get("group_size")
    z["group_size"] = z["group_size"] or rc["rir_group_size"]
    return z


def table_markdown(result: dict, paper: dict | None = None) -> str:
    """The headline (whether each row slows each attacker, beside Definition 3.1), the slowdown
    matrix per seed, the deficits at θ₀'s budget, θ₀'s budgets, the attacker with more images,
    the D_P fine-tuning check, Table 3's κ columns (with the paper's numbers when given), the
    layer's attainable window and where (i) comes from."""
    rows, rc, n = result["rows"], result["run_config"], len(result["seeds"])
    cap = result["slowdown_cap"]
    z, sch = _images(result), rc["schedule"]
    rows_ = {k: r for k, r in rows.items() if k != "init"}
    ops = _operators(result)
    lines = [
        f"# Deep-net immunization: {result['config']} — {result['model_text']} on "
        f"{result['data']}",
        "",
        f"Seeds {result['seeds']}; {result['threads']} thread(s). The attacker's D_H images "
        f"({z['attack_train']} to train on, {z['attack_val']} to watch, {z['attack_test']} to be "
        "scored on) are disjoint from every image the defense saw. **Slowdown**: the steps an "
        "operator needs to reach 90 % of θ₀'s gain over chance, over the steps it needs on θ₀, "
        f"its learning-rate grid widened per model until the best rate is inside it; ≥{fmt(cap)}: "
        "censored (it never got there within that many times θ₀'s steps). The worst case of a "
        "row is its smallest slowdown over operators: the attacker's best way around it.",
        "",
    ]
    lines += [
        f"- {label(result, m)}: failed: {'; '.join(f)}" for m, f in _failures(result).items()
    ]
    lines += [
        "| row | worst-case slowdown per seed (operator) | worst case, min over seeds | Def. 3.1 "
        "| (i) ↑ | (ii) ↓ | D_P top-1 − θ₀ | D_P fine-tuning slowdown (max) | GD probe @10 − θ₀ "
        "(points) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in rows_.items():
        w = r["worst_slowdown"]
        per = (
            " / ".join(
                f"{_slow(x, c, cap)} ({operator_label(o, True)})"
                for x, c, o in zip(w["per_seed"], w["censored"], w["operator"])
            )
            if w
            else "—"
        )
        low = (
            _slow(
                w["min"],
                all(c for x, c in zip(w["per_seed"], w["censored"]) if x == w["min"]),
                cap,
            )
            if w
            else "—"
        )
        dp = r["dp_finetune_slowdown"]
        dps = _slow(dp["max"], False, cap) if dp["per_seed"] else "—"
        probe = next((k for k in r if k.startswith("probe_epoch10_delta")), None)
        lines.append(
            f"| {label(result, m)} | {per} | {low} | {r['immunized_count']}/{n} | "
            f"{pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | "
            f"{_signed(r['dp_top1_delta'])} | {dps} | "
            f"{_signed(r[probe]) if probe else '—'} |"
        )
    head = "| row | " + " | ".join(operator_label(o, True) for o in ops) + " |"
    rule = "|---|" + "---|" * len(ops)
    lines += [
        "",
        "Slowdown per operator, per seed (a / b / c); < 1: the defense helped the attacker.",
        "",
        head,
        rule,
    ]
    for m, r in rows_.items():
        cells = [_per_seed(r["operators"][o], cap) if o in r["operators"] else "—" for o in ops]
        lines.append(f"| {label(result, m)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Signed deficit at θ₀'s budget B₀: θ₀'s D_H test accuracy at B₀ minus the model's "
        "(points, mean ± std over seeds; > 0: the defense slowed the attacker).",
        "",
        head,
        rule,
    ]
    for m, r in rows_.items():
        cells = [
            _signed(r["operators"][o]["deficit"]) if o in r["operators"] else "—" for o in ops
        ]
        lines.append(f"| {label(result, m)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "θ₀'s budget per operator: its plateau on the validation split (%, a trailing mean of 3 "
        "evaluations), chance, B₀ (the first step within 1 point of the plateau), s₀ (θ₀'s steps "
        "to the target, 90 % of the plateau's gain over chance), θ₀'s test accuracy at B₀ and its "
        "best setting per seed; the plateau confirmed by a run of 3·B₀ steps (seeds), the best "
        "rate at an end of the widened grid (seeds).",
    ]
    lines += _budget_lines(result["budgets"], "D_H", z, sch)
    if result.get("more_budgets"):
        more = _operators(result, "more_data")
        seeds = sorted({b["seed"] for v in result["more_budgets"].values() for b in v})
        lines += [
            "",
            f"The attacker with {z['more_data']}× the images ({z['more_train']}"
            f" to train on; seed(s) {seeds}): slowdown per operator.",
            "",
            "| row | " + " | ".join(operator_label(o, True) for o in more) + " | worst case |",
            "|---|" + "---|" * (len(more) + 1),
        ]
        for m, r in rows_.items():
            md = r["more_data"]
            if not md:
                continue
            cells = [
                _per_seed(md["operators"][o], cap) if o in md["operators"] else "—" for o in more
            ]
            w = md["worst_slowdown"]
            lines.append(
                f"| {label(result, m)} | "
                + " | ".join(cells)
                + f" | {_slow(w['min'], False, cap)} |"
            )
        lines += _budget_lines(result["more_budgets"], "D_H with more images", z, sch)
    if result.get("dp_budgets"):
        lines += _budget_lines(
            result["dp_budgets"],
            "Full fine-tuning on fresh D_P images (the deep (ii): D_P must stay as easy to "
            "fine-tune as on θ₀)",
            z,
            sch,
        )
    p_cols = " paper RIR_θ₀ | paper D_P % |" if paper else ""
    lines += [
        "",
        "Table 3's columns: (i), (ii), RIR_θ₀ and Def. 3.1 on exact κ's of the features of the "
        f"defense's rows ({z['defense']}), the linear problem the layer is; 'groups': "
        f"the paper's protocol, means over {rc['rir_groups']} groups of {z['group_size']} "
        "of the same rows. D_P top-1 on D_P's validation split; the GD probe (Figure 3) trains "
        "on the attacker's images.",
        "",
        "| row | (i) ↑ | (ii) ↓ | RIR_θ₀ ↑ | Def. 3.1 | groups (i) | groups (ii) | "
        f"groups Def. 3.1 | D_P top-1 % | GD probe @10 ↓ |{p_cols}",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if paper else ""),
    ]
    for m, r in rows.items():
        p = (paper or {}).get(m)
        probe = next((k for k in r if k.startswith("probe_epoch10") and "delta" not in k), None)
        lines.append(
            f"| {label(result, m)} | {pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | "
            f"{pm(r['rir_theta0'])} | {r['immunized_count']}/{n} | "
            f"{pm(r['groups_harmful_ratio'])} | {pm(r['groups_pretrain_ratio'])} | "
            f"{r['immunized_groups_count']}/{n} | {pm(r['dp_top1'])} | "
            f"{pm(r[probe]) if probe else '—'} |"
            + ((f" {p[2]} | {p[3]} |" if p else " | |") if paper else "")
        )
    windows = [s.get("attainability") for s in result["per_seed"] if s.get("attainability")]
    if windows:
        lines += [
            "",
            "What any θ of the layer can do on θ₀'s features (docs/theory.md §10): the "
            "range-restricted RIR ceiling and the closed form's Definition 3.1 window of "
            "exponents.",
            "",
            "| seed | RIR ceiling | window |",
            "|---|---|---|",
        ]
        lines += [
            f"| {s['seed']} | {fmt(w['ceiling'])} | "
            + (
                "none: " + w["why"]
                if w["window"] is None
                else f"[{fmt(w['window']['low'])}, {fmt(w['window']['high'])})"
                + (" empty" if w["window"]["empty"] else "")
            )
            + " |"
            for s, w in zip(result["per_seed"], windows)
        ]
    lines += [
        "",
        "(i) decomposed: the largest and the smallest nonzero eigenvalue of H_H relative to its "
        "median, each divided by θ₀'s (geometric means over the groups; their quotient is the "
        "groups' κ ratio).",
        "",
        "| row | groups (i) ↑ | top ratio | bottom ratio |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {label(result, m)} | {pm(r['groups_harmful_ratio'])} | {pm(r['harmful_top_ratio'])} "
        f"| {pm(r['harmful_bottom_ratio'])} |"
        for m, r in rows_.items()
    ]
    return "\n".join(lines) + "\n"


def _signed(summary: dict, digits: int = 1) -> str:
    return f"{summary['mean']:+.{digits}f} ± {summary['std']:.{digits}f}"


def _budget_lines(budgets: dict, title: str, z: dict, sch: dict) -> list[str]:
    """θ₀'s budgets over seeds: plateau (validation %), chance, B₀ and s₀ (steps), θ₀'s best
    setting per seed, whether the plateau was confirmed (a run 3·B₀ long) and whether the best
    rate sat at an end of the widened grid."""
    out = [
        "",
        f"{title} (steps: optimizer steps of batches of {sch['batch_size']}, full-batch for GD):",
        "",
        "| operator | plateau % | chance % | B₀ | s₀ | test at B₀ % | setting | confirmed "
        "| at an end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op, per in budgets.items():
        name = "retrain (" + op.split(":", 1)[1] + ")" if op.startswith("retrain_tail:") else op

        def col(k):
            return pm(
                {
                    "mean": float(np.mean([b[k] for b in per])),
                    "std": float(np.std([b[k] for b in per])),
                },
                3,
            )

        out.append(
            f"| {operator_label(name, True)} | {col('plateau')} | {col('chance')} | "
            f"{' / '.join(str(b['budget_steps']) for b in per)} | "
            f"{' / '.join(str(b['reference_steps']) for b in per)} | {col('test_at_budget')} | "
            f"{' / '.join(b['setting'] for b in per)} | "
            f"{sum(b['plateau_reached'] for b in per)}/{len(per)} | "
            f"{sum(b['edge'] for b in per)}/{len(per)} |"
        )
    return out


# ---------------------------------------------------------------------------------- figures


def _figure(result: dict, panels: int, what: str, rows: int = 1):
    """``panels`` axes and a last column without axes for the legend and the failed rows."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cols = math.ceil(panels / rows)
    fig, axes = plt.subplots(
        rows,
        cols + 1,
        figsize=(4.0 * cols + 3.2, 3.8 * rows),
        squeeze=False,
        gridspec_kw={"width_ratios": [3] * cols + [2.2]},
    )
    side = axes[0][-1]
    for r in range(rows):
        axes[r][-1].axis("off")
    flat = [axes[r][c] for r in range(rows) for c in range(cols)]
    for ax in flat[panels:]:
        ax.axis("off")
    if failed := _failures(result):
        text = "\n".join(f"{label(result, m)} ({len(v)} seed(s))" for m, v in failed.items())
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
        f"{what}: {result['model_text']}, {result['data']}, {len(result['seeds'])} seed(s)",
        fontsize=9,
    )
    return fig, flat[:panels], side


def _finish(fig, axes, side, path) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    side.legend(list(handles.values()), list(handles), loc="upper left", fontsize=7, frameon=False)
    save_figure(fig, path)


def _style(m: str) -> dict:
    return {"lw": 2.2 if m in ("ours", "init") else 1.3, "ls": "--" if m == "init" else "-"}


def plot_probing(result: dict, path) -> None:
    """Figure 3: seed-mean D_H test accuracy of the paper's probe per epoch on the attacker's
    images, band = min..max over seeds."""
    fig, (ax,), side = _figure(result, 1, "Linear probing on D_H (full-batch GD, step 1/L)")
    for m, r in result["rows"].items():
        c = r["probe_curve"]
        (line,) = ax.plot(range(len(c["mean"])), c["mean"], label=label(result, m), **_style(m))
        if len(r["seeds"]) > 1:
            ax.fill_between(
                range(len(c["mean"])), c["min"], c["max"], color=line.get_color(), alpha=0.12, lw=0
            )
    ax.set(xlabel="probing epoch", ylabel="D_H test accuracy (%)  ↓ better")
    _finish(fig, [ax], side, path)


def plot_operators(result: dict, path) -> None:
    """One panel per operator: each row's slowdown per seed (markers) and its minimum (bar), on a
    log scale; 1 = as fast as on θ₀, the cap marks a censored run."""
    rows = {k: r for k, r in result["rows"].items() if k != "init"}
    ops = _operators(result)
    cap = result["slowdown_cap"]
    fig, axes, side = _figure(result, len(ops), "Slowdown per operator (≥ cap: censored)", 2)
    for ax, op in zip(axes, ops):
        for i, (m, r) in enumerate(rows.items()):
            o = r["operators"].get(op)
            if not o:
                continue
            ys = [y for y in o["slowdown"] if y is not None]
            bar = ax.bar(i, o["min_slowdown"], color=f"C{i}", alpha=0.35, label=label(result, m))
            ax.plot([i] * len(ys), ys, "o", color=bar.patches[0].get_facecolor()[:3], ms=3)
        ax.axhline(1, color="k", lw=0.8)
        ax.axhline(cap, color="firebrick", lw=0.8, ls=":")
        ax.set(yscale="log", title=operator_label(op), xticks=[])
        ax.title.set_fontsize(8)
    if axes:
        axes[0].set_ylabel("slowdown (×θ₀'s steps)  ↑ slower attacker")
    _finish(fig, axes, side, path)


def plot_frontier(result: dict, path) -> None:
    """Each row's worst-case slowdown (min over seeds) against its D_P top-1 cost (θ₀ − row,
    points): the frontier of a defense over its strength."""
    fig, (ax,), side = _figure(result, 1, "Worst-case slowdown against D_P top-1 cost")
    for m, r in result["rows"].items():
        if m == "init" or not r["worst_slowdown"]:
            continue
        ax.plot(
            -r["dp_top1_delta"]["mean"], r["worst_slowdown"]["min"], "o", label=label(result, m)
        )
    ax.axhline(1, color="k", lw=0.8)
    ax.set(
        yscale="log",
        xlabel="D_P top-1 cost (points)  ← better",
        ylabel="worst-case slowdown  ↑ better",
    )
    _finish(fig, [ax], side, path)
