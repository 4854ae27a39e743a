"""Tables and figures of the deep-net experiments from experiments/deep_pipeline.py's results
(nothing here computes a metric). The tables lead with what each defense is worth to its
attacker: the attacker's cheapest path in FLOPs on the defended model against θ₀'s, beside the
ceiling of training from scratch and Definition 3.1 (docs/theory.md §12, docs/findings.md §7)."""

from __future__ import annotations

import math

from pycore.report import METHOD_LABELS, fmt, pm, save_figure

OPERATOR_LABELS = {
    "gd": "linear probe, GD step 1/L (paper)",
    "adam": "linear probe, Adam (lr × {scaled, standardised})",
    "adam_whitened": "linear probe, Adam on whitened features",
    "remove_layer": "layer removed, then the Adam probe",
    "finetune_upper": "fine-tune last stage + layer + new head",
    "finetune_full": "fine-tune the whole network + new head",
    "scratch": "the architecture trained from scratch (ignores the release)",
}
SHORT = {
    "gd": "GD 1/L",
    "adam": "Adam",
    "adam_whitened": "whitened",
    "remove_layer": "layer removed",
    "finetune_upper": "FT upper",
    "finetune_full": "FT full",
    "scratch": "scratch",
}


def operator_label(op: str, short: bool = False) -> str:
    """``lora_r8`` → "LoRA r8", ``retrain_last2`` → "retrain 2" (the others by their tables)."""
    if op.startswith("lora_r"):
        return f"LoRA r{op[6:]}" if short else f"LoRA rank {op[6:]} (peft) + new head"
    if op.startswith("retrain_last"):
        k = op.removeprefix("retrain_last")
        return f"retrain {k}" if short else f"last {k} stage(s) re-initialised and retrained"
    return (SHORT if short else OPERATOR_LABELS).get(op, op)


def label(result: dict, key: str) -> str:
    """The row's label from the run's configuration (its method's otherwise)."""
    if key == "init":
        return "Init. θ₀"
    for r in result["run_config"]["rows"]:
        if r["name"] == key and r["label"]:
            return r["label"]
    return METHOD_LABELS.get(key, key)


def _ratio(x: float | None, lower: bool | None) -> str:
    """A FLOP ratio, ``≥`` for a lower bound, — when undefined."""
    if x is None:
        return "—"
    return ("≥" if lower else "") + fmt(x, 3)


def _flops(x, lower: bool | None = False) -> str:
    # None, or infinity (no cap: no scratch), as results.json holds it (a marked string)
    if not isinstance(x, (int, float)) or math.isinf(x):
        return "—"
    return ("≥" if lower else "") + f"{x:.2g}"


def _share(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}"


def _failures(result: dict) -> dict:
    out = {}
    for seed, errs in result["errors"].items():
        for m, e in errs.items():
            out.setdefault(m, []).append(f"seed {seed[4:]}: {e['message']}")
    return out


def _operators(result: dict, key: str = "judged") -> list[str]:
    seen = []
    for r in result["rows"].values():
        seen += [o for o in (r.get(key) or {}).get("operators", {}) if o not in seen]
    return seen


def _theta0_lines(side: dict, seeds: list, title: str) -> list[str]:
    """θ₀'s side per seed: target, cheapest attacker, scratch, ceiling, cap."""
    if not side:
        return []
    c = side["ceiling"]
    out = [
        "",
        title,
        "",
        "| seed | target % (set by) | cheapest on θ₀ (FLOPs) | scratch FLOPs | ceiling | cap |",
        "|---|---|---|---|---|---|",
    ]
    for i, seed in enumerate(seeds):
        out.append(
            f"| {seed} | {side['target'][i]:.1f} "
            f"({operator_label(side['target_operator'][i], True)})"
            f" | {operator_label(side['cheapest_operator'][i], True)} "
            f"({_flops(side['cheapest_flops'][i])}) | {_flops(side['scratch_flops'][i])} | "
            f"{_ratio(c['per_seed'][i], c['censored'][i])} | {_flops(side['cap'][i])} |"
        )
    out += [
        "",
        "Every operator on θ₀: its plateau (%, the highest level held over two evaluations; "
        "for an operator that does not set the target, the highest its race held), B₀ (the "
        "first step within 1 point of it), whether it was confirmed, its steps and FLOPs to the "
        "target (—: it did not get there within what it was allowed), per seed (a / b / c).",
        "",
        "| operator | plateau % | B₀ | confirmed | steps to target | FLOPs to target | FLOPs "
        "setup + per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, o in side["operators"].items():
        join = lambda xs, f=str: " / ".join("—" if x is None else f(x) for x in xs)  # noqa: E731
        cost = o["cost"][0]
        out.append(
            f"| {operator_label(op, True)} | {join(o['plateau'], lambda x: f'{x:.1f}')} | "
            f"{join(o['budget_steps'])} | {sum(bool(x) for x in o['confirmed'])}/"
            f"{len(o['confirmed'])} | {join(o['steps_to_target'])} | "
            f"{join(o['flops_to_target'], _flops)} | {_flops(cost['setup'])} + "
            f"{_flops(cost['per_step'])} |"
        )
    return out


def _judge_lines(result: dict, rows_: dict, key: str, n: int) -> list[str]:
    """Per row and seed: worth (share of the headroom) [cheapest operator], worth without the
    probes, the retrain bound; then every operator's cost over its cost on θ₀."""
    out = [
        "| row | worth per seed (share of headroom) [cheapest] | worth without probes | "
        "retrain bound | Def. 3.1 | D_P top-1 − θ₀ | D_P fine-tuning slowdown (max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in rows_.items():
        j = r.get(key) or {}
        if not j:
            continue
        w, s = j["worth"], j["headroom_share"]
        # ≤: an operator stopped by its step bound had spent less than the cheapest paid, so
        # the attacker's cheapest cost may be lower (CheapestPath.exact, docs/theory.md §12)
        exact = j.get("exact") or [True] * len(w["per_seed"])
        per = " / ".join(
            f"{'' if e else '≤'}{_ratio(x, c)} ({_share(h)}) [{operator_label(o, True)}]"
            for x, c, h, o, e in zip(
                w["per_seed"], w["censored"], s["per_seed"], j["cheapest_operator"], exact
            )
        )
        wp, rb = j["worth_without_probes"], j["retrain_bound"]
        dp = r["dp_finetune_slowdown"]
        dps = fmt(dp["max"], 3) if dp["per_seed"] and key == "judged" else "—"
        out.append(
            f"| {label(result, m)} | {per} | "
            + " / ".join(_ratio(x, c) for x, c in zip(wp["per_seed"], wp["censored"]))
            + " | "
            + " / ".join(_ratio(x, c) for x, c in zip(rb["per_seed"], rb["censored"]))
            + f" | {r['immunized_count']}/{n} | {_signed(r['dp_top1_delta'])} | {dps} |"
        )
    ops = _operators(result, key)
    theta0 = result["theta0"]["attack" if key == "judged" else "more_data"]["operators"]
    out += [
        "",
        "Each operator's cost to the target on the row over its cost on θ₀, per seed (a / b / c; "
        "≥: it was cut off once it had spent what the row's cheapest operator of its kind paid, a "
        "lower bound; —: it does not reach the target on θ₀).",
        "",
        "| row | " + " | ".join(operator_label(o, True) for o in ops) + " |",
        "|---|" + "---|" * len(ops),
    ]
    for m, r in rows_.items():
        j = r.get(key) or {}
        if not j:
            continue
        cells = []
        for o in ops:
            mine, base = j["operators"].get(o), theta0.get(o)
            if mine is None or base is None:
                cells.append("—")
                continue
            per = []
            for i, b in enumerate(base["flops_to_target"]):
                if b is None:
                    per.append("—")
                    continue
                f = mine["flops_to_target"][i]
                per.append(_ratio((mine["flops_limit"][i] if f is None else f) / b, f is None))
            cells.append(" / ".join(per))
        out.append(f"| {label(result, m)} | " + " | ".join(cells) + " |")
    return out


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
    """The headline (what each row is worth to its attacker, beside the ceiling and Definition
    3.1), θ₀'s side (the target, the cheapest attacker, scratch, every operator's plateau and
    cost), each operator's cost on each row, the attacker with more images, the D_P
    fine-tuning check, Table 3's κ columns (with the paper's numbers when given), the layer's
    attainable window and where (i) comes from."""
    rows, rc, n = result["rows"], result["run_config"], len(result["seeds"])
    z = _images(result)
    att = result["attacker"]
    rows_ = {k: r for k, r in rows.items() if k != "init"}
    ceil = result["theta0"]["attack"].get("ceiling", {})
    lines = [
        f"# Deep-net immunization: {result['config']} — {result['model_text']} on "
        f"{result['data']}",
        "",
        f"Seeds {result['seeds']}; {result['threads']} thread(s); {result['wall_seconds']:.0f} s "
        f"wall. The attacker's D_H images ({z['attack_train']} to train on, batches of "
        f"{att['batch_size']}, {att['image_side']} px; {z['attack_val']} to watch, "
        f"{z['attack_test']} to be scored on) are disjoint from every image the defense saw. One "
        "target for every operator and model: 90 % of the best plateau's gain over chance on θ₀. "
        "**Worth**: the attacker's cheapest cost in FLOPs (every operator, its learning rates "
        "tuned; linear probes, LoRA, fine-tuning, the retrain of every suffix of stages, training "
        "from scratch) on the row over the same on θ₀; **share of the headroom**: log worth / "
        "log ceiling (1: as costly as training from scratch; < 0: the row helped the attacker); "
        "**retrain bound**: the row's cheapest retrain over θ₀'s cheapest; ≥: a lower bound; "
        "≤: an upper bound (an operator stopped by its step bound had spent less than the "
        "cheapest paid) (docs/theory.md §12).",
        "",
    ]
    if ceil:
        lines += [
            "**Ceiling** (scratch's cost over the cheapest on θ₀) per seed: "
            + " / ".join(_ratio(x, c) for x, c in zip(ceil["per_seed"], ceil["censored"])),
            "",
        ]
    lines += [
        f"- {label(result, m)}: failed: {'; '.join(f)}" for m, f in _failures(result).items()
    ]
    if any(r.get("judged") for r in rows_.values()):
        lines += _judge_lines(result, rows_, "judged", n)
    lines += _theta0_lines(result["theta0"]["attack"], result["seeds"], "θ₀'s side per seed:")
    more = result["theta0"].get("more_data")
    if more:
        lines += [
            "",
            f"The attacker with {z['more_data']}× the images ({z['more_train']} to train on; "
            f"seed(s) {rc['more_data_seeds']}), with its own target and ceiling:",
            "",
        ]
        if any(r.get("more_data") for r in rows_.values()):
            lines += _judge_lines(result, rows_, "more_data", len(rc["more_data_seeds"]))
        lines += _theta0_lines(more, list(rc["more_data_seeds"]), "θ₀'s side with more images:")
    dp = result["theta0"].get("dp_finetune")
    if dp:
        lines += [
            "",
            "Full fine-tuning on fresh D_P images (the deep (ii): D_P must stay as easy to "
            "fine-tune as on θ₀), θ₀ per seed: plateau "
            + " / ".join(f"{x:.1f}" for x in dp["plateau"])
            + " %, target "
            + " / ".join(f"{x:.1f}" for x in dp["target"])
            + " %, steps to it "
            + " / ".join(str(x) for x in dp["steps"])
            + f", confirmed {sum(dp['confirmed'])}/{len(dp['confirmed'])}.",
        ]
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
    if rows_:
        lines += [
            "",
            "(i) decomposed: the largest and the smallest nonzero eigenvalue of H_H relative to "
            "its median, each divided by θ₀'s (geometric means over the groups; their quotient is "
            "the groups' κ ratio).",
            "",
            "| row | groups (i) ↑ | top ratio | bottom ratio |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {label(result, m)} | {pm(r['groups_harmful_ratio'])} | "
            f"{pm(r['harmful_top_ratio'])} | {pm(r['harmful_bottom_ratio'])} |"
            for m, r in rows_.items()
        ]
    return "\n".join(lines) + "\n"


def _signed(summary: dict, digits: int = 1) -> str:
    return f"{summary['mean']:+.{digits}f} ± {summary['std']:.{digits}f}"


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
    """One panel per operator: each row's cost to the target over θ₀'s per seed (open markers: a
    lower bound), on a log scale; 1 = as costly as on θ₀."""
    rows = {k: r for k, r in result["rows"].items() if k != "init" and r.get("judged")}
    ops = _operators(result)
    theta0 = result["theta0"]["attack"].get("operators", {})
    fig, axes, side = _figure(result, max(len(ops), 1), "Each operator's FLOPs over θ₀'s", 2)
    for ax, op in zip(axes, ops):
        for i, (m, r) in enumerate(rows.items()):
            mine, base = r["judged"]["operators"].get(op), theta0.get(op)
            if not mine or not base:
                continue
            for s, b in enumerate(base["flops_to_target"]):
                if b is None:
                    continue
                f = mine["flops_to_target"][s]
                y = (mine["flops_limit"][s] if f is None else f) / b
                ax.plot(
                    i,
                    y,
                    "o",
                    color=f"C{i}",
                    ms=4,
                    mfc="none" if f is None else f"C{i}",
                    label=label(result, m),
                )
        ax.axhline(1, color="k", lw=0.8)
        ax.set(yscale="log", title=operator_label(op), xticks=[])
        ax.title.set_fontsize(8)
    if axes:
        axes[0].set_ylabel("FLOPs to the target (× θ₀'s)  ↑ slower attacker")
    _finish(fig, axes, side, path)


def plot_frontier(result: dict, path) -> None:
    """Each row's share of the headroom per seed against its D_P top-1 cost (θ₀ − row, points):
    the frontier of a defense over its strength."""
    fig, (ax,), side = _figure(result, 1, "Share of the headroom against D_P top-1 cost")
    for m, r in result["rows"].items():
        j = r.get("judged") or {}
        if m == "init" or not j:
            continue
        ys = [y for y in j["headroom_share"]["per_seed"] if y is not None]
        if ys:
            ax.plot([-r["dp_top1_delta"]["mean"]] * len(ys), ys, "o", label=label(result, m))
    ax.axhline(0, color="k", lw=0.8)
    ax.axhline(1, color="firebrick", lw=0.8, ls=":")
    ax.set(
        xlabel="D_P top-1 cost (points)  ← better",
        ylabel="share of the headroom (log worth / log ceiling)  ↑ better",
    )
    _finish(fig, [ax], side, path)
