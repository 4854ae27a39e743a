#!/usr/bin/env python
"""How a run of House Prices immunization amplifies round-off (docs/reproducibility.md).

Runs one (method, seed) twice: the reference, and a copy whose θ is changed by one unit in the last
place (each entry times 1 ± eps, random signs) right after step ``--perturb-step``.  Prints, at
steps along the run, how far the two θ's have moved apart: relative to ‖θ‖, split into θ's rows in
range(K_P) and in null(K_P), and as seen by the features (‖X_PΔθ‖/‖X_Pθ‖); then the e-folding
length of the growth and the RIR of both runs.  ``--against-kernel TYPE`` compares instead with
the same run under another OpenBLAS kernel type (``OPENBLAS_CORETYPE``).  A run that is stable in
rounding stays near eps; a chaotic one grows exponentially until the difference is O(1).

    python scripts/round_off_growth.py --protocol strict --method ours           # Algorithm 1, strict
    python scripts/round_off_growth.py --protocol strict --method ours --set lambda_p=0
    python scripts/round_off_growth.py --protocol strict --method ours --ridge-solve cholesky
    python scripts/round_off_growth.py --method opt_kappa                         # paper protocol
    python scripts/round_off_growth.py --method opt_kappa --eigvecs svd
    python scripts/round_off_growth.py --protocol strict --method imma --against-kernel Haswell
    python scripts/round_off_growth.py --ridge-solve cholesky --job --protocol strict --methods ours

``--job ARGS`` runs the whole ``experiments/house_price.py ARGS`` instead (its table, every seed)
with the ``--ridge-solve`` / ``--eigvecs`` formulation in place, e.g. to compare a documented row
before and after a change of formulation on each kernel type.

``--set OPTION=VALUE`` overrides an option of the method (ablations); ``--ridge-solve cholesky``
applies the ridge preconditioner ``(K+λI)⁻¹K`` as a Cholesky solve instead of the library's
eigen-form (:func:`pycore.precondition.ridge_factor`), to measure what the solve does.
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402

from pycore import optim  # noqa: E402
from pycore import precondition as pre  # noqa: E402
from pycore.immunize import immunize  # noqa: E402
from pycore.metrics import rir  # noqa: E402
from pycore.spectral import gram_spectrum, rank_tolerance  # noqa: E402

EPS = np.finfo(np.float64).eps


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _cholesky_ridge():
    """Swap the library's ridge eigen-form for ``cho_solve(K + λI, K·)`` (the textbook solve)."""
    def factor(K, ridge, X=None):
        return ("cholesky", scipy.linalg.cho_factor(K + ridge * np.eye(K.shape[0])), K)

    orig_apply = pre.Preconditioner.apply_theta_G

    def apply_theta_G(self, M):
        if self.mode == "ridge" and self.factor[0] == "cholesky":
            return 2.0 * scipy.linalg.cho_solve(self.factor[1], self.factor[2] @ M)
        return orig_apply(self, M)
    pre.ridge_factor = factor
    pre.Preconditioner.apply_theta_G = apply_theta_G


def _svd_eigvecs():
    """Give the in-loop regularizers the extreme eigenvectors of H = ZᵀZ from the SVD of Z (error
    ~eps·√κ(H)/gap instead of ~eps·κ(H)/gap for the smallest one)."""
    import pycore.methods as imm
    import pycore.regularizers as reg

    orig = reg.hessian_regularizer

    def hessian_regularizer(Z, kind, **kw):
        out = orig(Z, kind, **kw)
        Vt = np.linalg.svd(Z, full_matrices=False)[2]
        k = out.info.rank
        out._vectors.clear()
        out._vectors.update({0: Vt[0].copy(), k - 1: Vt[k - 1].copy()})
        return out
    reg.hessian_regularizer = imm.hessian_regularizer = hessian_regularizer


class Recorder:
    """Wraps the optimizers' step: θ every ``every`` steps, and the 1-ulp change after one step."""

    def __init__(self, every: int, perturb_step: int | None, seed: int = 12345):
        self.every, self.perturb_step, self.seed = every, perturb_step, seed
        self.thetas: list[np.ndarray] = []

    def __enter__(self):
        self.saved = {cls: cls.step for cls in (optim.Adam, optim.GD)}
        rec = self

        def wrap(orig):
            def step(opt, x, g, blame=None):
                new = orig(opt, x, g, blame)
                if opt.name == "θ":
                    if opt.t == rec.perturb_step:
                        signs = np.random.default_rng(rec.seed).choice([-1.0, 1.0], size=new.shape)
                        new = new * (1.0 + signs * EPS)
                    if opt.t % rec.every == 0:
                        rec.thetas.append(new.copy())
                return new
            return step
        for cls, orig in self.saved.items():
            cls.step = wrap(orig)
        return self

    def __exit__(self, *exc):
        for cls, orig in self.saved.items():
            cls.step = orig


def _trajectory(train, cfg, args, perturb):
    with Recorder(args.every, perturb) as rec:
        res = immunize(train, args.method, rng=np.random.default_rng(args.seed), **cfg)
    return np.array(rec.thetas), res.theta


def _other_kernel(argv, kernel):
    """The unperturbed trajectory under ``OPENBLAS_CORETYPE=kernel`` (a child process: the kernel
    is chosen when the BLAS library loads)."""
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "run.npz"
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel}
        subprocess.run([sys.executable, __file__, *argv, "--dump", str(dump)], env=env, check=True)
        with np.load(dump) as f:
            return f["thetas"], f["theta"], str(f["blas"])


def _blas() -> str:
    import threadpoolctl
    return "+".join(dict.fromkeys(str(i.get("architecture")) for i in threadpoolctl.threadpool_info()
                                  if i.get("user_api") == "blas"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="round_off_growth.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=("paper", "strict"), default="paper")
    # the methods that step θ with pycore.optim (R_ill only takes its own GD step; identity and the
    # closed form take none)
    p.add_argument("--method", default="ours", choices=("ours", "opt_kappa", "opt_kappa_balanced", "imma"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perturb-step", type=int, default=1)
    p.add_argument("--against-kernel", metavar="TYPE",
                   help="compare with the same run under OPENBLAS_CORETYPE=TYPE instead of a 1-ulp change")
    p.add_argument("--every", type=int, default=4, help="compare θ every this many steps")
    p.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE", help="option overrides")
    p.add_argument("--ridge-solve", choices=("eigen", "cholesky"), default="eigen")
    p.add_argument("--eigvecs", choices=("gram", "svd"), default="gram",
                   help="extreme eigenvectors of H = ZᵀZ from H (the library) or from the SVD of Z")
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--job", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="run experiments/house_price.py ARGS (every seed, its table) with the "
                        "--ridge-solve / --eigvecs formulation instead")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.ridge_solve == "cholesky":
        _cholesky_ridge()
    if args.eigvecs == "svd":
        _svd_eigvecs()
    if args.job is not None:
        from experiments import house_price  # noqa: E402  (the workers fork: they see the patches)
        return house_price.main(args.job)
    from experiments.house_price import load_tasks  # noqa: E402  (imports the CLI layer)

    _, train, _, _ = load_tasks(types.SimpleNamespace(data=None, n_train=200, protocol=args.protocol,
                                                      target_p=None, on_outlier="warn"))
    overrides = dict(kv.split("=", 1) for kv in args.set)
    overrides = {k: _value(v) for k, v in overrides.items()}
    cfg = {"preset": "strict" if args.protocol == "strict" else "house_price", **overrides}
    if args.dump:
        ta, theta_a = _trajectory(train, cfg, args, None)
        np.savez(args.dump, thetas=ta, theta=theta_a, blas=_blas())
        return 0
    ta, theta_a = _trajectory(train, cfg, args, None)
    if args.against_kernel:
        tb, theta_b, other = _other_kernel(argv, args.against_kernel)
        what = f"{_blas()} kernels against {other} kernels"
    else:
        tb, theta_b = _trajectory(train, cfg, args, args.perturb_step)
        what = f"θ ×(1 ± eps) after step {args.perturb_step}"
    _, s, Vt = np.linalg.svd(train.X_P, full_matrices=True)
    r = int(np.count_nonzero(s > rank_tolerance(s[0], train.X_P.shape)))
    V_r, V_n = Vt[:r].T, Vt[r:].T
    XP = train.X_P
    print(f"{args.protocol} protocol, {args.method}, seed {args.seed}, {what}"
          f"{', ' + ', '.join(args.set) if args.set else ''}, ridge {args.ridge_solve}, "
          f"eigenvectors from {'the SVD of Z' if args.eigvecs == 'svd' else 'H'}; "
          f"rank K_P = {r} of {train.D}")
    print("| step | ‖Δθ‖/‖θ‖ | rows in range(K_P) | rows in null(K_P) | ‖X_PΔθ‖/‖X_Pθ‖ | κ(H_P) | "
          "(λ₁−λ₂)/λ₁ of H_P |")
    print("|---|---|---|---|---|---|---|")
    n = min(len(ta), len(tb))
    marks = sorted(set(np.unique(np.geomspace(1, n, 14).astype(int)) - 1) | {n - 1})
    div = []
    for i in range(n):
        d, t = tb[i] - ta[i], ta[i]
        nt = np.linalg.norm(t)
        div.append(np.linalg.norm(d) / nt)
        if i in marks:
            seen = np.linalg.norm(XP @ d) / np.linalg.norm(XP @ t)
            spec = gram_spectrum(XP @ t, vectors=False)
            lam = spec.sigma
            print(f"| {(i + 1) * args.every} | {div[-1]:.2e} | {np.linalg.norm(V_r.T @ d) / nt:.2e} | "
                  f"{np.linalg.norm(V_n.T @ d) / nt:.2e} | {seen:.2e} | {spec.kappa:.3g} | "
                  f"{(lam[0] - lam[1]) / lam[0]:.1e} |")
    div = np.array(div)
    steps = (np.arange(n) + 1) * args.every
    grow = (div > 1e-13) & (div < 1e-3)
    slope = np.polyfit(steps[grow], np.log(div[grow]), 1)[0] if grow.sum() >= 3 else 0.0
    if slope > 0:
        print(f"exponential growth between 1e-13 and 1e-3: e-folding every {1 / slope:.0f} steps "
              f"(steps {steps[grow][0]}–{steps[grow][-1]} of {steps[-1]})")
    else:
        print(f"no exponential growth: largest difference {div.max():.2e} over {steps[-1]} steps")
    ra, rb = (rir(th, train.X_P, train.X_H).value for th in (theta_a, theta_b))
    print(f"RIR: reference {ra:.6g}, other {rb:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
