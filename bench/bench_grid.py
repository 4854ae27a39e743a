"""A learning-rate grid trained as one batched model against one model per setting, one thread.

    python bench/bench_grid.py [--repeat 5] [--settings 3]
    python -m pytest bench/bench_grid.py --benchmark-only

Per model and operator: the forward and backward of one training step of ``settings`` copies of
the attacker's model (a random-init timm ResNet18 at 32 px and the demo's small ViT, a batch of
64 images), once as ``settings`` plain models one after another and once as one model batched
over the settings (``torch.func.stack_module_state`` + ``vmap`` over ``functional_call``), and
the probes' Adam grid as one ``(settings, D + 1, classes)`` array against one array per setting
(:class:`pycore.deep._probes.AdamProbe`). The ratio sequential / batched is the gain of batching
(> 1: batching pays); the gradients of the two are checked equal to float32 round-off first.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, stack_module_state, vmap  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import interleaved_best  # noqa: E402
from pycore.deep import create_model  # noqa: E402
from pycore.deep._operators import attack_copy  # noqa: E402
from pycore.deep._probes import AdamProbe  # noqa: E402

MODELS = {
    "resnet18": ("resnet18", {"img_size": 32}),
    "vit (demo)": (
        "vit_tiny_patch16_224",
        {"img_size": 32, "patch_size": 8, "depth": 4, "embed_dim": 96, "num_heads": 3},
    ),
}


def deep_calls(name: str, settings: int) -> dict:
    """One training step's forward and backward of ``settings`` copies, sequential and batched,
    after checking that both give the same gradients."""
    arch, kw = MODELS[name]
    torch.manual_seed(0)
    base = attack_copy(create_model(arch, 5, seed=0, **kw), 5, seed=0).train()
    base.requires_grad_(True)
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.arange(64) % 5
    models = [copy.deepcopy(base) for _ in range(settings)]
    params, buffers = stack_module_state(models)
    params = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    shell = copy.deepcopy(base).to("meta")

    def one(p, b):
        return functional_call(shell, (p, b), (x,))

    def sequential():
        for m in models:
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()

    def batched():
        for p in params.values():
            p.grad = None
        out = vmap(one, randomness="same")(params, {k: v for k, v in buffers.items()})
        sum(F.cross_entropy(o, y) for o in out).backward()

    for m in models:  # BatchNorm in eval mode: vmap cannot update running statistics
        m.eval()
    shell.eval()
    sequential()
    batched()
    worst = max(
        float((params[k].grad[0] - p.grad).abs().max() / (p.grad.abs().max() + 1e-30))
        for k, p in models[0].named_parameters()
        if p.grad is not None
    )
    assert worst < 1e-3, f"batched gradients differ from one model's by {worst:.2g} (relative)"
    return {"sequential": sequential, "batched": batched}


def probe_calls(settings: int) -> dict:
    """The probes' Adam grid: one array of ``settings`` heads against one array per head."""
    rng = np.random.default_rng(0)
    A = np.hstack([rng.standard_normal((128, 512)), np.ones((128, 1))])
    y = np.arange(128) % 5
    ev = (A[:64], y[:64])
    lrs = tuple(10.0 ** rng.uniform(-3, -1, settings))

    def sequential():
        for lr in lrs:
            p = AdamProbe(A, y, ev, ev, lrs=(lr,), classes=5)
            p.advance([20])

    def batched():
        p = AdamProbe(A, y, ev, ev, lrs=lrs, classes=5)
        p.advance([20] * settings)

    return {"sequential": sequential, "batched": batched}


CASES = [(m, 3) for m in MODELS] + [("adam probe", 10)]


def calls(case, settings):
    return probe_calls(settings) if case == "adam probe" else deep_calls(case, settings)


@pytest.mark.parametrize("case, settings", CASES)
@pytest.mark.parametrize("how", ["sequential", "batched"])
def test_grid_step(benchmark, case, settings, how):
    torch.set_num_threads(1)
    benchmark.group = f"{case} × {settings}"
    benchmark(calls(case, settings)[how])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| grid | settings | sequential (ms) | batched (ms) | sequential / batched |")
    print("|---|---|---|---|---|")
    for case, settings in CASES:
        t = interleaved_best(calls(case, settings), args.repeat)
        print(
            f"| {case} | {settings} | {1e3 * t['sequential']:.1f} | {1e3 * t['batched']:.1f} | "
            f"{t['sequential'] / t['batched']:.2f} |"
        )


if __name__ == "__main__":
    main()
