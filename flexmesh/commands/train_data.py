"""``flexmesh train``'s data, resolved once near the command line: the run's tokenizer and its corpus's
tokens, the loader of its steps, the held-out set of ``--eval-corpus`` (docs/cli-train.md), and the
records of tokenizer and corpus that the run folder keeps (flexmesh.data.hf_tokenizer,
flexmesh.data.run_corpus), checked here and written once a resume's every check has passed."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from flexmesh.commands.train_job import scheduler
from flexmesh.errors import PlanError
from flexmesh.job import Job
from flexmesh.layout.plan import Plan


class RunTokens(NamedTuple):
    """:func:`corpus_tokens_of`' answer: the corpus's tokens, the run's tokenizer, and each task's resolved
    corpus (name as given, Corpus; the one corpus without tasks), whose fingerprints are read once."""

    tokens: Any  # a TokenizedCorpus
    tokenizer: Any  # a tokenizers.Tokenizer
    corpora: list


def corpus_tokens_of(args: argparse.Namespace, job: Job, records: list | None = None) -> RunTokens:
    """``--corpus`` (else the first task's) tokenized under ``--tokenizer`` (when not given, the one beside
    ``--weights``, else a BPE trained on that corpus), that tokenizer, and the corpora resolved (RunTokens).
    Each corpus is resolved once, so its fingerprint (which reads every byte) is read once per start:
    the tokenizer's cache key, the token cache's and the corpus record share it.

    On rank 0 the run's records are checked against ``--out``'s: the tokenizer (``--out/tokenizer/``, for
    ``flexmesh export``: flexmesh.data.hf_tokenizer) and the corpus (``--out/corpus.json``:
    flexmesh.data.run_corpus); a resume under another one is refused here, and the writes that record
    this run's are appended to ``records``, for the training loop to make once the resume's other checks
    have passed (nothing in ``--out`` changes before)."""
    from flexmesh.data.cache import usable_cache
    from flexmesh.data.corpus import read_corpus, stdlib_corpus
    from flexmesh.data.hf_tokenizer import record_tokenizer
    from flexmesh.data.loader import load_corpus_tokens
    from flexmesh.data.run_corpus import record_corpus
    from flexmesh.errors import DataError

    spec, tasks = job.model, job.parts.tasks
    usable_cache(args.cache_dir)
    first = args.corpus or (tasks.tasks[0].corpus if tasks is not None else None)
    if not first:  # run_tasks refused it already: a corpus, or tasks that each name one
        raise PlanError("give --corpus (a folder of documents, a .jsonl file or 'stdlib'), or --tasks FILE")
    def read(name: str):  # noqa: ANN202 - a Corpus
        return stdlib_corpus() if name == "stdlib" else read_corpus(name)

    named = [(t.corpus, read(t.corpus)) for t in tasks] if tasks is not None else [(first, read(first))]
    corpus = named[0][1]
    mine = records if os.environ.get("RANK", "0") == "0" and args.out else None  # rank 0 records the run
    if mine is not None:  # the corpus first: another corpus also trains another tokenizer
        mine.append(_saying(*record_corpus(args.out, named, replace=getattr(args, "new_corpus", False))))
    tokenizer = args.tokenizer or tokenizer_of_weights(args.weights)
    corpus_tokens, tok = load_corpus_tokens(corpus, tokenizer, vocab_size=spec.vocab, cache_dir=args.cache_dir)
    if tok.get_vocab_size() > spec.vocab:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but model {spec.name!r} only {spec.vocab}; use a "
                        "tokenizer with at most that many tokens, or drop --tokenizer to train one")
    if os.environ.get("RANK", "0") == "0" and tokenizer != args.tokenizer:
        print(f"tokenizer: {tokenizer}, the one beside --weights (--tokenizer to use another)", file=sys.stderr)
    if mine is not None:
        mine.append(_saying(*record_tokenizer(args.out, tok, tokenizer, spec.max_position,
                                                 replace=getattr(args, "new_tokenizer", False))))
    return RunTokens(corpus_tokens, tok, named)


def _saying(write, warning: str | None):  # noqa: ANN001, ANN202 - callables
    """``write`` (None: nothing to write), then ``warning`` (if any) on stderr: a record replaced is
    said once it is."""
    def run() -> None:
        if write is not None:
            write()
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    return run


def check_evaluation(args: argparse.Namespace, plan: Plan, spec) -> None:  # noqa: ANN001
    """Refuse ``--eval-corpus`` where the held-out forwards do not run (flexmesh.runtime.train.evaluate.
    held_out_loss): a pipeline, LoRA tasks, experts."""
    if args.eval_corpus is None:
        return
    why = ("--tasks trains adapters, each with its own loss" if args.tasks else
           "the model has experts" if spec.is_moe else
           "the plan pipelines (pp above 1)" if any(g.pp > 1 for g in plan.groups) else None)
    if why is not None:
        raise PlanError(f"--eval-corpus evaluates plans with pp 1, without --tasks or experts, but {why}; drop "
                        "--eval-corpus" + (" or use a plan with pp 1" if "pipelines" in why else ""))


def held_out(args: argparse.Namespace, job: Job, tok):  # noqa: ANN001, ANN201 - an Evaluation or None
    """``--eval-corpus``'s first ``--eval-docs`` documents under the run's tokenizer ``tok``, laid out by the
    ``fixed`` policy, evaluated every ``--eval-every`` steps (flexmesh.runtime.train.evaluate); None without
    --eval-corpus."""
    from flexmesh.data.corpus import stdlib_corpus
    from flexmesh.data.loader import load_corpus_tokens
    from flexmesh.errors import DataError
    from flexmesh.runtime.train.evaluate import Evaluation, held_out_documents

    if args.eval_corpus is None:
        return None
    corpus = stdlib_corpus() if args.eval_corpus == "stdlib" else args.eval_corpus
    tokens = load_corpus_tokens(corpus, tok, cache_dir=args.cache_dir)[0]
    docs = held_out_documents(tokens, args.eval_docs, job.seq_len)
    if not docs:
        raise DataError(f"--eval-corpus {args.eval_corpus} has no document of two tokens or more; give another")
    return Evaluation.of(docs, args.eval_every, scheduler(job, "fixed", args.seed, args.cp))


def document_loader(args: argparse.Namespace, job: Job, tokens: RunTokens | None = None,  # noqa: ANN201
                    records: list | None = None):
    """The run's seeded loader over ``--corpus`` (with the job's tasks, over every task's corpus, each its
    own batch per step: flexmesh.data.tasks.TaskLoader) under the run's tokenizer (``tokens``:
    :func:`corpus_tokens_of`' answer, made here with ``records`` when not given)."""
    from flexmesh.data.loader import DocumentLoader, load_corpus_tokens

    tasks = job.parts.tasks
    corpus_tokens, tok, named = tokens if tokens is not None else corpus_tokens_of(args, job, records)
    if tasks is not None:
        from flexmesh.data.tasks import TaskLoader

        # the corpora corpus_tokens_of resolved (one per task, in order): their fingerprints are read already
        corpora = [load_corpus_tokens(corpus, tok, cache_dir=args.cache_dir)[0] for _, corpus in named]
        return TaskLoader(tasks.names, corpora, job.task_batches, [t.steps or args.max_steps for t in tasks],
                          job.seq_len, seed=args.seed)
    if job.tokens_per_batch is not None:  # --tokens-per-step: documents until that many tokens
        return DocumentLoader(corpus_tokens, max_len=job.seq_len, seed=args.seed, tokens_per_step=job.tokens_per_batch)
    return DocumentLoader(corpus_tokens, global_batch=job.global_batch, max_len=job.seq_len, seed=args.seed)


def tokenizer_of_weights(weights: str | None) -> str | None:
    """The tokenizer.json in the folder of ``--weights`` (a Hugging Face model folder, or a flexmesh export,
    holds the one its weights were trained with); None without --weights. Weights with no tokenizer beside
    them are refused in one line: a BPE trained now on the corpus would give every id another meaning than
    the one the weights learnt."""
    if not weights:
        return None
    folder = Path(weights) if Path(weights).is_dir() else Path(weights).parent
    found = folder / "tokenizer.json"
    if not found.is_file():
        from flexmesh.errors import DataError

        raise DataError(f"--weights {weights} has no tokenizer.json beside it, and a tokenizer trained on the corpus "
                        "would not match the ids the weights learnt: pass --tokenizer with the weights' own")
    return str(found)
