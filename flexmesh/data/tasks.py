"""The documents of many LoRA tasks, dealt per step (docs/adapters.md).

Each task has its own corpus and its own sequences per step; a step's documents are every active
task's batch side by side, each document labelled with its task's slot (:class:`TaskDocuments`). A
task that has trained its own number of steps stops contributing documents (its adapter's learning
rate is then 0; flexmesh.runtime.train.task_training). The position is one DocumentLoader's per task, so
resuming replays exactly the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flexmesh.data.loader import DocumentLoader, TokenizedCorpus
from flexmesh.errors import DataError


class TaskDocuments(list):
    """A step's documents (token arrays) with ``tasks``, each one's task slot."""

    def __init__(self, docs: Sequence[np.ndarray], tasks: Sequence[int]):
        super().__init__(docs)
        if len(tasks) != len(docs):
            raise DataError(f"{len(docs)} documents but {len(tasks)} task labels")
        self.tasks = np.asarray(tasks, dtype=np.int64)


class TaskLoader:
    """Endless steps of every task's documents: task ``i`` gives ``batches[i]`` whole documents of
    ``corpora[i]`` per step (each truncated to ``max_len``) for its first ``steps[i]`` steps."""

    def __init__(self, names: Sequence[str], corpora: Sequence[TokenizedCorpus | list[np.ndarray]],
                 batches: Sequence[int], steps: Sequence[int], max_len: int, seed: int = 0) -> None:
        self.names = list(names)
        self.loaders = []
        for i, (name, corpus, batch) in enumerate(zip(names, corpora, batches, strict=True)):
            if len(corpus) == 0:
                raise DataError(f"task {name!r}: its corpus has no document; give it a folder with documents")
            try:
                self.loaders.append(DocumentLoader(corpus, batch, max_len, seed=seed * 1009 + i))
            except DataError as e:
                raise DataError(f"task {name!r}: {e}") from None
        self.steps = list(steps)
        self.step = 0

    def __iter__(self) -> Iterator[TaskDocuments]:
        return self

    def __next__(self) -> TaskDocuments:
        docs: list[np.ndarray] = []
        tasks: list[int] = []
        for i, loader in enumerate(self.loaders):
            if self.step < self.steps[i]:
                batch = next(loader)
                docs += batch
                tasks += [i] * len(batch)
        self.step += 1
        return TaskDocuments(docs, tasks)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tasks": {n: ld.state_dict() for n, ld in zip(self.names, self.loaders)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [n for n in self.names if n not in state.get("tasks", {})]
        if missing:
            raise DataError(f"the checkpoint's data position has no task {missing[0]!r}; resume with the job file "
                            "the run started with")
        self.step = int(state["step"])
        for n, ld in zip(self.names, self.loaders):
            ld.load_state_dict(state["tasks"][n])
