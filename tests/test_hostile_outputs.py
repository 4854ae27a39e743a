"""Hostile ``--out`` folders (experiments/outputs.py, docs/cli.md "Outputs"): a mount point, dangling
and looping symbolic links, user data named like an output file, a kept set after a failed move.

Each case asserts the exit code, the key words of the one stderr line, and what is on disk after.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import house_price, outputs
from tests import cli_helpers
from tests.cli_helpers import one_line

ROOT = Path(__file__).resolve().parents[1]
TINY_HP = ["--seeds", "1", "--methods", "identity", "--probe-steps", "2", "--jobs", "1", "--no-plot"]


def call(capsys, argv):
    """House Prices' main: (exit code, stderr)."""
    return cli_helpers.call(capsys, house_price, argv)[:2]


# --- a mount point: no swap possible ----------------------------------------------------------

def _ebusy(*a, **k):
    raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))


def test_out_that_cannot_be_swapped_is_replaced_in_place(capsys, tmp_path, monkeypatch):
    """The docker -v host:/out case, simulated: renaming --out fails with EBUSY.  The run used to
    delete its staging folder after the whole computation and exit 1 with a raw [Errno 16]."""
    out = tmp_path / "out"
    out.mkdir()                                   # the (empty) mount point
    (out / "table.md").write_text("an earlier run's table")
    real_rename = os.rename

    def rename(src, dst, *a, **k):
        if Path(dst) == out or Path(src) == out:  # a mount point cannot be renamed, nor replaced
            _ebusy()
        return real_rename(src, dst, *a, **k)
    monkeypatch.setattr(outputs, "_exchange", _ebusy)
    monkeypatch.setattr(os, "rename", rename)
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    assert rc == 0, err
    one_line(err, "warning", "cannot be swapped as a whole", "EBUSY", "one by one")
    assert sorted(os.listdir(out)) == ["results.json", "table.md", "thetas.npz"]
    assert (out / "table.md").read_text().startswith("# House Prices")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]       # no staging folder left


def test_in_place_replacement_that_fails_keeps_the_result(capsys, tmp_path, monkeypatch):
    """If even the file-by-file replacement fails, the finished set is kept and named."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(outputs, "_exchange", _ebusy)
    monkeypatch.setattr(os, "rename", lambda *a, **k: _ebusy())
    monkeypatch.setattr(outputs, "_move_file", lambda src, dst: _ebusy())
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    line = err.strip().splitlines()[-1]
    assert rc == 1 and "cannot write into" in line and "outputs are in" in line, err
    kept = Path(line.split("outputs are in ")[1])
    assert sorted(os.listdir(kept)) == [".rescued", "results.json", "table.md", "thetas.npz"]


@pytest.mark.skipif(shutil.which("unshare") is None or not sys.platform.startswith("linux"),
                    reason="needs unshare(1) on Linux")
def test_real_mount_point(tmp_path):
    """A real tmpfs mounted at --out, in a private mount namespace (root only: skipped otherwise)."""
    out = tmp_path / "mnt"
    out.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {out}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    script = (f"mount -t tmpfs none {out} && {sys.executable} experiments/house_price.py "
              f"{' '.join(TINY_HP)} --out {out}; echo rc=$?; ls -A {out}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert "rc=0" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.split("rc=0")[1].split() == ["results.json", "table.md", "thetas.npz"], proc.stdout
    assert "Errno" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# --- symbolic links -----------------------------------------------------------------------------

def test_dangling_out_symlink_is_refused_before_compute(tripwire, capsys, tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    rc, err = call(capsys, ["--out", str(link)])
    assert rc == 2 and one_line(err, "--out", "dangling symbolic link", "nowhere")
    assert os.path.islink(link) and not (tmp_path / "nowhere").exists()


def test_looping_out_symlink_is_refused_before_compute(tripwire, capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    rc, err = call(capsys, ["--out", str(a)])
    assert rc == 2 and one_line(err, "--out", "symbolic link loop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_out_symlink_to_a_folder_is_refused_before_compute(tripwire, capsys, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    rc, err = call(capsys, ["--out", str(tmp_path / "out")])
    assert rc == 2 and one_line(err, "--out", "symbolic link", "pass the folder itself")


# --- user data named like an output file ---------------------------------------------------------

@pytest.mark.parametrize("layout", ["results.json/precious.txt", "table.md/sub/thesis.txt"])
def test_folder_named_like_an_output_is_never_deleted(capsys, tmp_path, layout):
    """Such a folder passed the 'earlier outputs only' check by its name and was deleted, exit 0."""
    out = tmp_path / "X"
    user_file = out / layout
    user_file.parent.mkdir(parents=True)
    user_file.write_text("precious")
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    top = layout.split("/")[0]
    assert rc == 2 and one_line(err, "--out", repr(top), "a folder", "not an output file")
    assert user_file.read_text() == "precious"


def test_symlink_named_like_an_output_is_never_followed_or_replaced(capsys, tmp_path):
    out = tmp_path / "X"
    out.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text("precious")
    (out / "results.json").symlink_to(target)
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    assert rc == 2 and one_line(err, "--out", "'results.json'", "symbolic link")
    assert target.read_text() == "precious" and os.path.islink(out / "results.json")


def test_folder_named_like_an_output_appearing_during_the_run(capsys, tmp_path, monkeypatch):
    out = tmp_path / "X"
    real_run = house_price.run

    def run_while_user_writes(args):
        (out / "table.md").mkdir(parents=True)
        (out / "table.md" / "thesis.txt").write_text("mine")
        return real_run(args)
    monkeypatch.setattr(house_price, "run", run_while_user_writes)
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    assert rc == 1 and one_line(err, "--out", "'table.md'", "outputs are in")
    assert (out / "table.md" / "thesis.txt").read_text() == "mine"


# --- a result reported to the user is never deleted -----------------------------------------------

def test_rescued_outputs_survive_the_next_run(capsys, tmp_path, monkeypatch):
    """Files appearing in --out during a run: the run exits 1 and names where its outputs are.
    The next run into the same --out used to delete that folder as a dead process's leftover."""
    out = tmp_path / "hp"
    real_run = house_price.run

    def run_while_user_writes(args):
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        return real_run(args)
    monkeypatch.setattr(house_price, "run", run_while_user_writes)
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    assert rc == 1 and one_line(err, "--out", "gained files", "notes.txt", "outputs are in")
    assert os.listdir(out) == ["notes.txt"]                # the user's file, and nothing of ours
    kept = Path(err.split("outputs are in ")[1].strip())
    assert kept.name.startswith("hp.rescued-")            # visible, and not a staging folder
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    assert sorted(before) == [".rescued", "results.json", "table.md", "thetas.npz"]

    # The reporting process is gone when the user runs again (its PID is dead: simulate that).
    monkeypatch.setattr(outputs, "_alive", lambda pid: False)
    monkeypatch.setattr(house_price, "run", real_run)
    (out / "notes.txt").unlink()
    rc, err = call(capsys, [*TINY_HP, "--out", str(out)])
    assert rc == 0, err
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
