"""What the deep commands' ``--help`` prints, importable without torch: written
by scripts/deep_catalog.py from experiments/deep_configs.py and pycore.deep (edit
those, then run it; tests/test_flags.py checks that this file is current)."""

CONFIGS = (
    "demo-baselines-resnet18",
    "demo-baselines-vit",
    "demo-defense-resnet18",
    "demo-defense-vit",
    "demo-frontier-resnet18",
    "demo-frontier-vit",
    "demo-resnet18",
    "demo-vit",
    "folders",
    "resnet18-cars",
    "resnet18-country211",
    "vit-cars",
    "vit-country211",
)
GROUPS = {
    "demo": ("demo-resnet18", "demo-vit"),
    "demo-defense": ("demo-defense-resnet18", "demo-defense-vit"),
    "demo-baselines": ("demo-baselines-resnet18", "demo-baselines-vit"),
    "demo-frontier": ("demo-frontier-resnet18", "demo-frontier-vit"),
}
DEEP_METHODS = (
    "ours",
    "closed_form",
    "kstep",
    "imma",
    "opt_kappa",
    "r_ill_only",
    "simulated",
    "sophon",
)
OPERATORS = (
    "gd",
    "adam",
    "adam_whitened",
    "remove_layer",
    "lora",
    "finetune_upper",
    "finetune_full",
    "retrain_tail",
)
LORA_RANKS = (8, 32)
DEEP_MAX_EPOCHS = 60
# each field of pycore.deep.DeepOptions → its rule (DeepOptions.describe)
DEEP_OPTIONS = {
    "rule": "one of adaptive, sgd",
    "adaptive_steps": "an integer in [0, 100000]",
    "patience": "an integer in [1, 100000]",
    "adaptive_lr": "a finite number in (0, 1] or None",
    "epochs": "an integer in [1, 100000]",
    "max_steps": "an integer in [1, 1e+07] or None",
    "batch_size": "an integer in [1, 65536]",
    "kstep_steps": "an integer in [1, 10000]",
    "lr": "a finite number > 0",
    "optimizer": "one of sgd, adam",
    "momentum": "a finite number in [0, 1)",
    "nesterov": "True or False",
    "weight_decay_extractor": "a finite number in [0, 1)",
    "weight_decay_classifier": "a finite number in [0, 1)",
    "label_smoothing": "a finite number in [0, 1)",
    "lambda_p": "a finite number > 0",
    "lambda_h": "a finite number > 0",
    "lambda_kappa": "a finite number > 0",
    "lambda_imma": "a finite number > 0",
    "balance": "a finite number > 0 or None",
    "balance_every": "an integer in [0, 1e+07]",
    "balance_ill": "a finite number > 0 or None",
    "imma_inner_steps": "an integer in [0, 1000]",
    "imma_inner_lr": "a finite number > 0",
    "ridge_rel": "a finite number > 0",
    "scope": "one of layer, tail",
    "stages": "an integer in [1, 1000]",
    "virtual_ranks": "an integer in [1, 1024]",
    "harden": "one of none, haar, label_subspace",
    "harden_scale": "a finite number in (0, 1]",
    "normalize": "True or False",
    "fold_batchnorm": "True or False",
    "dp_tolerance": "a finite number > 0 or None",
}
