"""Bounds that are memory bounds: a JSON file of more values than flexmesh reads is refused before one value is
built, and a trace of more rows than one simulation runs (a small gzip of many short rows) before one row is."""

from __future__ import annotations

import gzip
import json

import pytest

import flexmesh.data.requests as requests
import flexmesh.inputs as inputs
from flexmesh.errors import DataError, PlanError


def test_a_json_of_too_many_values_is_refused_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_VALUES", 1000)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"stages": list(range(3000))}))
    parsed = []
    real = json.loads
    monkeypatch.setattr(inputs.json, "loads", lambda *a, **k: parsed.append(1) or real(*a, **k))
    with pytest.raises(PlanError, match="more than 1,000 values"):
        inputs.load_json(p, PlanError)
    assert not parsed
    p.write_text(json.dumps({"stages": list(range(900))}))  # under the bound: read as ever
    assert len(inputs.load_json(p, PlanError)["stages"]) == 900


def test_a_trace_of_too_many_rows_is_refused_before_reading_them(tmp_path, monkeypatch):
    monkeypatch.setattr(requests, "MAX_TRACE_ROWS", 100)
    p = tmp_path / "big.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i in range(500):
            f.write(f"2023-11-16 18:15:46.{i:06d},10,10\n")
    with pytest.raises(DataError, match="501 lines, more than the 100 requests"):
        requests.load_trace(str(p))
    monkeypatch.setattr(requests, "MAX_TRACE_ROWS", 1000)
    assert len(requests.load_trace(str(p))) == 500


def test_a_corpus_document_past_the_bound_is_one_line(tmp_path, monkeypatch):
    import flexmesh.data.corpus as corpus

    monkeypatch.setattr(corpus, "MAX_DOCUMENT_BYTES", 1000)
    (tmp_path / "small.txt").write_text("x" * 500)
    (tmp_path / "big.txt").write_text("y" * 5000)
    with pytest.raises(DataError, match="big.txt is 0 MiB, more than the 0 MiB flexmesh reads as one document"):
        corpus.read_corpus(str(tmp_path)).texts()
    jl = tmp_path / "c.jsonl"
    jl.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b" * 5000}) + "\n")
    with pytest.raises(DataError, match="line 2 is longer than"):
        corpus.read_corpus(str(jl)).texts()
    (tmp_path / "big.txt").unlink()
    assert corpus.read_corpus(str(tmp_path)).texts() == ["x" * 500]
