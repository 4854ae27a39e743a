"""Results plumbing (pycore/_report.py): strict JSON that gives every value back."""

from __future__ import annotations

import json
import math

from pycore._report import from_json
from pycore.report import dumps_json, read_json, write_json

VALUES = {
    "column": "NaN",  # a string that reads like a non-finite float
    "words": ["Infinity", "-Infinity", "nan", "NaN!", "\x00", "\x00NaN", ""],
    "nan": math.nan,
    "inf": math.inf,
    "neg": -math.inf,
    "finite": 1.5,
    "NaN": "key and value",
}


def _same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_strings_and_non_finite_floats_survive_a_round_trip(tmp_path):
    write_json(tmp_path / "r.json", VALUES)
    assert _same(read_json(tmp_path / "r.json"), VALUES)
    json.loads(dumps_json(VALUES), parse_constant=lambda c: 1 / 0)  # strict: no NaN literal


def test_an_older_file_reads_as_it_always_did(tmp_path):
    (tmp_path / "old.json").write_text('{"c": "Infinity", "r": ["NaN", "-Infinity"], "m": "ours"}')
    old = read_json(tmp_path / "old.json")
    assert old["c"] == math.inf and math.isnan(old["r"][0]) and old["r"][1] == -math.inf
    assert old["m"] == "ours" and from_json("abc") == "abc"
