"""A corpus file whose name is not UTF-8 (a Latin-1 name on Linux) is read and fingerprinted like any other; the
fingerprint of UTF-8 names is the bytes it always hashed, so caches keyed by it stay valid."""

from __future__ import annotations

import hashlib
import os

from flexmesh.data.corpus import read_corpus


def test_a_file_name_that_is_not_utf8_is_read_and_fingerprinted(tmp_path):
    root = os.fsencode(tmp_path)
    with open(os.path.join(root, b"caf\xe9.txt"), "wb") as f:
        f.write(b"some text " * 20)
    (tmp_path / "b.txt").write_text("more text here")
    c = read_corpus(str(tmp_path))
    assert len(c.files) == 2 and len(c.texts()) == 2
    fp = c.fingerprint()
    (tmp_path / "b.txt").write_text("changed")
    assert read_corpus(str(tmp_path)).fingerprint() != fp


def test_utf8_names_hash_as_they_always_did(tmp_path):
    (tmp_path / "naïve.txt").write_text("text one")
    (tmp_path / "b.txt").write_text("text two")
    c = read_corpus(str(tmp_path))
    h = hashlib.sha256(f"{c.kind}:{c.text_field}".encode())
    for f in c.files:
        h.update(f"\0{f.relative_to(c.root)}\0".encode())
        h.update(f.read_bytes())
    assert c.fingerprint() == h.hexdigest()[:16]
