"""The deep-net experiments (deep_pipeline.py, deep_report.py, deepnet.py, audit.py;
docs/findings.md §7) at test size: a tiny configuration end to end over the bundled digits, in one
process and in worker processes; one's own ImageFolder roots through deepnet.py; audit.py on the
pipeline's own extractors; the flags checked before compute."""

import json
import os
import re
import subprocess
import sys
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import audit, common, deep_configs, deep_report, deepnet
from experiments.deep_pipeline import Row, RunConfig, RunOptions, Sizes, run_configs
from pycore.deep import (
    DataError,
    DeepOptions,
    ImmunizedNet,
    SimulatedOptions,
    create_model,
    load_model,
    save_model,
)
from pycore.deep._deep_options import options
from pycore.deep._distributed import init_from_env
from pycore.deep._operators import Schedule
from pycore.report import dumps_json
from tests.cli_helpers import call, one_line
from tests.helpers import image_root, lying_checkpoint

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

SCHEDULE = Schedule(batch_size=8, min_steps=5, probe_max_steps=20, deep_max_steps=4)
# MNIST 0-4 vs 5-9 at 32 px on timm's test ResNet: a layer-only row and a tail row, four
# operators (a probe, the layer's removal, the retrain of the last stage, scratch), the D_P
# fine-tuning check and the attacker with twice the images
TINY = RunConfig(
    "tiny",
    "test_resnet",
    "mnist",
    rows=(
        Row("closed_form", "closed_form", DeepOptions(normalize=False), "Closed-form layer"),
        Row(
            "simulated",
            "simulated",
            SimulatedOptions(steps=2, inner_steps=1, batch_size=8, check_every=1),
            "Simulated attackers",
        ),
    ),
    model_kwargs={"img_size": 32},
    theta0_epochs=1,
    theta0_lr=2e-3,
    sizes=Sizes(defense=32, dp_val=16, attack_train=16, attack_val=8, attack_test=8, more_data=2),
    rir_groups=2,
    rir_group_size=16,
    probe_epochs=5,
    eval_batch=64,
    operators=("gd", "remove_layer", "retrain_last1", "scratch"),
    schedule=SCHEDULE,
    scratch_max_steps=6,
)
OPS = ",".join(TINY.operators)


def _one_line_error(capsys, module, argv):
    rc = module.main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return rc, err


def _json(result):
    """``result`` as results.json holds it (NaN written as a marked string)."""
    return json.loads(dumps_json(result))


def _timeless(seed: dict) -> str:
    """A seed's results without what the clock measured and where extractors were saved."""
    out = {k: v for k, v in _json(seed).items() if k != "phase_seconds"}
    for r in (out["theta0"], *out["rows"].values()):
        r["train"] = {k: v for k, v in r.get("train", {}).items() if k != "seconds"}
        r["extractor"] = None
    return json.dumps(out, sort_keys=True)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """TINY over seed 0 in this process; the extractors it hands out are saved (for audit.py)."""
    folder, seen, cwd = tmp_path_factory.mktemp("extractors"), [], os.getcwd()

    def keep(model, row, seed, status):
        seen.append((row, seed, status))
        return save_model(model, folder / f"{row}.safetensors")

    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        (res,) = run_configs(
            [TINY],
            [0],
            RunOptions(quiet=True),
            init_from_env("cpu"),
            on_extractor=lambda rc: keep,
        )
        assert not list(Path().iterdir())  # the library wrote no file
    finally:
        os.chdir(cwd)
    return res, seen, folder


def test_results_hold_every_rows_worth_per_seed_and_every_operators_cost(pipeline, tmp_path):
    res, seen, _ = pipeline
    assert list(res["rows"]) == ["init", "closed_form", "simulated"] and not res["errors"]
    assert sorted(seen) == [(r, 0, "immunized") for r in ("closed_form", "init", "simulated")]
    (seed,) = res["per_seed"]
    ref = seed["reference"]
    assert list(ref["path"]["operators"]) == list(TINY.operators)
    assert res["attacker"]["batch_size"] == 8 and res["attacker"]["image_side"] == 32
    theta0 = res["theta0"]["attack"]
    assert theta0["target"] == [ref["target"]] and theta0["cap"] == [ref["cap"]]
    for name in ("closed_form", "simulated"):
        row, mine = res["rows"][name], seed["rows"][name]["judged"]
        assert row["judged"]["worth"]["per_seed"] == [mine["worth"]]
        assert row["judged"]["headroom_share"]["per_seed"] == [mine["headroom_share"]]
        assert row["judged"]["cheapest_operator"] == [mine["cheapest_operator"]]
        assert set(row["judged"]["operators"]) == set(mine["operators"]) == set(TINY.operators)
        for op, c in row["judged"]["operators"].items():
            assert c["flops_to_target"] == [mine["operators"][op]["flops_to_target"]]
        # worth is the row's cheapest cost over θ₀'s
        if not mine["cheapest_censored"]:
            assert mine["worth"] == pytest.approx(
                mine["cheapest_flops"] / ref["path"]["cheapest_flops"]
            )
        assert mine["operators"]["scratch"] == ref["path"]["operators"]["scratch"]
        assert row["dp_top1"]["per_seed"] == [seed["rows"][name]["dp_top1"]]
        assert row["dp_finetune_slowdown"]["per_seed"] == [
            seed["rows"][name]["dp_finetune"]["slowdown"]
        ]
        assert set(row["more_data"]["operators"]) == set(TINY.operators)
    # the layer-only row: the layer's removal is θ₀'s own Adam probe, step for step
    removed = seed["rows"]["closed_form"]["judged"]["operators"]["remove_layer"]
    base = ref["path"]["operators"]["remove_layer"]
    assert removed["steps_to_target"] == base["steps_to_target"]
    # the tail row changed only the last stage: its retrain runs as on θ₀ and is taken from it
    assert list(seed["rows"]["simulated"]["retrain_scope"]) == ["layer4", "global_pool"]
    retrain = seed["rows"]["simulated"]["judged"]["operators"]["retrain_last1"]
    assert (
        retrain["steps_to_target"] == ref["path"]["operators"]["retrain_last1"]["steps_to_target"]
    )
    assert res["rows"]["init"]["rir_theta0"]["per_seed"] == [1.0]  # θ₀ against itself
    table = deep_report.table_markdown(res)
    assert all(deep_report.label(res, m) in table for m in res["rows"])
    for plot in (deep_report.plot_probing, deep_report.plot_operators, deep_report.plot_frontier):
        plot(res, tmp_path / "p.png")
        assert (tmp_path / "p.png").stat().st_size > 1000


def test_worker_processes_give_every_number_again(pipeline, monkeypatch):
    """``jobs = 2``: θ₀ and its budgets in one worker, each row in whichever worker is free: the
    same numbers as in one process; the workers are spawned (a forked one hung on torch's OpenMP
    threads: tests/test_pool.py)."""
    starts, chain = [], common.pool_chain

    def spy(*a, **k):
        starts.append(k.get("start", "fork"))
        return chain(*a, **k)

    monkeypatch.setattr(common, "pool_chain", spy)
    (res,) = run_configs([TINY], [0], RunOptions(quiet=True), init_from_env("cpu"), jobs=2)
    assert starts == ["spawn"]
    assert [_timeless(s) for s in res["per_seed"]] == [
        _timeless(s) for s in pipeline[0]["per_seed"]
    ]
    assert res["rows"].keys() == pipeline[0]["rows"].keys()
    assert res["phase_seconds"]["operators"]["cpu"] > 0


# --- audit.py -----------------------------------------------------------------------------------


@pytest.fixture
def tiny_demo(monkeypatch):
    """audit.py's images without roots are the demo's: at TINY's sizes here."""
    monkeypatch.setitem(deep_configs.CONFIGS, "demo-full-resnet18", TINY)


def test_audit_reproduces_the_pipeline(pipeline, tiny_demo, tmp_path):
    """The simulated row's extractor against θ₀'s: the same splits, budgets and slowdowns as the
    pipeline measured, the features computed end to end (κ ratios to float32 round-off)."""
    _, _, folder = pipeline
    argv = ["--model", str(folder / "simulated.safetensors")]
    argv += ["--reference", str(folder / "init.safetensors"), "--operators", OPS]
    argv += ["--max-steps", str(SCHEDULE.deep_max_steps), "--out", str(tmp_path), "--quiet"]
    assert audit.main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert list(res["rows"]) == ["init", "model"]
    (got,), (want,) = res["per_seed"], _json(pipeline[0]["per_seed"])
    assert got["reference"] == want["reference"]
    model, row = got["rows"]["model"], want["rows"]["simulated"]
    assert model["judged"] == row["judged"]
    assert model["dp_top1"] == row["dp_top1"] and model["retrain_scope"] == row["retrain_scope"]
    assert model["rir"] == pytest.approx(row["rir"], rel=1e-4)
    simulated = _json(pipeline[0]["rows"]["simulated"])
    assert res["rows"]["model"]["judged"] == simulated["judged"]
    assert (tmp_path / "audit.png").stat().st_size > 1000


def test_audit_errors_name_the_flag_before_any_compute(
    pipeline, tiny_demo, tmp_path, capsys, monkeypatch
):
    from safetensors.torch import save_file

    monkeypatch.setattr(audit, "audit_seed", lambda *a, **k: pytest.fail("computed"))
    init = str(pipeline[2] / "init.safetensors")
    vit = ImmunizedNet(create_model("vit_tiny_patch16_224", 5, img_size=32, patch_size=8, depth=1))
    plain = tmp_path / "plain.safetensors"
    save_file(
        {k: v.contiguous() for k, v in create_model("test_resnet", 5).state_dict().items()},
        str(plain),
    )
    two = save_model(ImmunizedNet(create_model("test_resnet", 2, seed=0)), tmp_path / "two.st")
    out = ["--out", str(tmp_path / "o"), "--quiet"]
    for argv, flag in (
        (
            ["--model", save_model(vit, tmp_path / "vit.safetensors"), "--reference", init],
            "--reference",
        ),
        (["--model", str(plain), "--reference", init], "--model"),  # no metadata, no name
        (["--model", init, "--reference", init, "--dh-root", str(tmp_path)], "--dp-root"),
        (["--model", two, "--reference", two], "--model"),  # 2 classes; the digits: 5
        (["--model", init, "--reference", init, "--max-steps", "1e9"], "--max-steps"),
        (["--model", init, "--reference", init, "--operators", "gd,lbfgs"], "--operators"),
        (["--model", init, "--reference", init, "--epochs", "3"], "--epochs"),  # gone
        (["--model", init, "--reference", init, "--img-size", "64"], "--img-size"),  # no backbone
        (
            ["--model", init, "--reference", init, "--dp-root", str(tmp_path)]
            + ["--dh-root", str(tmp_path)],
            "--dh-root",
        ),
        # TINY's defense has 32 rows per task: groups of 33 cannot be drawn
        (["--model", init, "--reference", init, "--rir-group-size", "33"], "--rir-group-size"),
    ):
        rc, err = _one_line_error(capsys, audit, [*argv, *out])
        assert rc == 2 and flag in err, err


def test_audit_names_the_model_whose_features_are_not_finite(
    pipeline, tiny_demo, tmp_path, capsys
):
    init = str(pipeline[2] / "init.safetensors")
    m, _ = load_model(init)
    with torch.no_grad():
        m.layer.weight.fill_(3e38)  # finite weights, features that overflow float32
    bad = save_model(m, tmp_path / "overflow.safetensors")
    for argv, flag in (
        (["--model", bad, "--reference", init], "--model"),
        (["--model", init, "--reference", bad], "--reference"),
    ):
        argv += ["--operators", "gd", "--out", str(tmp_path / "o")]
        rc, err = _one_line_error(capsys, audit, argv)
        assert rc == 1 and f"error: {flag}:" in err, err


def test_audit_names_the_flag_of_a_checkpoint_whose_metadata_lies(capsys, tmp_path):
    evil = lying_checkpoint(tmp_path / "evil.safetensors", depth=100000)
    argv = ["--model", str(evil), "--reference", str(evil), "--out", str(tmp_path / "o")]
    rc, err = call(capsys, audit, argv)
    assert rc == 2 and one_line(err, "--model", "evil.safetensors")


# --- deepnet.py on one's own ImageFolder roots --------------------------------------------------


def small_folders():
    """The "folders" configuration with its sizes and schedule cut to a few images."""
    return replace(
        deep_configs.CONFIGS["folders"],
        sizes=Sizes(
            defense=8,
            dp_val=4,
            attack_train=4,
            attack_val=4,
            attack_test=4,
            more_data=1,
            dp_attack=False,
        ),
        rir_groups=2,
        rir_group_size=8,
        schedule=SCHEDULE,
        operators=("gd", "adam"),
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """deepnet.py with nothing but two ImageFolder roots of 32 px PNGs (two classes each; a colour
    channel tells the classes apart), timm's test ResNet as --model, two methods, and the
    "folders" configuration's sizes and schedule cut to the images there are."""
    from PIL import Image

    tmp, rng = tmp_path_factory.mktemp("own"), np.random.default_rng(0)
    for root, shift, n_train in (("dp", 0, 6), ("dh", 1, 8)):
        for split, n in (("train", n_train), ("val", 2)):
            for c in range(2):
                (tmp / root / split / f"class{c}").mkdir(parents=True)
                for i in range(n):
                    a = rng.integers(0, 120, (32, 32, 3), dtype=np.uint8)
                    a[..., c + shift] += 120
                    Image.fromarray(a).save(tmp / root / split / f"class{c}" / f"{i}.png")
    small = small_folders()
    mp = pytest.MonkeyPatch()
    mp.setitem(deep_configs.CONFIGS, "folders", small)
    dp, dh, out = tmp / "dp", tmp / "dh", tmp / "out"
    argv = ["--dp-root", str(dp), "--dh-root", str(dh), "--out", str(out), "--quiet"]
    argv += ["--model", "test_resnet", "--methods", "ours,closed_form", "--jobs", "1"]
    try:
        assert deepnet.main(argv) == 0
    finally:
        mp.undo()
    return {
        "dp": dp,
        "dh": dh,
        "out": out / "folders",
        "result": json.loads((out / "folders" / "results.json").read_text()),
        "config": small,
    }


def test_own_image_folders_run_end_to_end(folders):
    res, out = folders["result"], folders["out"]
    assert list(res["rows"]) == ["init", "ours", "closed_form"] and not res["errors"]
    assert res["run_config"]["model_kwargs"] == {"img_size": 32}  # θ₀ trained at the images' size
    for row in ("ours", "closed_form"):
        assert np.isfinite(res["rows"][row]["rir_theta0"]["mean"])
        assert list(res["rows"][row]["judged"]["operators"]) == ["gd", "adam"]
    for name in (*deepnet.FILES, "extractor_init.safetensors", "extractor_ours.safetensors"):
        assert (out / name).stat().st_size > 500, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left
    theta0, _ = load_model(out / "extractor_init.safetensors")
    assert theta0.classifier.out_features == 2
    images = res["per_seed"][0]["images"]
    assert (images["defense_p"], images["defense_h"], images["attack_test"]) == (8, 8, 4)


def test_the_table_gives_the_images_each_split_held(folders):
    """The report's counts are the images the run had (a folder shrinks every split), not the
    configuration's nominal sizes."""
    res = json.loads(json.dumps(folders["result"]))
    res["per_seed"][0]["images"].update(defense_p=65, defense_h=71, attack_train=17)
    words = re.findall(r"\d+", deep_report.table_markdown(res))
    assert {"65", "71", "17"} <= set(words)


def test_own_folders_with_the_default_flags_finish(tmp_path):
    """The command a user types first (default --jobs, two torch threads) ends, in a process of
    its own, within a timeout: its workers, forked from a parent whose torch had run its OpenMP
    threads, waited on them for ever (one seed of one row now runs without a pool; a pool's
    workers are spawned: tests/test_pool.py). The folders configuration's sizes are cut to the
    images (small_folders)."""
    roots = _deep_roots(tmp_path, side=16, n=8)
    code = (
        "import sys, torch\nfrom experiments import deep_configs, deepnet\n"
        "from tests.test_deep_audit import small_folders\n"
        "deep_configs.CONFIGS['folders'] = small_folders()\n"
        "torch.set_num_threads(2)  # torch's default here, which importing this module pins to 1\n"
        "sys.exit(deepnet.main(sys.argv[1:]))\n"
    )
    argv = [*roots, "--model", "resnet10t", "--seeds", "1", "--methods", "ours"]
    argv += ["--theta0-epochs", "1", "--out", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "folders" / "results.json").read_text())
    assert list(res["rows"]) == ["init", "ours"] and not res["errors"]


def test_deepnet_has_a_flag_per_deep_option():
    parser = deepnet.build_parser()
    assert [n for n in DeepOptions.names() if parser.flag_for(n) is None] == []
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
        (["--methods", "ours,no_such_method"], "--methods"),
        (["--rows", "ours,sophon"], "--rows"),  # the folders' rows: ours
    ]
    for argv, flag in [([*roots, *a], f) for a, f in cases] + [
        (["--demo", "--dp-root", str(folders["dp"])], "--dp-root"),
        (["--config", "folders"], "--dp-root"),
        (["--demo", "--checkpoint", init], "--checkpoint"),
        (["--demo", "--methods", "ours"], "--methods"),  # a named configuration has its rows
        (["--config", "demo-full", "--methods", "simulated"], "--methods"),
        (["--config", "demo-frontier", "--rows", "ours"], "--rows"),
        (["--demo", "--rows", "imma"], "--rows"),  # the baselines are demo-baselines' rows
    ]:
        rc, err = _one_line_error(capsys, deepnet, [*argv, "--out", str(tmp_path)])
        assert rc == 2 and f"error: {flag}:" in err, err
    assert not list(tmp_path.iterdir())


def test_deepnet_runs_a_group_of_configurations_and_the_rows_asked_for(tmp_path, monkeypatch):
    asked = []

    def spy(rcs, seeds, opts, ctx, *, on_extractor, jobs):
        asked.append(([rc.name for rc in rcs], [[r.name for r in rc.rows] for rc in rcs], seeds))
        raise KeyboardInterrupt

    monkeypatch.setattr(deepnet, "run_configs", spy)
    out = ["--out", str(tmp_path), "--quiet"]
    assert deepnet.main(["--config", "demo-full", *out]) == 130
    assert deepnet.main(["--demo", "--rows", "paper,ours", "--seeds", "2", *out]) == 130
    assert deepnet.main(["--demo", *out]) == 130
    full = deep_configs.GROUPS["demo-full"]
    rows = [[r.name for r in deep_configs.CONFIGS[c].rows] for c in full]
    demo = [[r.name for r in deep_configs.CONFIGS[c].rows] for c in deep_configs.GROUPS["demo"]]
    assert asked == [
        (list(full), rows, [0, 1, 2]),
        (list(deep_configs.GROUPS["demo"]), [["ours", "paper"]] * 2, [0, 1]),
        (list(deep_configs.GROUPS["demo"]), demo, [0]),  # the quick demo: one seed
    ]
    assert {"simulated", "sophon", "sophon_backbone"} <= set(rows[0])


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
    monkeypatch.setitem(deep_configs.CONFIGS, "folders", folders["config"])
    argv = ["--dp-root", str(folders["dp"]), "--dh-root", str(folders["dh"]), "--quiet"]
    rc = deepnet.main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "ours" in err
    table = (tmp_path / "folders" / "table.md").read_text().splitlines()
    label = deep_report.label(res, "ours")
    assert [line for line in table if label in line and "failed" in line]
    assert (
        json.loads((tmp_path / "folders" / "results.json").read_text())["errors"] == res["errors"]
    )


def test_an_interrupted_rerun_leaves_every_earlier_output_as_it_was(
    folders, tmp_path, monkeypatch, capsys
):
    """Outputs are written under temporary names and moved into place together at the end: a rerun
    interrupted after it wrote an extractor leaves the previous run's files byte for byte, and no
    temporary behind; a folder where any output goes (an extractor too) is refused before
    compute."""
    import shutil

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
    (out / "folders" / "extractor_ours.safetensors").unlink()
    (out / "folders" / "extractor_ours.safetensors").mkdir()
    rc, err = _one_line_error(capsys, deepnet, argv)
    assert rc == 2 and "error: --out:" in err and "extractor_ours" in err


# --- deepnet.py: the layout of the roots, the image size, the threads, θ₀ near chance ---------


def _deep_roots(tmp_path, side=16, dp_split="train", n=3):
    for root, split in (("dp", dp_split), ("dp", "val"), ("dh", "train"), ("dh", "val")):
        image_root(tmp_path / root / split, side=side, n=n)
    return ["--dp-root", str(tmp_path / "dp"), "--dh-root", str(tmp_path / "dh")]


def _no_compute(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("COMPUTED")

    monkeypatch.setattr(deepnet, "run_configs", boom)


def test_a_root_without_train_names_the_layout(capsys, tmp_path, monkeypatch):
    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path, dp_split="training"), "--theta0-epochs", "1"]
    rc, err = call(capsys, deepnet, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--dp-root", "train/", "training/")


def test_one_folder_as_both_roots_is_refused(capsys, tmp_path, monkeypatch):
    """D_H's folder is D_P's (by another path): the attacker's images would be the defense's."""
    _no_compute(monkeypatch)
    roots = _deep_roots(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "dp")
    argv = [*roots[:2], "--dh-root", str(tmp_path / "link"), "--theta0-epochs", "1"]
    rc, err = call(capsys, deepnet, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--dh-root")


def test_too_few_images_say_how_many_each_folder_needs():
    """A folder below what its splits need, shrunk alike, is a DataError naming its flag's
    argument and the number of images that would do (one fewer would not)."""
    from experiments.deep_pipeline import MIN_SPLIT_IMAGES, _fit

    sizes = {"defense": 500, "validation": 250, "train": 128, "watch": 64, "test": 128}
    with pytest.raises(DataError) as e:
        _fit(sizes, 12, "D_P", "dp_root")
    need = next(n for n in range(12, 2000) if min(int(k * n / 1070) for k in sizes.values()) >= 8)
    assert e.value.argument == "dp_root" and str(need) in re.findall(r"\d+", str(e.value))
    assert min(_fit(sizes, need, "D_P", "dp_root")) == MIN_SPLIT_IMAGES
    with pytest.raises(DataError):
        _fit(sizes, need - 1, "D_P", "dp_root")


def test_a_model_too_small_for_the_images_asks_for_img_size(capsys, tmp_path, monkeypatch):
    """convnext_atto on 28-px images fails inside its padding: refused naming the model and
    --img-size."""
    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path, side=28), "--model", "convnext_atto", "--theta0-epochs", "1"]
    rc, err = call(capsys, deepnet, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--img-size", "convnext_atto")


def test_a_huge_img_size_is_said_and_threads_are_capped(capsys, tmp_path, monkeypatch):
    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path), "--theta0-epochs", "1", "--img-size", "4096"]
    rc = deepnet.main([*argv, "--threads", "1024", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and "COMPUTED" in err  # the run went on, after the warnings
    warned = [line for line in err.splitlines() if "warning" in line]
    assert any("--img-size" in line and "4096" in line for line in warned), err
    assert any("--threads" in line for line in warned), err
    assert common.thread_count(1024, "x") == common.usable_cores()


def test_the_cost_of_an_upsampled_image_is_said_in_units_that_fit(capsys, tmp_path, monkeypatch):
    """--img-size 100 on 16-px images: one image is 3·100²·4 bytes as float32, a batch that many
    times the batch (both said as nonzero numbers in their units)."""
    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path), "--theta0-epochs", "1", "--img-size", "100"]
    deepnet.main([*argv, "--out", str(tmp_path / "o")])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "--img-size" in x]
    units = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    words = line.replace(",", " ").split()
    said = [float(w) * units[u] for w, u in zip(words, words[1:]) if u in units]
    one = 3 * 100**2 * 4
    assert said[0] == pytest.approx(one, rel=0.01)
    batch = said[1] / said[0]
    assert batch == pytest.approx(round(batch), rel=0.01) and round(batch) > 1


def test_theta0_near_chance_is_flagged_by_its_majority_class_and_source():
    """90 % of D_P in one class: a θ₀ at 91 % learned nothing (1/classes would call it fine); the
    advice to pass --checkpoint goes only to runs that did not pass one."""

    def result(*accs, chance=90.0):
        seeds = [
            {"seed": s, "theta0": {"dp_top1": a}, "classes": [2, 2], "dp_chance": chance}
            for s, a in enumerate(accs)
        ]
        return {"per_seed": seeds}

    plain = Namespace(checkpoint=None, pretrained=False)
    assert [s["seed"] for s in deepnet.theta0_warning(result(99.0, 91.0), plain)["seeds"]] == [1]
    assert deepnet.theta0_warning(result(97.0, 98.0), plain) is None
    given = Namespace(checkpoint="theta0.safetensors", pretrained=False)
    message = deepnet.theta0_warning(result(91.0), given)["message"]
    assert "theta0.safetensors" in message and "pass --checkpoint" not in message


def test_theta0_batchnorm_statistics_are_those_of_the_whole_training_set():
    """θ₀'s images are stored in class order; BatchNorm's running statistics must still be the
    whole set's (batches of one class would keep only the within-class variance)."""
    from experiments.deep_pipeline import train_classifier

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(128, 2, generator=g) - 3, torch.randn(128, 2, generator=g) + 3])
    y = torch.repeat_interleave(torch.arange(2), 128)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 2)
    )
    train_classifier(net, torch.utils.data.TensorDataset(x, y), epochs=1, lr=1e-12, seed=0)
    with torch.no_grad():
        a = net[0](x)
    pooled = a.var(0)
    within = torch.stack([a[y == c].var(0) for c in (0, 1)]).mean(0)
    assert torch.all(pooled > 4 * within)  # the data separate the two
    torch.testing.assert_close(net[1].running_var, pooled, rtol=0.1, atol=0)
