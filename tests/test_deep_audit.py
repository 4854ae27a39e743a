"""The deep-net experiments (deepnet.py, deep_pipeline.py, audit.py; docs/findings.md §7): one's
own ImageFolder roots at 32 px with the defaults, the bounds checked before compute, the pipeline
over seeds, the audit."""

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import audit, common, deep_report, deepnet
from experiments.deep_pipeline import RunConfig, RunOptions, run_config
from pycore.deep import DeepOptions, ImmunizedNet, create_model, options, save_model
from pycore.deep.distributed import init_from_env

torch.set_num_threads(1)


def _one_line_error(capsys, module, argv):
    rc = module.main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return rc, err


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """deepnet.py with nothing but two ImageFolder roots of 32 px PNGs (two classes each, 4 + 2
    images a class; a colour channel tells the classes apart), --out and timm's small test network
    as --model."""
    from PIL import Image

    tmp, rng = tmp_path_factory.mktemp("own"), np.random.default_rng(0)
    for root, shift in (("dp", 0), ("dh", 1)):
        for split, n in (("train", 4), ("val", 2)):
            for c in range(2):
                (tmp / root / split / f"class{c}").mkdir(parents=True)
                for i in range(n):
                    a = rng.integers(0, 120, (32, 32, 3), dtype=np.uint8)
                    a[..., c + shift] += 120
                    Image.fromarray(a).save(tmp / root / split / f"class{c}" / f"{i}.png")
    dp, dh, out = tmp / "dp", tmp / "dh", tmp / "out"
    assert (
        deepnet.main(
            [
                "--dp-root",
                str(dp),
                "--dh-root",
                str(dh),
                "--out",
                str(out),
                "--quiet",
                "--model",
                "test_resnet",
            ]
        )
        == 0
    )
    return {
        "dp": dp,
        "dh": dh,
        "out": out / "folders",
        "result": json.loads((out / "folders" / "results.json").read_text()),
    }


def test_own_image_folders_run_end_to_end_with_the_defaults(folders):
    res, out = folders["result"], folders["out"]
    assert (
        set(res["rows"]) == {"init", "ours", "closed_form", "r_ill_only", "imma", "opt_kappa"}
        and not res["errors"]
    )
    assert res["run_config"]["model_kwargs"] == {"img_size": 32}  # θ₀ trained at the images' size
    for row in res["rows"].values():
        assert np.isfinite(row["rir_theta0"]["mean"]) and len(row["operators"]) == 7
    assert res["rows"]["init"]["dp_top1"]["mean"] > 75  # a θ₀ that learned D_P
    for name in (
        "table.md",
        "finetune.png",
        "operators.png",
        "extractor_init.safetensors",
        "extractor_ours.safetensors",
    ):
        assert (out / name).stat().st_size > 500, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_audit_reproduces_the_pipeline(folders, tmp_path):
    assert (
        audit.main(
            [
                "--model",
                str(folders["out"] / "extractor_ours.safetensors"),
                "--reference",
                str(folders["out"] / "extractor_init.safetensors"),
                "--out",
                str(tmp_path),
                "--quiet",
                "--dp-root",
                str(folders["dp"]),
                "--dh-root",
                str(folders["dh"]),
                "--epochs",
                "5",
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "results.json").read_text())
    pipe, got = folders["result"]["per_seed"][0]["rows"], res["per_seed"][0]["rows"]
    # The pipeline measured features computed once, the audit runs each model end to end: equal up
    # to
    # float32 rounding of the features (κ ratios: 1e-4 relative).
    for row, ref in (("model", "ours"), ("init", "init")):
        assert got[row]["dp_top1"] == pipe[ref]["dp_top1"]
        assert got[row]["rir"]["value"] == pytest.approx(pipe[ref]["rir"]["value"], rel=1e-4)
    assert res["rows"]["init"]["rir_theta0"]["per_seed"] == [1.0]  # θ₀ against itself: exactly 1
    assert (tmp_path / "audit.png").stat().st_size > 1000 and (
        tmp_path / "table.md"
    ).stat().st_size > 1000


def test_audit_errors_name_the_flag(folders, tmp_path, capsys):
    from safetensors.torch import save_file

    vit = ImmunizedNet(create_model("vit_tiny_patch16_224", 2, img_size=32, patch_size=8, depth=2))
    plain = tmp_path / "plain.safetensors"
    save_file(
        {k: v.contiguous() for k, v in create_model("resnet10t", 2).state_dict().items()},
        str(plain),
    )
    init, out = (
        str(folders["out"] / "extractor_init.safetensors"),
        ["--out", str(tmp_path / "o"), "--quiet"],
    )
    for argv, flag in (
        (
            ["--model", save_model(vit, tmp_path / "vit.safetensors"), "--reference", init],
            "--reference",
        ),
        (["--model", str(plain), "--reference", init], "--model"),  # no metadata, no name
        (["--model", init, "--reference", init, "--dh-root", str(folders["dh"])], "--dp-root"),
        (["--model", init, "--reference", init], "--model"),  # 2 classes; the digits: 5
        (["--model", init, "--reference", init, "--epochs", "1e9"], "--epochs"),
    ):
        rc, err = _one_line_error(capsys, audit, [*argv, *out])
        assert rc == 2 and f"error: {flag}:" in err, err


def test_audit_names_the_model_whose_features_are_not_finite(folders, tmp_path, capsys):
    from pycore.deep import load_model

    init = str(folders["out"] / "extractor_init.safetensors")
    m, _ = load_model(init)
    with torch.no_grad():
        m.layer.weight.fill_(3e38)  # finite weights, features that overflow float32
    bad = save_model(m, tmp_path / "overflow.safetensors")
    roots = ["--dp-root", str(folders["dp"]), "--dh-root", str(folders["dh"])]
    for argv, flag in (
        (["--model", bad, "--reference", init], "--model"),
        (["--model", init, "--reference", bad], "--reference"),
    ):
        rc, err = _one_line_error(capsys, audit, [*argv, *roots, "--out", str(tmp_path / "o")])
        assert rc == 1 and f"error: {flag}:" in err, err


def test_deepnet_has_a_flag_per_deep_option():
    parser = deepnet.build_parser()
    dests = {a.dest for a in parser._actions if a.option_strings}
    assert set(DeepOptions.names()) <= dests
    args = parser.parse_args(["--demo", "--balance", "none", "--no-nesterov", "--max-steps", "7"])
    given = common.given_options(args, DeepOptions.names())
    assert given == {"balance": None, "nesterov": False, "max_steps": 7}
    assert options(**given) == DeepOptions(balance=None, nesterov=False, max_steps=7)


def test_deepnet_refuses_bad_flags_before_any_compute(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(deepnet, "run_configs", lambda *a, **k: pytest.fail("computed"))
    roots = ["--dp-root", str(folders["dp"]), "--dh-root", str(folders["dh"])]
    init = str(folders["out"] / "extractor_init.safetensors")
    cases = [
        (["--threads", "100000"], "--threads"),
        (["--epochs", "1e20"], "--epochs"),
        (["--lr", "0"], "--lr"),
        (["--max-steps", "1e15"], "--max-steps"),
        (["--model", "no_such_net"], "--model"),
        (["--model", "deit_tiny_distilled_patch16_224"], "--model"),  # two tokens, two heads
        (["--img-size", "5"], "--img-size"),
        (["--config", "resnet18-cars"], "--checkpoint"),  # no θ₀
        (["--config", "resnet18-cars", "--pretrained", "--balance-ill", "2"], "--balance-ill"),
    ]
    for argv, flag in [([*roots, *a], f) for a, f in cases] + [
        (["--demo", "--dp-root", str(folders["dp"])], "--dp-root"),
        (["--config", "folders"], "--dp-root"),
        (["--demo", "--checkpoint", init], "--checkpoint"),
    ]:
        rc, err = _one_line_error(capsys, deepnet, [*argv, "--out", str(tmp_path)])
        assert rc == 2 and f"error: {flag}:" in err, err
    assert not list(tmp_path.iterdir())


def test_a_method_that_failed_is_named_in_the_outputs_and_exit_1(
    folders, tmp_path, capsys, monkeypatch
):
    res = json.loads(json.dumps(folders["result"]))
    del res["rows"]["ours"], res["per_seed"][0]["rows"]["ours"]
    res["errors"] = {
        "seed0": {
            "ours": {
                "message": "non-finite loss at step 3",
                "step": 3,
                "checkpoint": None,
                "parameter": "lr",
            }
        }
    }
    monkeypatch.setattr(deepnet, "run_configs", lambda *a, **k: [res])
    rc = deepnet.main(
        [
            "--dp-root",
            str(folders["dp"]),
            "--dh-root",
            str(folders["dh"]),
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "ours" in err
    assert "| Ours (Alg. 1) | failed" in (tmp_path / "folders" / "table.md").read_text()
    assert (
        json.loads((tmp_path / "folders" / "results.json").read_text())["errors"] == res["errors"]
    )


# --- the pipeline over seeds (the demo's, at CI size)
# ---------------------------------------------------

# fine-tuning: the folder run
CI = RunConfig(
    "ci",
    "test_resnet",
    "mnist",
    DeepOptions(epochs=1, max_steps=6, batch_size=16, adaptive_steps=200, harden="label_subspace"),
    model_kwargs={"img_size": 32},
    methods=("ours",),
    theta0_epochs=1,
    theta0_lr=2e-3,
    per_digit=30,
    rir_groups=4,
    rir_group_size=30,
    probe_epochs=5,
    eval_batch=128,
    attack_epochs=(1, 3),
    operators=("gd", "adam", "adam_whitened"),
    attack_train=48,
    attack_val=24,
)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    seen, cwd = [], os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        res = run_config(
            CI,
            [0, 1],
            RunOptions(quiet=True),
            init_from_env("cpu"),
            on_extractor=lambda m, row, seed, status: seen.append((row, seed)),
        )
        assert not list(Path().iterdir())  # the library wrote no file
    finally:
        os.chdir(cwd)
    return res, seen


def test_pipeline_aggregates_every_row_over_seeds(pipeline):
    res, seen = pipeline
    rows = res["rows"]
    assert list(rows) == ["init", "ours", "init+label_subspace", "ours+label_subspace"], res[
        "errors"
    ]
    assert set(seen) == {(r, s) for r in rows for s in (0, 1)}
    for k, seed_run in enumerate(res["per_seed"]):
        for m, row in seed_run["rows"].items():
            r = row["rir"]
            assert row["immunized"] == (r["harmful_ratio"] > 1 > r["pretrain_ratio"])
            assert rows[m]["rir_theta0"]["per_seed"][k] == row["rir"]["value"]
            adam = row["audit"]["operators"]["adam"]
            assert (
                rows[m]["operators"]["adam"]["mean_deficit"]["per_seed"][k] == adam["mean_deficit"]
            )
            assert (
                adam["reference"]
                == seed_run["rows"]["init"]["audit"]["operators"]["adam"]["model"]
            )
    for m, r in rows.items():
        assert r["immunized_count"] == sum(s["rows"][m]["immunized"] for s in res["per_seed"])
        per = r["dp_top1"]["per_seed"]
        assert (r["dp_top1"]["mean"], r["dp_top1"]["std"]) == pytest.approx(
            (np.mean(per), np.std(per))
        )
    assert rows["init"]["rir_theta0"]["per_seed"] == pytest.approx([1.0, 1.0], abs=1e-9)
    # hardening keeps D_P top-1
    assert rows["init+label_subspace"]["dp_top1"] == rows["init"]["dp_top1"]
    assert abs(rows["ours"]["rir_theta0"]["mean"] - 1) > 1e-6
    assert all(deep_report.label(m) in deep_report.table_markdown(res) for m in rows)


def test_the_balance_sweep_is_one_row_per_point_and_a_seed_gives_every_number_again(
    pipeline, tmp_path
):
    """A sweep point is the paper's loop at balance b; the sweep's seed 0 repeats the pipeline's
    seed 0 for θ₀ (trained, measured and attacked again): the same seed and thread count give
    every number again; seed 1 gives other numbers, so the comparison can fail."""
    res = run_config(
        replace(CI, sweep=((1.0, None), (1.0, 2.0))),
        [0],
        RunOptions(quiet=True),
        init_from_env("cpu"),
    )
    hard = ("", "+label_subspace")
    assert list(res["rows"]) == [r + h for h in hard for r in ("init", "ours@1", "ours@1/2")]
    assert res["rows"]["ours@1"]["rir_theta0"] != res["rows"]["ours@1/2"]["rir_theta0"]
    same = {"init" + h: "init" + h for h in hard}
    strip = lambda seed, names: json.dumps(
        [
            {k: v for k, v in seed["rows"][m].items() if k != "train"}  # noqa: E731
            for m in names
        ],
        sort_keys=True,
        default=str,
    )
    (s0, s1), again = pipeline[0]["per_seed"], res["per_seed"][0]
    assert strip(again, same.values()) == strip(s0, same) != strip(s1, same)
    deep_report.plot_tradeoff(res, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000 and "b = 1/2" in deep_report.table_markdown(
        res
    )


def test_an_interrupted_rerun_leaves_every_earlier_output_as_it_was(
    folders, tmp_path, monkeypatch, capsys
):
    """Outputs are written under temporary names and moved into place together at the end: a rerun
    interrupted after it wrote an extractor leaves the previous run's files byte for byte, and no
    temporary behind; a folder where any output goes (an extractor too) is refused before
    compute."""
    import shutil

    from pycore.deep import load_model

    out = tmp_path / "out"
    shutil.copytree(folders["out"], out / "folders")
    before = {p.name: p.read_bytes() for p in (out / "folders").iterdir()}
    model = load_model(out / "folders" / "extractor_ours.safetensors")[0]

    def interrupted(rcs, seeds, opts, ctx, *, on_extractor, jobs):
        with torch.no_grad():
            model.layer.weight.mul_(2.0)  # other weights than the earlier run's
        assert on_extractor(rcs[0])(model, "ours", seeds[0], "immunized")
        assert [p for p in (out / "folders").iterdir() if p.name.startswith(".")]
        raise KeyboardInterrupt

    monkeypatch.setattr(deepnet, "run_configs", interrupted)
    roots = ["--dp-root", str(folders["dp"]), "--dh-root", str(folders["dh"]), "--model"]
    argv = [*roots, "test_resnet", "--out", str(out), "--quiet"]
    assert deepnet.main(argv) == 130
    assert "interrupted" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (out / "folders").iterdir()} == before
    monkeypatch.setattr(deepnet, "run_configs", lambda *a, **k: pytest.fail("computed"))
    (out / "folders" / "extractor_imma.safetensors").unlink()
    (out / "folders" / "extractor_imma.safetensors").mkdir()
    rc, err = _one_line_error(capsys, deepnet, argv)
    assert rc == 2 and "error: --out:" in err and "extractor_imma" in err


def test_rows_operators_on_any_free_worker_give_every_number_again(pipeline):
    """``jobs = 2``: each seed immunizes in a worker and its rows' operators go to whichever
    worker is free, the model rebuilt there from θ₀ and the tensors that differ: the same
    numbers as in one process (seed 1 differs from seed 0, so the comparison can fail)."""
    from experiments.deep_pipeline import run_configs

    (res,) = run_configs([CI], [0, 1], RunOptions(quiet=True), init_from_env("cpu"), jobs=2)
    drop = lambda seed: json.dumps(  # noqa: E731
        {k: v for k, v in seed.items() if k != "phase_seconds"}, sort_keys=True, default=str
    )
    mine, ref = [drop(s) for s in res["per_seed"]], [drop(s) for s in pipeline[0]["per_seed"]]
    assert mine == ref and mine[0] != mine[1]
    assert res["phase_seconds"]["operators"]["cpu"] > 0


def test_an_operator_job_rebuilds_the_row_bit_for_bit():
    from experiments.deep_pipeline import OperatorJob, _changed, _saved

    theta0 = ImmunizedNet(create_model("test_resnet", 3, seed=0, img_size=32)).eval()
    row = ImmunizedNet(create_model("test_resnet", 3, seed=0, img_size=32)).eval()
    row.load_state_dict(theta0.state_dict())
    with torch.no_grad():
        row.layer.weight.mul_(1.5)
        row.classifier.bias.add_(0.25)
    changed = _changed(row, theta0)
    assert len(changed) == 2 and "layer.weight" in changed  # the head's bias is the other
    job = OperatorJob(CI, 0, "ours", _saved(theta0), changed, None, ())
    rebuilt = job.model().state_dict()
    assert all(torch.equal(rebuilt[k], v) for k, v in row.state_dict().items())
    assert not torch.equal(rebuilt["layer.weight"], theta0.state_dict()["layer.weight"])
    assert _changed(theta0, theta0) == {}
    # another structure: no difference to send, the row is sent whole
    assert _changed(ImmunizedNet(create_model("test_resnet", 4, seed=0)), theta0) is None
