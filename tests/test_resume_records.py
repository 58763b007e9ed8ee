"""A resume checks the run's records before anything in its folder changes: another corpus is refused
(unless --new-corpus), and a resume refused by any check (here: another plan) leaves the recorded
tokenizer and corpus as they were, even with --new-tokenizer/--new-corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import flexmesh_here, write_inputs


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".flexmesh.lock"}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("records")
    _, corpus, plan = write_inputs(tmp, world=1)
    done = flexmesh_here(*_args(tmp, plan, corpus, tmp / "run"))
    assert done.returncode == 0, done.stderr
    return tmp


def _args(tmp: Path, plan: Path, corpus: Path, out: Path, steps: int = 1) -> list[str]:
    return ["train", "--plan", str(plan), "--corpus", str(corpus), "--out", str(out), "--max-steps", str(steps),
            "--cache-dir", str(tmp / "cache"), "--no-progress"]


def _copy(first_run: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the first run and of its corpus (``tmp_path/corpus``), and its plan."""
    shutil.copytree(first_run / "run", tmp_path / "run")
    shutil.copytree(first_run / "corpus", tmp_path / "corpus")
    return tmp_path / "run", tmp_path / "corpus", first_run / "plan.json"


def test_the_corpus_is_recorded_by_its_content(first_run):
    record = json.loads((first_run / "run" / "corpus.json").read_text())
    assert [c["name"] for c in record["corpora"]] == [str(first_run / "corpus")]
    assert record["corpora"][0]["files"] == 24 and len(record["corpora"][0]["fingerprint"]) == 16
    tokenizer = json.loads((first_run / "run" / "tokenizer" / "tokenizer.json").read_text())
    eos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|endoftext|>")
    assert record["end_of_text"] == eos  # each document was fed with the BPE's end-of-text after it


def test_a_run_from_before_end_of_text_resumes_as_it_was_fed(first_run, tmp_path):
    """A run recorded before documents ended with end-of-text resumes as it was fed, said in one line; asking
    for end-of-text on it is refused in one line naming --no-end-of-text and --new-corpus (which goes on with it)."""
    run, corpus, plan = _copy(first_run, tmp_path)
    record = json.loads((run / "corpus.json").read_text())
    del record["end_of_text"]
    (run / "corpus.json").write_text(json.dumps(record))
    before = _snapshot(run)
    done = flexmesh_here(*_args(first_run, plan, corpus, run, steps=2), "--end-of-text")
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "records documents without an end-of-text token but this run feeds them each followed by" in said
    assert "resume with --no-end-of-text" in said and "--new-corpus" in said
    assert _snapshot(run) == before
    done = flexmesh_here(*_args(first_run, plan, corpus, run, steps=2))
    said = " ".join(done.stderr.split())
    assert done.returncode == 0 and "resuming from" in said, done.stderr
    assert f"documents without an end-of-text token, as the run in {run} was fed" in said
    assert "end_of_text" not in json.loads((run / "corpus.json").read_text())  # the record holds as it was
    done = flexmesh_here(*_args(first_run, plan, corpus, run, steps=3), "--new-corpus")
    assert done.returncode == 0, done.stderr
    assert "recorded documents without an end-of-text token, now each followed by" in " ".join(done.stderr.split())
    assert json.loads((run / "corpus.json").read_text())["end_of_text"] is not None


def test_a_resume_under_another_corpus_is_refused_and_changes_nothing(first_run, tmp_path):
    run, corpus, plan = _copy(first_run, tmp_path)
    (corpus / "doc00.txt").write_text("another text altogether")
    before = _snapshot(run)
    done = flexmesh_here(*_args(first_run, plan, corpus, run, steps=2))
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert said.startswith(f"error: {run / 'corpus.json'} records another corpus") and "--new-corpus" in said
    assert _snapshot(run) == before


def test_a_moved_corpus_is_the_same_corpus(first_run, tmp_path):
    run, corpus, plan = _copy(first_run, tmp_path)  # the copy lies elsewhere, with the same content
    done = flexmesh_here(*_args(first_run, plan, corpus, run, steps=2))
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stderr


def test_new_corpus_goes_on_and_rerecords(first_run, tmp_path):
    run, corpus, plan = _copy(first_run, tmp_path)
    # the same documents, one edited, tokenised alike: only the corpus differs
    (corpus / "doc00.txt").write_text((corpus / "doc00.txt").read_text() + " ")
    done = flexmesh_here(*_args(first_run, plan, corpus, run, steps=2), "--new-corpus")
    assert done.returncode == 0, done.stderr
    assert "recorded another corpus than this run's, now replaced" in " ".join(done.stderr.split())
    again = flexmesh_here(*_args(first_run, plan, corpus, run, steps=3))  # the new record holds
    assert again.returncode == 0, again.stderr


def test_a_resume_refused_later_leaves_every_record_as_it_was(first_run, tmp_path):
    """--new-tokenizer/--new-corpus, but another plan: the plan check refuses, after the records were checked."""
    run, corpus, plan = _copy(first_run, tmp_path)
    other = json.loads(plan.read_text())
    other["groups"][0]["stages"][0]["strategies"] = ["tp1-dp1z3", "tp1-dp1z3"]  # no recompute in layer 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    (corpus / "doc00.txt").write_text("another text altogether, which another tokenizer is trained on")
    before = _snapshot(run)
    done = flexmesh_here(*_args(first_run, tmp_path / "other.json", corpus, run, steps=2), "--new-corpus",
                         "--new-tokenizer")
    assert done.returncode == 2 and "was written under plan" in done.stderr, done.stderr
    assert _snapshot(run) == before


def test_a_training_start_reads_the_corpus_once(first_run, tmp_path, monkeypatch):
    """The tokenizer's cache key, the token cache's and the corpus record share one fingerprint: a fresh
    start (a new tokenizer trained, its tokens cached) and a resume each read the corpus's bytes once."""
    from flexmesh.data import corpus as corpus_module

    reads: list[Path] = []
    real = corpus_module.content_fingerprint
    monkeypatch.setattr(corpus_module, "content_fingerprint", lambda c: reads.append(c.root) or real(c))
    run, corpus, plan = _copy(first_run, tmp_path)
    fresh = flexmesh_here(*_args(tmp_path, plan, corpus, tmp_path / "fresh", steps=1))  # a cache of its own
    assert fresh.returncode == 0, fresh.stderr
    assert reads == [corpus]
    assert (tmp_path / "cache" / "tokenizers").is_dir() and (tmp_path / "fresh" / "corpus.json").is_file()
    reads.clear()
    resumed = flexmesh_here(*_args(first_run, plan, corpus, run, steps=2))
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr
    assert reads == [corpus]
