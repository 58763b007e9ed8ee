"""Data mixtures: a corpus of named domains, drawn per step in proportions that may move during training
(``flexmesh train --domains``; docs/mixtures.md).

A run's domains come from a manifest (JSON: each domain's name, corpus, optional weight and held-out
corpus) or from a folder whose sub-folders are the domains. Each step's global batch of ``B`` documents
draws its domain counts from a multinomial over the mixture's weights (``default_rng((seed, step))``:
the same on every rank and after a resume), then takes that many documents from each domain's own
seeded stream (a :class:`flexmesh.data.loader.DocumentLoader` of one document per draw).

Mixtures, each updated from the step's mean training loss per domain (every rank the same numbers):

- ``static``: the manifest's weights (by default each domain's share of the tokens), never moved.
- ``doremi`` (Xie et al., "DoReMi", NeurIPS 2023, arXiv 2305.10429, Alg. 1): the excess loss per
  domain, ``max(loss - reference, 0)``, against a trained reference's loss on that domain (the end of a
  finished ``static`` run of the same domains: :func:`reference_losses`), moves the weights by exponentiated
  gradient, ``w <- normalise(w * exp(eta * excess))``, smoothed with the uniform by ``c``. DoReMi trains a
  small proxy and then the large model on the averaged weights; here, as DataFlex runs it, the weights
  move online in the run itself.
- ``odm`` (Albalak et al., "Efficient Online Data Mixing", arXiv 2312.02406, Alg. 1): EXP3 over the
  domains. Each domain's reward is its mean loss over the probability it was drawn with, smoothed
  ``R <- alpha R + (1 - alpha) loss / p``; the weights are ``(1 - K eps) softmax(eps R) + eps`` with
  ``eps = min(1 / K, sqrt(ln K / (K t)))``.

Lag: the step source reads step ``t + 1``'s batch as step ``t`` starts (flexmesh.runtime.train.adaptive),
before step ``t``'s losses exist, so batch ``t`` is drawn with the weights after step ``t - 2``
(:data:`LAG`), on every run and every resume alike. The mixture's state (weights, rewards, the weights
of the steps still to be drawn) is checkpointed with the run (flexmesh.runtime.train.mixture_training).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flexmesh.data.loader import DocumentLoader, TokenizedCorpus
from flexmesh.data.tasks import TaskDocuments
from flexmesh.errors import DataError
from flexmesh.inputs import load_json

MIXTURES = ("static", "doremi", "odm")
LAG = 2  # batch t is drawn with the weights after step t - LAG (module doc)
# DoReMi's step size and smoothing (its paper, section 2: eta = 1, c = 1e-3)
DOREMI_ETA, DOREMI_SMOOTHING = 1.0, 1e-3
# ODM's reward smoothing (its paper, section 3: alpha = 0.9)
ODM_ALPHA = 0.9
REFERENCE_TAIL = 0.2  # DoReMi's reference loss: the reference run's last fifth of steps (reference_losses)


@dataclass(frozen=True)
class Domain:
    """One named part of the corpus: where its documents are, its weight (None: its share of the tokens)
    and its held-out corpus (None: none)."""

    name: str
    corpus: str
    weight: float | None = None
    eval: str | None = None


def read_domains(path: str | Path) -> list[Domain]:
    """The domains of ``path``: a manifest ``.json`` (``{"domains": [{"name", "corpus", "weight"?,
    "eval"?}, ...]}``, relative paths from its folder) or a folder whose sub-folders are the domains.

    >>> import tempfile, pathlib, json
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "m.json").write_text(json.dumps({"domains": [{"name": "code", "corpus": "py", "weight": 3},
    ...                                                       {"name": "prose", "corpus": "md"}]}))
    >>> [(x.name, pathlib.Path(x.corpus).name, x.weight) for x in read_domains(d / "m.json")]
    [('code', 'py', 3.0), ('prose', 'md', None)]
    """
    root = Path(path).expanduser()
    if root.is_dir():
        subs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if len(subs) < 2:
            raise DataError(f"--domains folder {root} has {len(subs)} sub-folder(s); give one sub-folder per domain "
                            "(at least two) or a manifest .json")
        return [Domain(p.name, str(p)) for p in subs]
    if root.suffix != ".json":
        raise DataError(f"--domains {root}: give a manifest .json or a folder of one sub-folder per domain")
    data = load_json(root, DataError, missing=f"--domains {root}: no such file; give a manifest .json or a folder")
    rows = data.get("domains") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) < 2:
        raise DataError(f"{root}: write {{\"domains\": [{{\"name\": ..., \"corpus\": ...}}, ...]}} with two domains "
                        "or more")
    out: list[Domain] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) or not isinstance(row.get("corpus"), str):
            raise DataError(f"{root}: domain {i} needs a \"name\" and a \"corpus\" (strings)")
        weight = row.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)
                                   or not math.isfinite(weight) or weight <= 0):
            raise DataError(f"{root}: domain {row['name']!r} has weight {weight!r}; give a positive number or leave "
                            "it out (its share of the tokens)")
        unknown = set(row) - {"name", "corpus", "weight", "eval"}
        if unknown:
            raise DataError(f"{root}: domain {row['name']!r} has unknown field(s) {', '.join(sorted(unknown))}; "
                            "the fields are name, corpus, weight, eval")

        def resolve(p: str | None) -> str | None:
            return None if p is None else p if p == "stdlib" or Path(p).is_absolute() else str(root.parent / p)

        out.append(Domain(row["name"], resolve(row["corpus"]) or "", None if weight is None else float(weight),
                          resolve(row.get("eval"))))
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise DataError(f"{root}: domain names repeat ({', '.join(names)}); give each domain its own name")
    return out


def initial_weights(domains: Sequence[Domain], tokens: Sequence[int]) -> np.ndarray:
    """The manifest's weights, normalised; where none are given, each domain's share of ``tokens``.

    >>> initial_weights([Domain("a", "x"), Domain("b", "y")], [300, 100]).tolist()
    [0.75, 0.25]
    """
    given = [d.weight for d in domains]
    if all(w is None for w in given):
        w = np.asarray(tokens, dtype=np.float64)
    elif any(w is None for w in given):
        raise DataError("give every domain a weight, or none (each then weighs its share of the tokens)")
    else:
        w = np.asarray(given, dtype=np.float64)
    return w / w.sum()


class Mixture:
    """The domain weights of a run and how they move (module doc); the same on every rank."""

    def __init__(self, kind: str, names: Sequence[str], weights: Sequence[float] | np.ndarray,
                 reference: Sequence[float] | None = None) -> None:
        if kind not in MIXTURES:
            raise DataError(f"--mixture {kind}: choose one of {', '.join(MIXTURES)}")
        if kind == "doremi" and reference is None:
            raise DataError("--mixture doremi needs a reference run's per-domain losses: --mixture-reference RUN "
                            "(a --mixture static run of the same domains)")
        self.kind, self.names = kind, list(names)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.reference = np.asarray(reference, dtype=np.float64) if reference is not None else None
        self.rewards = np.zeros(len(self.names))  # ODM's smoothed rewards
        self.updates = 0  # steps whose losses moved (or left) the weights
        self.drawn: list[list[float]] = []  # the weights of the next batches to draw, oldest first (LAG)

    def weights_for(self, batch: int) -> np.ndarray:
        """The weights batch ``batch`` (0-based) is drawn with: those after step ``batch + 1 - LAG``."""
        back = self.updates - (batch + 1 - LAG)  # how many updates ago
        if back <= 0 or not self.drawn:
            return self.weights
        return np.asarray(self.drawn[max(0, len(self.drawn) - back)])

    def update(self, step: int, loss: Sequence[float], tokens: Sequence[int]) -> None:
        """Move the weights after step ``step`` (1-based) from its mean loss per domain (``tokens``: each
        domain's label tokens in the step; a domain with none is left as it was)."""
        p = self.weights_for(step - 1)  # what the step's batch was drawn with
        self.drawn = (self.drawn + [self.weights.tolist()])[-LAG:]
        self.updates += 1
        seen = np.asarray(tokens) > 0
        lossv = np.asarray(loss, dtype=np.float64)
        k = len(self.names)
        if self.kind == "doremi":
            assert self.reference is not None
            excess = np.where(seen, np.maximum(lossv - self.reference, 0.0), 0.0)
            w = self.weights * np.exp(DOREMI_ETA * excess)
            self.weights = (1 - DOREMI_SMOOTHING) * w / w.sum() + DOREMI_SMOOTHING / k
        elif self.kind == "odm":
            self.rewards = np.where(seen, ODM_ALPHA * self.rewards + (1 - ODM_ALPHA) * lossv / p, self.rewards)
            eps = min(1.0 / k, math.sqrt(math.log(k) / (k * self.updates)))
            z = np.exp(eps * (self.rewards - self.rewards.max()))
            self.weights = (1 - k * eps) * z / z.sum() + eps

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "names": self.names, "weights": self.weights.tolist(),
                "rewards": self.rewards.tolist(), "updates": self.updates, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("names") != self.names or state.get("kind") != self.kind:
            was = ", ".join(state.get("names", []))
            raise DataError(f"the checkpoint's mixture is {state.get('kind')} over {was}; this run's is {self.kind} "
                            f"over {', '.join(self.names)}: resume with the --domains and --mixture the run "
                            "started with")
        self.weights = np.asarray(state["weights"], dtype=np.float64)
        self.rewards = np.asarray(state["rewards"], dtype=np.float64)
        self.updates, self.drawn = int(state["updates"]), [list(w) for w in state["drawn"]]


class MixtureLoader:
    """Endless global batches of ``global_batch`` documents drawn over domains by ``mixture`` (module doc);
    each batch a TaskDocuments whose ``tasks`` are the documents' domain slots."""

    def __init__(self, corpora: Sequence[TokenizedCorpus | list[np.ndarray]], mixture: Mixture,
                 global_batch: int, max_len: int, seed: int = 0) -> None:
        self.mixture, self.global_batch, self.seed = mixture, global_batch, seed
        self.loaders = []
        for i, (name, corpus) in enumerate(zip(mixture.names, corpora, strict=True)):
            try:
                self.loaders.append(DocumentLoader(corpus, 1, max_len, seed=seed * 1009 + i))
            except DataError as e:
                raise DataError(f"domain {name!r}: {e}") from None
        self.step = 0

    def __iter__(self) -> Iterator[TaskDocuments]:
        return self

    def counts(self, batch: int) -> np.ndarray:
        """Documents of each domain in batch ``batch``."""
        return np.random.default_rng((self.seed, 7, batch)).multinomial(self.global_batch,
                                                                         self.mixture.weights_for(batch))

    def __next__(self) -> TaskDocuments:
        docs: list[np.ndarray] = []
        slots: list[int] = []
        for i, (loader, n) in enumerate(zip(self.loaders, self.counts(self.step).tolist(), strict=True)):
            for _ in range(n):
                docs += next(loader)
                slots.append(i)
        self.step += 1
        return TaskDocuments(docs, slots)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "domains": {n: ld.state_dict() for n, ld in zip(self.mixture.names, self.loaders)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [n for n in self.mixture.names if n not in state.get("domains", {})]
        if missing:
            raise DataError(f"the checkpoint's data position has no domain {missing[0]!r}; resume with the --domains "
                            "the run started with")
        self.step = int(state["step"])
        for n, ld in zip(self.mixture.names, self.loaders):
            ld.load_state_dict(state["domains"][n])


def reference_losses(rows: Sequence[dict], names: Sequence[str], where: str) -> list[float]:
    """The reference model's loss per domain for ``--mixture doremi``: a finished run's mean training loss of
    each domain over its last :data:`REFERENCE_TAIL` of steps (its rows from ``metrics.jsonl``, over domains
    ``names``; ``where``: the file, for the error). DoReMi's reference is a model trained to the end on the
    reference mixture, whose loss it subtracts at every step of the proxy; here that is the end of the
    reference run.

    >>> rows = [{"domains": ["a", "b"], "domain_loss": [4.0 - i / 10, None if i % 2 else 3.0]} for i in range(10)]
    >>> [round(x, 3) for x in reference_losses(rows, ["a", "b"], "m")]
    [3.15, 3.0]
    """
    kept = [r["domain_loss"] for r in rows if r.get("domains") == list(names) and r.get("domain_loss")]
    if not kept:
        raise DataError(f"--mixture-reference: {where} records no per-domain losses of domains {', '.join(names)}; "
                        "give the folder of a --mixture static run of these --domains")
    tail = kept[-max(1, math.ceil(len(kept) * REFERENCE_TAIL)):]
    out = []
    for k, name in enumerate(names):
        seen = [r[k] for r in tail if r[k] is not None] or [r[k] for r in kept if r[k] is not None][-1:]
        if not seen:
            raise DataError(f"--mixture-reference: {where} never drew domain {name!r}; give a reference run that did")
        out.append(sum(seen) / len(seen))
    return out
