"""Outputs of the command lines (experiments/outputs.py, docs/cli.md "Outputs"): nothing of the
user's or of another run is ever deleted, an interrupted or failed run leaves the previous
outputs as they were, ``--out`` is checked before any compute, results.json is strict JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from experiments import common, house_price
from pycore.report import read_json
from tests.cli_helpers import call, one_line

TINY = [
    "--seeds",
    "1",
    "--methods",
    "identity,closed_form",
    "--probe-steps",
    "2",
    "--jobs",
    "1",
    "--no-plot",
]


def _snapshot(folder: Path) -> dict:
    """Every entry under ``folder`` (hidden ones and links included) with its content."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = Path(root) / n
            rel = str(p.relative_to(folder))
            out[rel] = os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def test_nothing_but_this_runs_own_files_is_touched(capsys, tmp_path):
    """Issue 27 defect 7: a user's OUT/ci/extractor_ours_backup.safetensors, which matched an
    output glob, was deleted by the next run.  Now a run replaces only the files it writes, by
    name."""
    out = tmp_path / "out"
    (out / "ci").mkdir(parents=True)
    (out / "ci" / "extractor_ours_backup.safetensors").write_bytes(b"45 MB of weights")
    (out / "thetas_backup.npz").write_bytes(b"mine")
    (out / "results.json.bak").write_text("an earlier result, kept by hand")
    (out / ".results.json.4242-abcd.json").write_text("another run's temporary file")
    (out / "norm_ratio.png").write_bytes(b"an earlier figure")
    (out / "link").symlink_to(tmp_path / "elsewhere")
    before = _snapshot(out)
    rc, err, _ = call(capsys, house_price, [*TINY, "--out", str(out)])
    assert rc == 0, err
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # --no-plot: the figure stays
    assert set(after) - set(before) == {"results.json", "table.md", "thetas.npz"}


def test_a_concurrent_run_cannot_remove_a_live_runs_files(tmp_path):
    """Issue 27 defect 6: run B (another PID namespace: it cannot see A's PID) deleted run A's
    staging folder.  Now no run deletes anything: B, writing into the same folder while A is
    half-way through its files, leaves A's temporary file and A's finished files alone."""
    seen = {}

    def a_writes_its_figure(path):
        common.write_outputs(tmp_path, {"results.json": "B", "table.md": "B"})  # B, start to end
        seen["a_tmp_alive"] = Path(path).exists()
        Path(path).write_text("A's figure")

    common.write_outputs(
        tmp_path, {"table.md": "A", "fig.png": a_writes_its_figure, "results.json": "A"}
    )
    assert seen["a_tmp_alive"]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "table.md": "B",
        "fig.png": "A's figure",
        "results.json": "A",
    }


@pytest.mark.parametrize(
    "exc,code",
    [(KeyboardInterrupt(), 130), (common.Terminated(), 143), (ValueError("bad data"), 1)],
)
def test_an_interrupted_or_failed_run_leaves_the_previous_outputs(
    capsys, tmp_path, monkeypatch, exc, code
):
    out = tmp_path / "hp"
    assert house_price.main([*TINY, "--out", str(out)]) == 0
    before = _snapshot(out)

    def fail(args):
        raise exc

    monkeypatch.setattr(house_price, "run", fail)
    rc, err, _ = call(capsys, house_price, [*TINY, "--out", str(out)])
    assert rc == code and one_line(err)
    assert _snapshot(out) == before


def test_a_failure_while_writing_leaves_no_partial_file(capsys, tmp_path, monkeypatch):
    """The figure fails half-way: the files already replaced are complete, results.json (written
    last) is still the previous run's, and no temporary file is left behind."""
    out = tmp_path / "hp"
    argv = [*TINY, "--out", str(out)]
    assert house_price.main(argv) == 0
    old = (out / "results.json").read_bytes()

    def broken_plot(result, path):
        Path(path).write_bytes(b"half a png")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(house_price, "plot_norm_ratio", broken_plot)
    rc, err, _ = call(capsys, house_price, [a for a in argv if a != "--no-plot"])
    assert rc == 1 and one_line(err)
    assert (out / "results.json").read_bytes() == old
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "table.md", "thetas.npz"]


@pytest.mark.parametrize("make", ["file", "under_a_file", "output_name_is_a_folder", "read_only"])
def test_out_is_checked_before_any_compute(tripwire, capsys, tmp_path, monkeypatch, make):
    f = tmp_path / "file"
    f.write_text("keep me")
    out = {"file": f, "under_a_file": f / "sub"}.get(make, tmp_path / "out")
    if make == "output_name_is_a_folder":
        (out / "table.md").mkdir(parents=True)
    if make == "read_only":  # tests may run as root, for whom chmod does not bind
        out.mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == out else real(p, m))
    rc, err, elapsed = call(capsys, house_price, ["--out", str(out)])
    assert rc == 2 and one_line(err, "--out") and elapsed < 1.0
    assert f.read_text() == "keep me"


def test_results_json_is_strict_json(capsys, tmp_path):
    assert house_price.main([*TINY, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.json").read_text()
    raw = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert (
        raw["ceiling"] == "Infinity" and read_json(tmp_path / "results.json")["ceiling"] == np.inf
    )
    capsys.readouterr()
