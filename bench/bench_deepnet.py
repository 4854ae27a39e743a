"""Cost of the immunization regularizers per training step, demo size, CPU (issue 5 target).

    python bench/bench_deepnet.py [--rounds 15] [--batch 64] [--backbones resnet18,vit_tiny_patch16_224]

Per backbone (timm, 32 px; the ViT with patch 8 and 4 blocks), on the same batches (64 for D_P and
for D_H), single-threaded, the paper's "tail" scope (ResNet18: its last two stages, the ViT: its
last block and norm) with the frozen prefix untracked as in immunization, SGD(Nesterov) step included,
timed interleaved
(each round runs every variant once) and reported as medians and RATIOS within this run:

* ``plain``      -- a plain fine-tuning step: CE on the D_P batch;
* ``+D_H pass``  -- plain + the D_H batch through the trunk and the tail with a zero-weight
                    loss on its features (the extra data pass immunization needs, no
                    regularizer math);
* ``ours/fused`` -- CE + λ_P R_well(Z_P) + λ_H R_ill(Z_H) through the fused op (float64) and
                    the preconditioned immunization layer;
* ``ours/ref``   -- the same with the plain-PyTorch reference regularizer (autograd through
                    ``eigvalsh`` of the D×D ``ZᵀZ``) instead of the fused op;
* ``ours/fused, λ re-balanced`` -- ``ours/fused`` with the λ's re-balanced against the CE
                    gradient at this step (:func:`pycore.deep.train.balanced_lambdas`, the demo's
                    rule): one extra gradient per term.

"regularizer overhead" = (ours − ``+D_H pass``) / plain: the cost of the regularizers
themselves; "immunization step / plain" also counts the D_H data pass.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pycore.deep.objectives as objectives  # noqa: E402
from pycore import ops  # noqa: E402
from pycore.deep import ImmunizedNet, create_model  # noqa: E402
from pycore.deep.train import balanced_lambdas  # noqa: E402

SHAPES = {"resnet18": ({"img_size": 32}, 2),
          "vit_tiny_patch16_224": ({"img_size": 32, "patch_size": 8, "depth": 4}, 1)}


def _setup(backbone: str, batch: int, seed: int = 0):
    kwargs, stages = SHAPES.get(backbone, ({"img_size": 32}, 1))
    m = ImmunizedNet(create_model(backbone, 5, seed=seed, **kwargs), lambda_reg=1e-3)
    ext, cls = m.set_trainable("tail", stages)
    m.eval()
    g = torch.Generator().manual_seed(seed)
    xP, xH = (torch.randn(batch, 3, 32, 32, generator=g) for _ in range(2))
    yP, yH = (torch.randint(0, 5, (batch,), generator=g) for _ in range(2))
    opt = torch.optim.SGD([{"params": ext}, {"params": cls}], lr=1e-9, momentum=0.9, nesterov=True)
    return m, opt, (xP, yP, xH, yH)


def _variants(m, opt, data):
    xP, yP, xH, yH = data
    lam = {"lambda_p": 1e-9, "lambda_h": 1.0, "lambda_kappa": 0.0, "lambda_imma": 0.0}

    def step(loss):
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    trunk = m.prelogits            # the frozen prefix is not tracked by autograd

    def plain():
        z = F.linear(trunk(xP), m.layer.weight, m.layer.bias)
        step(F.cross_entropy(m.classifier(z), yP, label_smoothing=0.1))

    def with_h_pass():
        z = F.linear(trunk(xP), m.layer.weight, m.layer.bias)
        zh = m.layer(trunk(xH))
        step(F.cross_entropy(m.classifier(z), yP, label_smoothing=0.1) + 0.0 * zh.double().sum())

    ext = [p for p in m.parameters()
           if p.requires_grad and all(p is not q for q in m.classifier.parameters())]

    def ours_balanced():
        t = objectives.loss_terms(m, "ours", trunk(xP), yP, trunk(xH), yH, 5)
        step(objectives.combine_terms(t, {**lam, **balanced_lambdas(t, ext, 1.0)}))

    def ours(cond):
        def run():
            saved = objectives._cond
            objectives._cond = cond
            try:
                t = objectives.loss_terms(m, "ours", trunk(xP), yP, trunk(xH), yH, 5)
            finally:
                objectives._cond = saved
            step(objectives.combine_terms(t, lam))
        return run

    fused = objectives._cond
    reference = lambda Z, kind: ops.reference_cond_regularizer(Z.double(), kind)  # noqa: E731
    return {"plain": plain, "+D_H pass": with_h_pass, "ours/fused": ours(fused), "ours/ref": ours(reference),
            "ours/fused, λ re-balanced": ours_balanced}


def measure(backbone: str, batch: int, rounds: int) -> dict:
    m, opt, data = _setup(backbone, batch)
    fns = _variants(m, opt, data)
    times = {k: [] for k in fns}
    for k, f in fns.items():  # warm-up
        f()
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--backbones", default="resnet18,vit_tiny_patch16_224")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"extension_available={ops.extension_available()} threads={torch.get_num_threads()} "
          f"batch={args.batch} rounds={args.rounds}")
    print("| backbone | plain step ms | +D_H pass ms | ours/fused ms | ours/ref ms | re-balanced ms | "
          "regularizer overhead, fused | regularizer overhead, ref | immunization step / plain (fused) | "
          "re-balanced step / plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in args.backbones.split(","):
        r = measure(b, args.batch, args.rounds)
        p, h = r["plain"], r["+D_H pass"]
        rb = r["ours/fused, λ re-balanced"]
        print(f"| {b} | {1e3 * p:.1f} | {1e3 * h:.1f} | {1e3 * r['ours/fused']:.1f} | "
              f"{1e3 * r['ours/ref']:.1f} | {1e3 * rb:.1f} | {100 * (r['ours/fused'] - h) / p:.1f}% | "
              f"{100 * (r['ours/ref'] - h) / p:.1f}% | "
              f"{r['ours/fused'] / p:.2f}x | {rb / p:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
