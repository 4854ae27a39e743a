"""One deep immunization step (Eq. (11), "ours", scope "tail", timm at 32 px, 64 + 64 samples, SGD)
with the fused op against the same step with R by autograd through ``eigvalsh`` of the D×D ZᵀZ,
interleaved in one run, one thread (docs/design.md §2): ref / fused is what the op saves per step.

    python -m pytest bench/bench_deepnet.py --benchmark-only -s
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import pycore._ops as _ops
from pycore import ops
from pycore.deep import ImmunizedNet, create_model

SHAPES = {
    "resnet18": ({"img_size": 32}, 2),
    "vit_tiny_patch16_224": ({"img_size": 32, "patch_size": 8, "depth": 4}, 1),
}


def training_step(backbone: str, cond, batch: int = 64):
    """A closure running one step of ``backbone`` with the regularizer ``cond(Z, kind)``."""
    kwargs, stages = SHAPES[backbone]
    m = ImmunizedNet(create_model(backbone, 5, seed=0, **kwargs), lambda_reg=1e-3)
    ext, cls = m.set_trainable("tail", stages)
    m.eval()
    g = torch.Generator().manual_seed(0)
    xP, xH = (torch.randn(batch, 3, 32, 32, generator=g) for _ in range(2))
    yP = torch.randint(0, 5, (batch,), generator=g)
    opt = torch.optim.SGD(ext + cls, lr=1e-9, momentum=0.9, nesterov=True)

    def step():
        XP, XH = m.prelogits(xP), m.prelogits(xH)
        ce = F.cross_entropy(m.classifier(F.linear(XP, m.layer.weight)), yP, label_smoothing=0.1)
        loss = (
            ce.double()
            + 1e-9 * cond(m.layer(XP).double(), "well")
            + cond(m.layer(XH).double(), "ill")
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


@pytest.mark.parametrize("backbone", list(SHAPES))
def test_step_fused_against_reference(benchmark, backbone):
    steps = {
        "fused": training_step(backbone, ops.cond_regularizer),
        "ref": training_step(backbone, _ops.reference_cond_regularizer),
    }
    best = dict.fromkeys(steps, float("inf"))

    def one_round():  # every variant once per round: load from other processes hits both alike
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t0)

    benchmark.group = f"deep immunization step, {backbone}: fused + reference"
    benchmark.pedantic(one_round, rounds=10, warmup_rounds=1)
    ratio = best["ref"] / best["fused"]
    benchmark.extra_info.update(fused_s=best["fused"], ref_s=best["ref"], ref_over_fused=ratio)
    print(
        f"\n{backbone}: fused {1e3 * best['fused']:.1f} ms, reference {1e3 * best['ref']:.1f} ms, "
        f"reference / fused {ratio:.2f} (extension built: {_ops.extension_available()})"
    )
    assert ratio > 0
