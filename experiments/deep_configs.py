"""Named configurations of the deep-net experiments and the paper's Table 3 (docs/deep.md).

The pipeline they parameterise is :mod:`pycore.deep.evaluate`; ``experiments/deepnet.py`` runs
them (``--config NAME`` or ``--demo``).
"""
from __future__ import annotations

from dataclasses import replace

from pycore.deep.evaluate import RunConfig
from pycore.deep.train import DeepImmunizeConfig

__all__ = ["CONFIGS", "DEMO_CONFIGS", "PAPER_TABLE3", "PAPER_KEY"]

# Paper Table 3 (3 seeds): (i), (ii), RIR_θ₀, D_P top-1 %; θ₀ top-1 68.24 (ResNet18) / 81.78 (ViT).
PAPER_TABLE3 = {
    ("resnet18", "cars"): {"init": (1.0, 1.0, 1.0, 68.24), "r_ill_only": (1.878, 1.786, 1.057, 63.84),
                           "imma": (0.866, 0.889, 0.974, 63.57), "opt_kappa": (1.217, 0.798, 1.527, 63.65),
                           "ours": (2.386, 0.699, 3.467, 62.36)},
    ("vit", "cars"): {"init": (1.0, 1.0, 1.0, 81.78), "r_ill_only": (13.121, 4.097, 3.342, 82.21),
                      "imma": (1.422, 2.090, 0.702, 81.89), "opt_kappa": (3.598, 0.171, 26.369, 82.51),
                      "ours": (7.945, 0.323, 34.517, 82.79)},
    ("resnet18", "country211"): {"init": (1.0, 1.0, 1.0, 68.24), "r_ill_only": (20.727, 20.675, 1.038, 62.17),
                                 "imma": (0.791, 0.814, 0.972, 67.03),
                                 "opt_kappa": (1.538, 1.053, 1.472, 66.81),
                                 "ours": (3.287, 0.399, 8.714, 65.01)},
    ("vit", "country211"): {"init": (1.0, 1.0, 1.0, 81.78), "r_ill_only": (69.291, 63.519, 1.122, 80.73),
                            "imma": (6.242, 7.599, 0.845, 82.47), "opt_kappa": (4.589, 0.300, 16.498, 82.79),
                            "ours": (20.894, 0.700, 41.341, 83.17)},
}


def _paper(method, lam_p, lam_h, epochs):
    return DeepImmunizeConfig(method=method, lr=1e-5, lambda_p=lam_p, lambda_h=lam_h, epochs=epochs)


# Paper-scale runs draw the 20 groups of 100 RIR samples from 2000 training images per task.
_PAPER_EVAL = {"rir_pool": 2000}

# One rule for every method of the CPU demo (no per-method λ): the immunization layer alone is
# trained (Algorithm 1 on the frozen backbone's features, preconditioned as in the paper's
# App. C.3), SGD Nesterov lr 0.1, 400 steps of 64 + 64 samples, and every regularizer term
# re-balanced at EVERY step to the gradient norm of the D_P loss (balance 1). Every extractor,
# θ₀ included, is also measured after the label-subspace hardening (pycore/deep/harden.py).
_DEMO_RULE = DeepImmunizeConfig(lr=0.1, balance=1.0, balance_every=1, epochs=100, max_steps=400,
                                batch_size=64, harden="label_subspace", harden_scale=0.01)

CONFIGS: dict[str, RunConfig] = {
    # Paper Table 4 (λ_P on R_well, λ_H on R_ill; epochs of the shorter D_H loader).
    "resnet18-cars": RunConfig("resnet18-cars", "resnet18", "folders", _paper("ours", 5e-5, 2e6, 3),
                               **_PAPER_EVAL),
    "resnet18-country211": RunConfig("resnet18-country211", "resnet18", "folders",
                                     _paper("ours", 1e-4, 2e6, 3), **_PAPER_EVAL),
    "vit-cars": RunConfig("vit-cars", "vit_base_clip", "folders", _paper("ours", 3e-6, 3e8, 2),
                          **_PAPER_EVAL),
    "vit-country211": RunConfig("vit-country211", "vit_base_clip", "folders", _paper("ours", 1e-6, 1e8, 2),
                                **_PAPER_EVAL),
    # CPU demo: MNIST 0-4 (D_P) vs 5-9 (D_H), 32 px.
    # Attackers scored after 1, 5 and 10 epochs (the fine-tuning attacker is most of the demo's time).
    "demo-resnet18": RunConfig("demo-resnet18", "resnet18_32px", "mnist", _DEMO_RULE, scope="layer",
                               theta0_epochs=3, theta0_lr=2e-3, per_digit=250, rir_pool=500, probe_epochs=60,
                               attack_epochs=(1, 5, 10)),
    "demo-vit": RunConfig("demo-vit", "vit_mini_32px", "mnist", _DEMO_RULE, scope="layer",
                          theta0_epochs=16, theta0_lr=3e-3, per_digit=250, rir_pool=500, probe_epochs=60,
                          attack_epochs=(1, 5, 10)),
    # The demo's previous ViT θ₀ (192 wide, 8 epochs), kept to compare θ₀'s (docs/deep.md §5).
    "demo-vit-tiny": RunConfig("demo-vit-tiny", "vit_tiny_32px", "mnist", _DEMO_RULE, scope="layer",
                               theta0_epochs=8, theta0_lr=3e-3, per_digit=250, rir_pool=500, probe_epochs=60,
                               attack_epochs=(1, 5, 10)),
    # CI size (tests): the demo's rule on a few hundred digits, a handful of steps.
    "ci": RunConfig("ci", "resnet18_32px", "mnist",
                    replace(_DEMO_RULE, epochs=1, max_steps=6, batch_size=16), scope="layer",
                    theta0_epochs=1, theta0_lr=2e-3, per_digit=40, rir_groups=4, rir_group_size=40,
                    probe_epochs=5, eval_batch=128, attack_epochs=(1, 5), adam_lrs=(1e-2, 1e-1),
                    finetune_pool=32),
    # The paper's layer choice (last two residual stages) at CI size: checks the tail path.
    "ci-tail": RunConfig("ci-tail", "resnet18_32px", "mnist",
                         DeepImmunizeConfig(lr=3e-5, balance=1.0, epochs=1, max_steps=3, batch_size=16),
                         theta0_epochs=1, theta0_lr=2e-3, per_digit=40, rir_groups=4, rir_group_size=40,
                         probe_epochs=5, eval_batch=128, attack_epochs=(1,), adam_lrs=(1e-2,),
                         finetune_pool=32),
}

DEMO_CONFIGS = ("demo-resnet18", "demo-vit")

# Which paper row a configuration reproduces (its table prints the paper's numbers beside ours).
PAPER_KEY = {"resnet18-cars": ("resnet18", "cars"), "resnet18-country211": ("resnet18", "country211"),
             "vit-cars": ("vit", "cars"), "vit-country211": ("vit", "country211")}
