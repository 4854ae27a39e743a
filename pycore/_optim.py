"""Update rules on float64 arrays.

GD, Adam, and damped Newton for the smooth strictly convex problems of the probes and the
attackers.  GD and Adam refuse a non-finite state or iterate (an overflowing gradient would make
Adam's every later step 0) with a :class:`pycore.DivergenceError` naming ``blame``: a parameter, or
``{name: gradient term}`` whose largest term is named (:func:`largest_term`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.linalg

from pycore._validation import DivergenceError, check_betas, check_choice, check_number

OPTIMIZERS = ("adam", "gd")


def _diverged(what: str, name: str, t: int, g: np.ndarray, blame) -> DivergenceError:
    if callable(blame):  # the terms, computed only now that they are needed
        blame = blame()
    parameter = largest_term(**blame) if isinstance(blame, dict) else blame
    with np.errstate(all="ignore"):
        gmax = float(np.max(np.abs(g))) if g.size else 0.0
    hint = f"; lower {parameter}" if parameter else ""
    return DivergenceError(
        parameter,
        f"{what} for {name} became non-finite at step {t} (max |gradient| {gmax:.3e}){hint}",
    )


class GD:
    """θ ← θ − lr·g (Algorithm 1 as printed)."""

    def __init__(self, lr: float, *, name: str = "x"):
        self.lr = check_number(lr, "lr", low=0.0, low_open=True)
        self.name, self.t = name, 0

    def step(self, x: np.ndarray, g: np.ndarray, blame: str | dict | None = None) -> np.ndarray:
        self.t += 1
        with np.errstate(over="ignore", invalid="ignore"):
            new = x - self.lr * g
        if not all_finite(new):
            raise _diverged("the GD step", self.name, self.t, g, blame)
        return new


class Adam:
    """Adam (Kingma & Ba 2015) with bias correction, the paper's optimizer (Appendix C.2)."""

    def __init__(
        self,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        name: str = "x",
    ):
        self.lr = check_number(lr, "lr", low=0.0, low_open=True)
        self.b1, self.b2 = check_betas(betas)
        self.eps = check_number(eps, "adam_eps", low=0.0, low_open=True)
        self.m = self.v = None
        self.t, self.name = 0, name

    def step(self, x: np.ndarray, g: np.ndarray, blame=None) -> np.ndarray:
        """One Adam step of ``x`` (any shape, e.g. a stack of runs) along ``g``.

        Elementwise, so each entry's arithmetic is that of a step on it alone.
        """
        if self.m is None or self.m.shape != g.shape:
            # C order throughout: the chunks below are views of the flattened arrays
            self.m, self.v = np.zeros(g.shape), np.zeros(g.shape)
            # work buffers: the moments go to the spare pair, swapped in once finite
            self._buf = [np.empty(g.shape) for _ in range(4)]
        self.t += 1
        b1, b2 = self.b1, self.b2
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        new = np.empty(x.shape)
        flat = [a.reshape(-1) for a in (self.m, self.v, g, x, new, *self._buf)]
        m0, v0, gf, xf, nf, m1, v1, t1, t2 = flat
        step_failed = False
        # m = b1·m + (1 − b1)·g, v = b2·v + (1 − b2)·g², x − lr·(m/(1 − b1ᵗ))/(√(v/(1 − b2ᵗ)) + ε)
        # in that order, into preallocated arrays, a cache-sized chunk at a time (at D = 784 the
        # whole arrays stream from memory once per operation: 4× slower than the arithmetic)
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, gf.size, ADAM_CHUNK):
                c = slice(lo, lo + ADAM_CHUNK)
                m, v, a, b = m1[c], v1[c], t1[c], t2[c]
                np.multiply(m0[c], b1, out=m)
                np.multiply(gf[c], 1 - b1, out=a)
                np.add(m, a, out=m)
                np.multiply(gf[c], gf[c], out=b)
                np.multiply(b, 1 - b2, out=b)
                np.multiply(v0[c], b2, out=v)
                np.add(v, b, out=v)
                if not (all_finite(m) and all_finite(v)):
                    # g·g overflows from |g| ≈ 1.3e154 on: v = inf and every later step would be 0
                    raise _diverged("Adam's moment estimates", self.name, self.t, g, blame)
                np.divide(m, c1, out=a)
                np.multiply(a, self.lr, out=a)
                np.divide(v, c2, out=b)
                np.sqrt(b, out=b)
                np.add(b, self.eps, out=b)
                np.divide(a, b, out=a)
                np.subtract(xf[c], a, out=nf[c])
                step_failed = step_failed or not all_finite(nf[c])
        if step_failed:
            raise _diverged("the Adam step", self.name, self.t, g, blame)
        self._buf[0], self.m = self.m, self._buf[0]
        self._buf[1], self.v = self.v, self._buf[1]
        return new


# Entries per chunk of an Adam step: 8 float64 arrays of 32k entries (2 MiB) stay in cache.
ADAM_CHUNK = 1 << 15


def all_finite(a: np.ndarray) -> bool:
    """``np.all(np.isfinite(a))`` without the boolean temporary.

    A finite sum means finite entries.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        s = a.sum()
    return bool(np.isfinite(s)) or bool(np.isfinite(a).all())


# Bound on |Xθ| entries: past it ZᵀZ overflows float64 (a step that gets there has diverged).
FEATURE_LIMIT = 1e150


def check_scale(
    x: np.ndarray, x_norm: float, where: str, optimizer: str, lr: float, blame
) -> None:
    """A :class:`DivergenceError` when the features ``Xx`` can exceed :data:`FEATURE_LIMIT`.

    :class:`DivergenceError` if ``|X x| ≤ x_norm·max|x|`` (``x_norm = max_i ‖X_i‖₁``) can exceed
    :data:`FEATURE_LIMIT`, blaming lr under Adam (every step is ~lr long), else
    :func:`largest_term`.
    """
    x_max = max(float(x.max()), -float(x.min()))  # max |x| without the |x| temporary
    if not x_max * x_norm < FEATURE_LIMIT:
        if callable(blame):  # the terms, computed only now that they are needed
            blame = blame()
        parameter = (
            "lr"
            if optimizer == "adam"
            else (largest_term(lr, **blame) if isinstance(blame, dict) else blame)
        )
        raise DivergenceError(
            parameter,
            f"{where}: θ diverged (max |θ| {x_max:.3e}: the features Xθ overflow float64); "
            f"lower {parameter}",
        )


# Bound on θ's growth over a run, max |θ| at its end over max |θ| at its start: both House Prices
# tables stay within 5×; past 1e6× the steps, not the data, made θ (lr = 1e30 turned θ = I into
# the sum of its first gradients, every κ ratio of the result about 1e14, returned as a result).
THETA_GROWTH = 1e6


def check_growth(x: np.ndarray, start: float, where: str, parameter: str = "lr") -> None:
    """A :class:`DivergenceError` naming ``parameter`` if ``x`` grew past its start.

    Raised when max |x| exceeds :data:`THETA_GROWTH` × ``start`` (the initial max |x|): a run's
    end, checked before its θ is returned (a run that fails on the way keeps its own error).
    """
    x_max = max(float(x.max()), -float(x.min()))
    if x_max > THETA_GROWTH * start:
        raise DivergenceError(
            parameter,
            f"{where}: θ diverged (max |θ| {x_max:.3e}, {x_max / start:.3g} times its start, "
            f"beyond the {THETA_GROWTH:g} a run may grow: the steps, not the data, made it); "
            f"lower {parameter}",
        )


def largest_term(step: float | None = None, **terms) -> str:
    """The name of the largest term of a divergent gradient.

    Name of the largest term (max |entry|; NaN counts as inf) of a divergent gradient, e.g.
    ``largest_term(lr=loss_grad, lambda_h=reg_term)``; ``"lr"`` when a GD ``step`` outweighs
    all.
    """

    def size(a):
        with np.errstate(invalid="ignore"):
            return -1.0 if a is None else float(np.nan_to_num(np.max(np.abs(a)), nan=np.inf))

    sizes = {k: size(a) for k, a in terms.items()}
    name = max(sizes, key=sizes.get)
    return "lr" if step is not None and step > sizes[name] else name


def make_optimizer(
    name: str, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, *, param: str = "x"
):
    """``"adam"`` or ``"gd"`` for the parameter called ``param`` (named in divergence errors)."""
    if check_choice(name, "optimizer", OPTIMIZERS) == "adam":
        return Adam(lr, betas, eps, name=param)
    return GD(lr, name=param)


def damped_newton(
    value_grad: Callable,
    value: Callable,
    hessian: Callable,
    w0: np.ndarray,
    *,
    tol: float,
    max_iter: int,
    callback: Callable[[np.ndarray], bool] | None = None,
) -> tuple[np.ndarray, dict]:
    """Damped Newton with Armijo backtracking.

    Damped Newton: Cholesky solve of ``hessian(w)`` (positive definite: the callers add a
    ridge), Armijo backtracking (c = 1e-4, halving), until ``‖∇f‖ ≤ tol·max(1, ‖∇f(w₀)‖)``, the
    float64 floor, ``max_iter`` or ``callback(w)``; ``(w, {"iterations", "grad_norm",
    "message"})``.
    """
    w = w0.copy()
    f, g = value_grad(w)
    g0 = max(1.0, float(np.linalg.norm(g)))
    it, message = 0, "max_iter reached"
    while it < max_iter:
        if np.linalg.norm(g) <= tol * g0:
            message = "gradient tolerance reached"
            break
        H = hessian(w)
        d = -scipy.linalg.cho_solve(scipy.linalg.cho_factor(H, lower=True), g)
        slope = float(g @ d)
        t = 1.0
        while True:
            f_new = value(w + t * d)
            if f_new <= f + 1e-4 * t * slope or t < 1e-12:
                break
            t *= 0.5
        if (not f_new < f and t < 1e-12) or (f_new >= f and np.linalg.norm(g) <= 1e3 * tol * g0):
            message = "no further decrease (float64 floor)"
            break
        w = w + t * d
        f, g = value_grad(w)
        it += 1
        if callback is not None and callback(w):
            message = "callback stop"
            break
    return w, {"iterations": it, "grad_norm": float(np.linalg.norm(g)), "message": message}
