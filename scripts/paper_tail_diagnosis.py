#!/usr/bin/env python
"""Why the paper's deep method (§5.2: the backbone's last stages trained by SGD on Eq. (11)) did
not run on the demo at its own settings, measured on the demo's ResNet18 θ₀ of seed 0
(docs/findings.md §7).

    python scripts/paper_tail_diagnosis.py [--seed 0]

Prints, for the θ₀ the demo trains (experiments/deep_configs.py ``demo-resnet18``):
- the gains γ/σ of the BatchNorms of the two trained stages in eval mode (a step on a convolution
  moves its output by the gain of the BatchNorm after it);
- one step at Table 4's fixed λ's (lr 1e-5, λ_P 5e-5, λ_H 2e6): λ_P·R_well and λ_H·R_ill against
  the cross-entropy, and what the step does to the features (their RMS row norm, columns left at
  zero); then whether the second step is finite;
- the same at the loop's defaults (``DeepOptions(rule="sgd", scope="tail", stages=2)``: lr 0.1,
  λ's balanced every step; its D_P guard, which would return to step 0, off);
- the run the demo's row makes: Table 4 with its λ's set once by the paper's own balancing rule
  (App. C.2) at the first step, 3 epochs of the D_H loader: its (i), (ii) on the defense's rows.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import replace
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np
import torch

from experiments.deep_configs import CONFIGS, paper_tail
from experiments.deep_pipeline import RunOptions, load_splits, train_classifier
from pycore import feature_rir
from pycore.deep import DeepOptions, ImmunizedNet, NonFiniteLossError, create_model
from pycore.deep._features import extract
from pycore.deep._objectives import loss_terms
from pycore.deep._train import immunize_in_place


def _features(model, ds) -> np.ndarray:
    """The pre-logit features (the layer's input) of ``ds``; non-finite ones are returned as
    they are (the point is to see them)."""
    with torch.no_grad():
        X = torch.cat([model.prelogits(ds.tensors[0][s : s + 256]) for s in range(0, 512, 256)])
    return X.double().numpy()


def _describe(X: np.ndarray) -> str:
    if not np.isfinite(X).all():
        return "non-finite features"
    rms = float(np.sqrt((X**2).sum(1).mean()))
    dead = int((np.abs(X).sum(0) == 0).sum())
    return f"RMS row norm {rms:.3g}, {dead} of {X.shape[1]} feature columns all zero"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    rc = CONFIGS["demo-resnet18"]
    sp = load_splits(rc, RunOptions(quiet=True), args.seed)
    torch.manual_seed(args.seed)
    net = create_model(rc.model, 5, seed=args.seed, **rc.model_kwargs)
    train_classifier(
        net, sp.theta0_train, epochs=rc.theta0_epochs, lr=rc.theta0_lr, seed=args.seed
    )
    theta0 = ImmunizedNet(net).eval()
    print(f"θ₀: {rc.model} trained {rc.theta0_epochs} epochs on D_P (seed {args.seed})")
    gains = []
    for name, m in theta0.net.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d) and name.split(".")[0] in ("layer3", "layer4"):
            g = (m.weight.abs() / (m.running_var + m.eps).sqrt()).detach()
            gains.append((float(g.max()), float(g.median()), name))
    top = max(gains)
    print(
        f"BatchNorm gains γ/σ in layer3-4: largest {top[0]:.3g} (median {top[1]:.3g}) in "
        f"{top[2]}; the other BatchNorms' largest ≤ {sorted(gains)[-2][0]:.3g}"
    )
    X0 = _features(theta0, sp.h_train)
    print(f"θ₀'s D_H features: {_describe(X0)}")
    table4 = paper_tail(2, 3, 5e-5, 2e6)
    early = DeepOptions(
        rule="sgd", scope="tail", stages=2
    )  # the loop's defaults: lr 0.1, balanced
    xP, yP = (t[:64] for t in sp.p_train.tensors)
    xH, yH = (t[:64] for t in sp.h_train.tensors)
    with torch.no_grad():
        terms = loss_terms(theta0, "ours", theta0.prelogits(xP), yP, theta0.prelogits(xH), yH, 5)
    ce, rw, ri = (float(terms[k]) for k in ("ce", "r_well", "r_ill"))
    print(
        f"first batch, Table 4's λ's: CE {ce:.3g}, λ_P·R_well {5e-5 * rw:.4g} "
        f"({5e-5 * rw / ce:.0f}× the CE), λ_H·R_ill {2e6 * ri:.3g}"
    )
    for label, o in (("Table 4 (lr 1e-5, fixed λ's)", table4), ("the loop's defaults", early)):
        for steps in (1, 2):
            m = copy.deepcopy(theta0)
            try:
                immunize_in_place(
                    m,
                    sp.p_train,
                    sp.h_train,
                    "ours",
                    replace(o, max_steps=steps),
                    seed=args.seed,
                    num_classes_h=5,
                )
                what = _describe(_features(m, sp.h_train))
            except NonFiniteLossError as exc:
                what = f"refused: {str(exc).split(';')[0]}"
            print(f"{label}, after {steps} step(s): {what}")
    m = copy.deepcopy(theta0)
    res = immunize_in_place(
        m, sp.p_train, sp.h_train, "ours", paper_tail(2, 3), seed=args.seed, num_classes_h=5
    )
    r = feature_rir(*(extract(x, d) for x in (m, theta0) for d in (sp.p_train, sp.h_train)))
    print(
        f"the demo's row (Table 4, λ's balanced once: λ_P {res.lambdas['lambda_p']:.3g}, "
        f"λ_H {res.lambdas['lambda_h']:.3g}), {res.steps} steps: (i) {r.harmful_ratio:.4g}, "
        f"(ii) {r.pretrain_ratio:.4g}; features {_describe(_features(m, sp.h_train))}"
    )


if __name__ == "__main__":
    main()
