"""Deep-net immunization of any timm model (pycore.deep; docs/design.md §3, docs/findings.md §7):
random-init timm models at 32 px, a few steps each."""

import copy
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pycore._ops as _ops
from pycore import ParameterError, limits
from pycore.deep import (
    AttackData,
    CheckpointError,
    DataError,
    DeepOptions,
    ImmunizedNet,
    NonFiniteLossError,
    PretrainedUnavailableError,
    audit_model,
    create_model,
    image_folder,
    immunize_model,
    load_model,
    save_model,
)
from pycore.deep._checkpoint import CheckpointMismatchError, read_weights
from pycore.deep._data import fetch
from pycore.deep._features import prelogits_dataset
from pycore.deep._models import tail_modules
from pycore.deep._objectives import imma_harmful_loss, log_kappa, loss_terms
from pycore.deep._operators import Schedule, budgets
from pycore.deep._train import balanced_lambdas, immunize_in_place

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _data(n, seed, classes=3):
    """32 px images whose class shifts their mean: learnable, and random enough to be well
    conditioned."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    return torch.randn(n, 3, 32, 32, generator=g) + 0.5 * y.view(-1, 1, 1, 1).float(), y


def _layer_setup(n=48):
    m = ImmunizedNet(create_model("resnet10t", 3, seed=0)).eval()
    return m, *(prelogits_dataset(m, TensorDataset(*_data(n, s))) for s in (10, 11))


# --- any timm model ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,kw",
    [
        ("resnet10t", {}),
        ("mobilenetv3_small_050", {}),
        ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2}),
    ],
)
def test_the_layer_sits_between_timms_prelogits_and_classifier(name, kw):
    net = create_model(name, 4, seed=0, **kw).eval()
    m = ImmunizedNet(copy.deepcopy(net)).eval()
    x = _data(3, 1)[0]
    with torch.no_grad():
        torch.testing.assert_close(m(x), net(x))  # identity layer: θ₀ unchanged
        m.layer.weight.add_(0.05 * torch.randn_like(m.layer.weight))
        z = m.forward_head(m.forward_features(x), pre_logits=True)
        torch.testing.assert_close(z, m.prelogits(x) @ m.layer.weight.T)
        torch.testing.assert_close(m(x), m.get_classifier()(z))
        m.reset_classifier(7)  # an attacker's new head keeps the layer
        torch.testing.assert_close(m.forward_head(m.forward_features(x), pre_logits=True), z)
    assert ImmunizedNet(net.to("meta")).layer.weight.device.type == "meta"  # on the model's device


# --- the facade ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet10t", "mobilenetv3_small_050"])
def test_immunize_model_and_audit_model_on_any_timm_model(name):
    model = create_model(name, 3, seed=0)  # seeded: the D_P guard may keep step 0 of a random one
    before = copy.deepcopy(model.state_dict())
    out = immunize_model(model, _data(48, 1), TensorDataset(*_data(48, 2)), adaptive_steps=20)
    assert out.steps <= 20 and out.reason
    assert out.immunized == (out.harmful_ratio > 1 > out.pretrain_ratio > 0)
    # a copy was immunized
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert out.model(_data(2, 3)[0]).shape == (2, 3)
    sgd = immunize_model(model, _data(48, 1), _data(48, 2), rule="sgd", max_steps=4)
    assert sgd.steps == 4 and np.isfinite(sgd.history["loss"]).all()
    ops = ("gd", "adam", "adam_whitened", "finetune_upper")
    acc = audit_model(out.model, reference=model, dh=_data(30, 4), max_steps=2, operators=ops)
    assert acc.path.names() == list(ops) and acc.worth.cheapest_operator in ops
    assert all(c.cost.per_step > 0 and c.flops > 0 for c in acc.path.operators)


def test_the_d_p_guard_ends_on_a_state_that_kept_d_p():
    """Defaults keep D_P top-1 within dp_tolerance (2 points) of the given model's: here an
    aggressive rule takes it to chance (33 %) without the guard, and the guard ends on the last
    state within 2 points."""
    model = create_model("resnet10t", 3, seed=0).eval()
    x, y = _data(96, 1)
    with torch.no_grad():
        f = model.forward_head(model.forward_features(x), pre_logits=True)
    opt = torch.optim.Adam(model.get_classifier().parameters(), lr=1e-2)
    for _ in range(100):  # a head trained briefly
        opt.zero_grad()
        F.cross_entropy(model.get_classifier()(f), y).backward()
        opt.step()
    top1 = lambda m: 100 * float((m(x).detach().argmax(1) == y).float().mean())  # noqa: E731
    rule = dict(method="r_ill_only", lr=0.3, balance=3.0, max_steps=30)
    guarded = immunize_model(model, (x, y), _data(96, 2), **rule)
    free = immunize_model(model, (x, y), _data(96, 2), dp_tolerance=None, **rule)
    assert (
        top1(guarded.model) >= top1(model) - 2
        and guarded.reason
        and top1(free.model) < top1(model) - 10
    )


def test_facade_errors_name_the_option(monkeypatch):
    for name, n, kwargs, param in (
        ("no_such_net", 3, {}, "model"),
        ("resnet10t", 0, {}, "num_classes"),
        ("resnet10t", 3, {"pretrained_cfg_overlay": 1}, "pretrained_cfg_overlay"),
    ):
        with pytest.raises(ParameterError) as e:
            create_model(name, n, **kwargs)
        assert e.value.parameter == param
    import timm  # after pycore.deep (docs/design.md §5)

    model = timm.create_model("resnet10t", num_classes=3)
    for opts, param in (
        ({"config": {"epochs": 5}}, "config"),
        ({"lr": -1.0}, "lr"),
        ({"epochs": 1e20}, "epochs"),
        ({"scope": "all"}, "scope"),
        ({"max_steps": 10**15}, "max_steps"),
    ):
        with pytest.raises(ParameterError) as e:
            immunize_model(model, _data(8, 1), _data(8, 2), **opts)
        assert e.value.parameter == param
    with pytest.raises(NonFiniteLossError) as e:
        immunize_model(model, _data(32, 1), _data(32, 2), rule="sgd", lr=1e30, max_steps=20)
    assert e.value.parameter == "lr" and e.value.step >= 1
    with pytest.raises(ParameterError) as e:
        audit_model(model, reference=model, dh=_data(8, 1), epoch=3)
    assert e.value.parameter == "epoch"
    with pytest.raises(DataError):
        immunize_model(model, _data(8, 1)[0], _data(8, 2))
    monkeypatch.setattr(
        timm, "create_model", lambda *a, **k: (_ for _ in ()).throw(OSError("offline"))
    )
    with pytest.raises(PretrainedUnavailableError):
        create_model("resnet10t", 3, pretrained=True)


# --- checkpoints --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m = ImmunizedNet(create_model("resnet10t", 3, seed=0)).eval()
    with torch.no_grad():
        m.layer.weight.add_(0.05 * torch.randn_like(m.layer.weight))
    return m, Path(
        save_model(m, tmp_path_factory.mktemp("ckpt") / "m.safetensors", extra={"seed": 0})
    )


def test_checkpoints_round_trip_and_are_read_by_content(saved, tmp_path):
    m, path = saved
    x = _data(2, 5)[0]
    torch.testing.assert_close(load_model(path)[0](x), m(x))
    (tmp_path / "named.PT").write_bytes(path.read_bytes())  # safetensors under a torch name
    torch.testing.assert_close(load_model(tmp_path / "named.PT")[0](x), m(x))
    sd = {"module." + k: v for k, v in m.net.state_dict().items()}  # DDP's prefix
    torch.save({"state_dict": sd}, tmp_path / "t.safetensors")
    # a torch zip under a safetensors name
    plain, _ = load_model(tmp_path / "t.safetensors", "resnet10t")
    torch.testing.assert_close(plain.net(x), m.net(x))
    with pytest.raises(CheckpointMismatchError):
        load_model(tmp_path / "t.safetensors", "resnet18")
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "t.safetensors")  # no metadata, no architecture


def test_bad_checkpoints_are_one_clear_error(saved, tmp_path):
    from safetensors.torch import save_file

    sd, meta = read_weights(saved[1])
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pt")
    torch.save(sd, tmp_path / "full.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "full.pt").read_bytes()[:5000])
    save_file({k: torch.zeros_like(v) for k, v in sd.items()}, str(tmp_path / "zero.safetensors"))
    w = sd["net.fc.weight"]
    # a cast would drop a part
    for name, change in (
        ("nan", {"layer.weight": sd["layer.weight"] * float("nan")}),
        ("complex", {"net.fc.weight": torch.complex(w, w)}),
    ):
        save_file({**sd, **change}, str(tmp_path / f"{name}.safetensors"), meta)
    for i, (key, value) in enumerate(
        (
            ("model_kwargs", '{"pretrained_cfg_overlay": {"file": "/etc/passwd"}}'),
            ("model", "my_net"),
            ("num_classes", "1e8"),
            ("model_kwargs", "{not"),
        )
    ):
        save_file(sd, str(tmp_path / f"meta{i}.safetensors"), {**meta, key: value})
    names = [
        "evil.pt",
        "cut.pt",
        "zero.safetensors",
        "nan.safetensors",
        "complex.safetensors",
        *(f"meta{i}.safetensors" for i in range(4)),
    ]
    for name in names:
        with pytest.raises(CheckpointError) as e:
            load_model(tmp_path / name)
        assert name in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
    for bad in (tmp_path, "/dev/zero"):
        with pytest.raises(CheckpointError):
            read_weights(bad)


def test_a_checkpoint_that_changes_while_read_is_an_error_never_a_signal(
    saved, tmp_path, monkeypatch
):
    """A memory-mapped read died of SIGBUS (the whole process) when the file shrank underneath; the
    file is read once into memory and its size checked against the size it had when opened."""
    import builtins

    path = tmp_path / "shrinking.safetensors"
    path.write_bytes(Path(saved[1]).read_bytes())
    real = builtins.open

    def shrink_then_open(file, mode="r", *a, **k):  # another process cuts the file first
        if os.fspath(file) == str(path) and "r" in mode:
            os.truncate(path, path.stat().st_size - 10)
        return real(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", shrink_then_open)
    with pytest.raises(CheckpointError, match=path.name):
        read_weights(path)


# --- images -------------------------------------------------------------------------------------


def _folder(root, classes, per_class):
    from PIL import Image

    for c in range(classes):
        (root / "train" / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(np.full((32, 32, 3), 60 * c + i, np.uint8)).save(
                root / f"train/c{c}/{i}.png"
            )
    return root


def _one_of_each(root, images):
    """``root/train/c0/`` and ``c1/``, one image of ``images`` ({file name: PIL image}) each in
    turn, as an :func:`image_folder` for resnet10t, and each file's index in it."""
    for i, (name, img) in enumerate(images.items()):
        (root / "train" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        img.save(root / "train" / f"c{i % 2}" / name)
    ds = image_folder(root, "train", create_model("resnet10t", 2))
    return ds, {Path(f).name: k for k, (f, _) in enumerate(ds.samples)}


def test_16_bit_and_float_images_are_scaled_not_clipped(tmp_path):
    from PIL import Image

    gray = np.random.default_rng(1).integers(0, 256, (32, 32), dtype=np.uint8)
    images = {
        "a8.png": Image.fromarray(gray),
        "b8.png": Image.fromarray(gray),
        "a16.png": Image.fromarray(gray.astype(np.uint16) * 257),  # the same picture, 16 bits
        "af.tiff": Image.fromarray(gray.astype(np.float32) / 255),
        "big.tiff": Image.fromarray(gray.astype(np.float32)),  # floats beyond [0, 1]
        "c8.png": Image.fromarray(gray),
    }
    ds, at = _one_of_each(tmp_path, images)
    for name in ("a16.png", "af.tiff"):
        torch.testing.assert_close(ds[at[name]][0], ds[at["a8.png"]][0], atol=1e-5, rtol=0)
    with pytest.raises(DataError, match="big.tiff"):
        ds[at["big.tiff"]]


def test_elongated_or_huge_images_are_refused_before_decoding(tmp_path, monkeypatch):
    from PIL import Image

    images = {f"{n}.png": Image.new("L", (20, 20)) for n in ("a", "b", "c")}
    ds, at = _one_of_each(tmp_path, {"long.png": Image.new("L", (20000, 1)), **images})
    monkeypatch.setattr(Image.Image, "convert", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(DataError, match="long.png"):
        ds[at["long.png"]]
    monkeypatch.setattr(limits, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError, match="a.png"):
        ds[at["a.png"]]


def test_degenerate_image_folders_are_refused_naming_the_folder(tmp_path):
    model = create_model("resnet10t", 2)
    side = model.pretrained_cfg["input_size"][1]
    ds = image_folder(_folder(tmp_path / "ok", 2, 2), "train", model)
    # the model's size
    assert len(ds) == 4 and fetch(ds, torch.arange(4))[0].shape == (4, 3, side, side)
    for root, classes, per, where in (
        (tmp_path / "one", 2, 1, "c0"),
        (tmp_path / "single", 1, 3, "train"),
    ):
        with pytest.raises(DataError, match=where):
            image_folder(_folder(root, classes, per), "train", model)
    loop = _folder(tmp_path / "loop", 2, 2)
    os.symlink(loop / "train" / "c1", loop / "train" / "c1" / "again")  # c1 would be read 40 times
    with pytest.raises(DataError, match="again"):
        image_folder(loop, "train", model)


# --- the loop -----------------------------------------------------------------------------------


def test_loss_terms_use_the_op_and_precondition_only_the_regularizers():
    m, dp, dh = _layer_setup()
    m.set_trainable()
    XP, yP, XH, yH = dp.tensors[0][:8], dp.tensors[1][:8], dh.tensors[0][:8], dh.tensors[1][:8]
    m.layer.lambda_reg = 1e-3
    t = loss_terms(m, "ours", XP, yP, XH, yH, 3)
    ref = _ops.reference_cond_regularizer(m.layer(XH).double(), "ill")
    torch.testing.assert_close(t["r_ill"], ref, rtol=1e-8, atol=0)
    t["ce"].backward(retain_graph=True)
    W = m.layer.weight.detach().clone().requires_grad_(True)
    (gW,) = torch.autograd.grad(
        F.cross_entropy(m.classifier(XP @ W.T), yP, label_smoothing=0.1), W
    )
    # CE: the plain gradient
    torch.testing.assert_close(m.layer.weight.grad, gW, rtol=1e-4, atol=1e-7)
    m.zero_grad()
    t["r_ill"].backward()
    X, W = XH.double(), m.layer.weight.detach().double().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_ops.reference_cond_regularizer(X @ W.T, "ill"), W)
    want = g @ torch.linalg.inv(X.T @ X + 1e-3 * torch.eye(X.shape[1], dtype=torch.float64))
    got = m.layer.weight.grad.double()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3 * float(abs(want).max()))


def test_log_kappa_and_the_imma_lower_level():
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(6, 10, generator=g, dtype=torch.float64, requires_grad=True)
    s = np.linalg.svd(Z.detach().numpy(), compute_uv=False)
    assert abs(float(log_kappa(Z).detach()) - 2 * np.log(s[0] / s[-1])) < 1e-9
    y = torch.randint(0, 3, (6,), generator=g)
    l0, l3 = (imma_harmful_loss(Z, y, 3, steps=k, inner_lr=1.0) for k in (0, 3))
    assert abs(float(l0.detach()) - np.log(3)) < 1e-12 and float(l3.detach()) < float(l0.detach())
    l3.backward()  # unrolled: differentiable
    assert torch.isfinite(Z.grad).all() and Z.grad.abs().sum() > 0


def test_layer_scope_moves_only_the_layer_and_the_classifier_and_balances_every_step():
    m, dp, dh = _layer_setup()
    before = copy.deepcopy(m.state_dict())
    opts = DeepOptions(rule="sgd", max_steps=3, batch_size=16, dp_tolerance=None)
    res = immunize_in_place(m, dp, dh, "ours", opts, num_classes_h=3, cached=True)
    assert {k for k in before if not torch.equal(before[k], m.state_dict()[k])} == {
        "layer.weight",
        "net.fc.weight",
        "net.fc.bias",
    }
    assert res.steps == 3 and len(set(res.history["lambda_h"])) == 3  # re-balanced at every step
    m.set_trainable()
    t = loss_terms(
        m, "ours", dp.tensors[0][:8], dp.tensors[1][:8], dh.tensors[0][:8], dh.tensors[1][:8], 3
    )
    ext = [m.layer.weight]
    lam = balanced_lambdas(t, ext, 0.5, weights={"lambda_h": 2.0})
    norm = lambda v: float(torch.autograd.grad(v, ext, retain_graph=True)[0].double().norm())  # noqa: E731
    assert lam["lambda_h"] * norm(t["r_ill"]) == pytest.approx(2.0 * norm(t["ce"]), rel=1e-9)
    assert lam["lambda_p"] * norm(t["r_well"]) == pytest.approx(0.5 * norm(t["ce"]), rel=1e-9)


def test_a_non_finite_step_is_not_applied():
    m, dp, dh = _layer_setup()
    opts = DeepOptions(max_steps=30, batch_size=16, lr=1e8, balance=None, lambda_h=1e12)
    with pytest.raises(NonFiniteLossError) as e:
        immunize_in_place(m, dp, dh, "r_ill_only", opts, num_classes_h=3, cached=True)
    step = e.value.step
    assert (
        step >= 1
        and e.value.parameter == "lr"
        and all(torch.isfinite(p).all() for p in m.parameters())
    )
    m2, dp2, dh2 = _layer_setup()
    immunize_in_place(
        m2, dp2, dh2, "r_ill_only", replace(opts, max_steps=step), num_classes_h=3, cached=True
    )
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)  # exactly the last good step


def test_tail_scope_trains_the_papers_stages_from_images():
    v = create_model("vit_tiny_patch16_224", 3, seed=0, img_size=32, patch_size=8, depth=3)
    r = create_model("resnet18", 3, seed=0)
    assert tail_modules(v, 1)[:2] == [v.blocks[-1], v.norm] and tail_modules(r, 2)[:2] == [
        r.layer3,
        r.layer4,
    ]
    m = ImmunizedNet(create_model("resnet10t", 3, seed=0)).eval()  # the same stage names, smaller
    before = copy.deepcopy(m.state_dict())
    immunize_in_place(
        m,
        TensorDataset(*_data(16, 1)),
        TensorDataset(*_data(16, 2)),
        "ours",
        DeepOptions(rule="sgd", max_steps=2, batch_size=8, lr=1e-3, scope="tail", stages=2),
        num_classes_h=3,
    )
    assert {k.split(".")[1] for k in before if not torch.equal(before[k], m.state_dict()[k])} == {
        "layer3",
        "layer4",
        "fc",
        "weight",
    }


# --- attackers ----------------------------------------------------------------------------------


def test_fine_tuning_learns_and_leaves_the_model_alone():
    m = ImmunizedNet(create_model("test_resnet", 3, seed=0)).eval()
    state = copy.deepcopy(m.state_dict())
    h = TensorDataset(*_data(24, 12))
    sch = Schedule(batch_size=8, min_steps=24, deep_max_steps=24)
    b, _ = budgets(m, AttackData(h, h, h, 3), ("finetune_upper",), schedule=sch)["finetune_upper"]
    # chance is 33 %
    assert b.plateau > 60 and b.test_at_plateau > 60
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())


# --- distributed --------------------------------------------------------------------------------


def _ddp_run(nan=False, **kw):
    m = ImmunizedNet(create_model("resnet10t", 3, seed=0))
    if nan:
        m.layer.register_forward_hook(lambda mod, args, out: out * float("nan"))
    res = immunize_in_place(
        m,
        TensorDataset(*_data(32, 10)),
        TensorDataset(*_data(32, 11)),
        "ours",
        DeepOptions(
            rule="sgd", max_steps=2, batch_size=4, lr=1e-3, scope="tail", **kw.pop("opts", {})
        ),
        num_classes_h=3,
        **kw,
    )
    return m, res


def _ddp_worker(rank, port, out):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from pycore.deep._distributed import init_from_env, shutdown

    ctx = init_from_env("cpu")
    m, res = _ddp_run(rank=ctx.rank, world=ctx.world, ddp=True)
    try:  # then rank 1 alone gets a non-finite loss: its layer's outputs NaN
        _ddp_run(rank=ctx.rank, world=ctx.world, ddp=True, nan=rank == 1)
        stop = "returned"
    except NonFiniteLossError as exc:
        stop = exc.step
    torch.save(
        {
            "state": m.state_dict(),
            "loss": res.history["loss"],
            "lambdas": res.lambdas,
            "stop": stop,
        },
        f"{out}.{rank}",
    )
    shutdown()


def _ddp_pair(port: int, out: str) -> list:
    """Both ranks' exit codes: two workers forked from this process (a fresh interpreter: see the
    test), joined."""
    fork = torch.multiprocessing.get_context("fork")  # the workers need no new torch import
    workers = [fork.Process(target=_ddp_worker, args=(r, port, out)) for r in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    return [w.exitcode for w in workers]


def test_ddp_gloo_two_processes_match_virtual_ranks_and_stop_together(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the ranks fork from a fresh interpreter, not from this one: a fork inherits whatever
    # threads and state earlier tests left here (torch's OpenMP team hangs a forked child)
    code = (
        "import sys\nfrom tests.test_deepnet import _ddp_pair\n"
        f"codes = _ddp_pair({port}, {str(tmp_path / 'ddp')!r})\n"
        "print(codes)\nsys.exit(0 if codes == [0, 0] else 1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    got = [torch.load(f"{tmp_path / 'ddp'}.{r}", weights_only=True) for r in (0, 1)]
    assert got[0]["stop"] == got[1]["stop"] == 0  # NaN on one rank: both stop at step 0
    m, res = _ddp_run(opts={"virtual_ranks": 2})
    # λ's from all-reduced gradients
    assert got[0]["lambdas"] == pytest.approx(res.lambdas, rel=1e-6)
    assert got[0]["loss"] == pytest.approx(res.history["loss"], rel=1e-5)
    for k, v in m.state_dict().items():
        torch.testing.assert_close(got[0]["state"][k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_fetch_decodes_in_a_forked_child_after_the_parent_has_decoded():
    """A forked worker (``--jobs``) inherits the decoding thread pool without its threads; it
    gets a pool of its own instead of waiting forever."""
    import multiprocessing

    from pycore.deep._data import fetch

    class Decoded(torch.utils.data.Dataset):  # not a TensorDataset: fetch uses its pool
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.full((2,), float(i)), i % 3

    ds = Decoded()
    assert fetch(ds, torch.arange(6))[1].tolist() == [0, 1, 2, 0, 1, 2]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=lambda: queue.put(fetch(ds, torch.arange(6))[1].tolist()))
    child.start()
    child.join(60)
    hung = child.is_alive()
    child.kill()
    assert not hung and queue.get(timeout=10) == [0, 1, 2, 0, 1, 2]
