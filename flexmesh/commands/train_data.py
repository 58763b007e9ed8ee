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

from flexmesh.commands.args import given_flags
from flexmesh.commands.train_domains import domain_evals, mixture_loader
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


def check_inputs(args: argparse.Namespace) -> None:
    """The files the ranks would read, found or refused in one line by the launcher before it plans or starts any
    rank: ``--corpus`` (a folder with documents or a .jsonl file; not read yet), ``--tokenizer`` and ``--weights``.
    The job file of ``--tasks`` and ``--eval-corpus`` are checked with the plan (``_preflight``)."""
    from flexmesh.data.corpus import read_corpus
    from flexmesh.errors import DataError

    if not args.corpus and not args.tasks and not getattr(args, "domains", None):
        raise PlanError("give --corpus (a folder of documents, a .jsonl file or 'stdlib'), --domains PATH, or "
                        "--tasks FILE")
    if args.corpus and args.corpus != "stdlib":
        read_corpus(args.corpus)
    for flag, path in (("--tokenizer", args.tokenizer), ("--weights", args.weights)):
        if path and not Path(path).expanduser().exists():
            raise DataError(f"{flag} {path}: no such file or folder; give the path of a local one")


def corpus_tokens_of(args: argparse.Namespace, job: Job, records: list | None = None) -> RunTokens:
    """``--corpus`` (else the first task's) tokenized under ``--tokenizer`` (when not given, the one beside
    ``--weights``, else a BPE trained on that corpus), each document followed by that tokenizer's end-of-text
    token unless ``--no-end-of-text`` (flexmesh.data.hf_tokenizer.end_of_text_id: the eos an export names; a
    tokenizer without one is said once, and its documents go without), that tokenizer, and the corpora
    resolved (RunTokens). Each corpus is resolved once, so its fingerprint (which reads every byte) is read
    once per start: the tokenizer's cache key, the token cache's and the corpus record share it.

    On rank 0 the run's records are checked against ``--out``'s: the tokenizer (``--out/tokenizer/``, for
    ``flexmesh export``: flexmesh.data.hf_tokenizer) and the corpus (``--out/corpus.json``:
    flexmesh.data.run_corpus); a resume under another one is refused here, and the writes that record
    this run's are appended to ``records``, for the training loop to make once the resume's other checks
    have passed (nothing in ``--out`` changes before)."""
    from flexmesh.data.cache import usable_cache
    from flexmesh.data.corpus import read_corpus, stdlib_corpus
    from flexmesh.data.hf_tokenizer import end_of_text_id, record_tokenizer
    from flexmesh.data.loader import tokenize_corpus
    from flexmesh.data.run_corpus import record_corpus, recorded_end_of_text
    from flexmesh.data.tokenizer import load_tokenizer, train_bpe
    from flexmesh.errors import DataError
    from flexmesh.runtime.state.rundir import CHECKPOINTS

    spec, tasks = job.model, job.parts.tasks
    usable_cache(args.cache_dir)
    first = args.corpus or getattr(args, "domains", None) or (tasks.tasks[0].corpus if tasks is not None else None)
    if not first:  # run_tasks refused it already: a corpus, or tasks that each name one
        raise PlanError("give --corpus (a folder of documents, a .jsonl file or 'stdlib'), or --tasks FILE")
    def read(name: str):  # noqa: ANN202 - a Corpus
        return stdlib_corpus() if name == "stdlib" else read_corpus(name)

    domains = getattr(args, "domains", None)
    if domains:
        from flexmesh.data.mixture import read_domains

        named = [(d.name, read(d.corpus)) for d in read_domains(domains)]
    else:
        named = [(t.corpus, read(t.corpus)) for t in tasks] if tasks is not None else [(first, read(first))]
    corpus = named[0][1]
    rank0 = os.environ.get("RANK", "0") == "0"
    mine = records if rank0 and args.out else None  # rank 0 records the run
    tokenizer = args.tokenizer or tokenizer_of_weights(args.weights)
    tok = load_tokenizer(tokenizer) if tokenizer else train_bpe(corpus, vocab_size=spec.vocab, cache_dir=args.cache_dir)
    if tok.get_vocab_size() > spec.vocab:
        raise DataError(f"tokenizer has {tok.get_vocab_size()} tokens but model {spec.name!r} only {spec.vocab}; use a "
                        "tokenizer with at most that many tokens, or drop --tokenizer to train one")
    wanted = getattr(args, "end_of_text", None)
    if wanted is None:  # not given: as the run in --out was fed (a resume), else with one
        recorded = None if getattr(args, "new_corpus", False) or not args.out else recorded_end_of_text(args.out)
        if recorded is None and args.out and not getattr(args, "new_corpus", False) \
                and any((Path(args.out) / CHECKPOINTS).glob("step_*")):
            recorded = False  # checkpoints of a run from before the corpus was recorded: fed without one
        wanted = recorded is not False
        if not wanted and rank0:
            print(f"documents without an end-of-text token, as the run in {args.out} was fed (--end-of-text "
                  "--new-corpus to go on with one)", file=sys.stderr)
    eot = end_of_text_id(tok, tokenizer) if wanted else None
    if rank0 and tokenizer != args.tokenizer:
        print(f"tokenizer: {tokenizer}, the one beside --weights (--tokenizer to use another)", file=sys.stderr)
    if rank0 and wanted and eot is None:
        print(f"warning: tokenizer {tokenizer} names no end-of-text token (no eos_token in a tokenizer_config.json "
              "beside it, no <|endoftext|>): documents are fed without one, so the model will not learn where a text "
              "ends; add a tokenizer_config.json naming its eos_token, or pass --no-end-of-text", file=sys.stderr)
    if mine is not None:  # the corpus first: another corpus also trains another tokenizer
        mine.append(_saying(*record_corpus(args.out, named, replace=getattr(args, "new_corpus", False),
                                           end_of_text=eot)))
        mine.append(_saying(*record_tokenizer(args.out, tok, tokenizer, spec.max_position,
                                                 replace=getattr(args, "new_tokenizer", False))))
    return RunTokens(tokenize_corpus(corpus, tok, cache_dir=args.cache_dir, end_of_text=eot), tok, named)


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
    """Refuse ``--eval-corpus`` (or the domains' eval corpora) and ``--reweight`` where their forwards outside
    the step do not run (flexmesh.runtime.train.trainer.Trainer.forward_only): a pipeline, LoRA tasks,
    experts."""
    flags = given_flags({"--eval-corpus": args.eval_corpus is not None,
                         "the domains' eval corpora": args.eval_corpus is None and domain_evaluation(args),
                         "--reweight": getattr(args, "reweight", None) is not None})
    if not flags:
        return
    why = ("--tasks trains adapters, each with its own loss" if args.tasks else
           "the model has experts" if spec.is_moe else
           "the plan pipelines (pp above 1)" if any(g.pp > 1 for g in plan.groups) else None)
    if why is not None:
        flag = flags[0]
        does = "weighs documents by a forward of" if flag == "--reweight" else "evaluates"
        raise PlanError(f"{flag} {does} plans with pp 1, without --tasks or experts, but {why}; drop "
                        f"{flag}" + (" or use a plan with pp 1" if "pipelines" in why else ""))


def domain_evaluation(args: argparse.Namespace) -> bool:
    """Whether the ``--domains`` manifest names held-out sets (then evaluated per domain)."""
    if not getattr(args, "domains", None):
        return False
    from flexmesh.data.mixture import read_domains

    return any(d.eval for d in read_domains(args.domains))


def held_out(args: argparse.Namespace, job: Job, tok, end_of_text: int | None = None):  # noqa: ANN001, ANN201
    """``--eval-corpus``'s first ``--eval-docs`` documents under the run's tokenizer ``tok``, each followed by
    ``end_of_text`` as the training documents are, laid out by the ``fixed`` policy, evaluated every
    ``--eval-every`` steps (flexmesh.runtime.train.evaluate): a HeldOutEval; None without --eval-corpus."""
    from flexmesh.data.corpus import read_corpus, stdlib_corpus
    from flexmesh.data.loader import tokenize_corpus
    from flexmesh.errors import DataError
    from flexmesh.runtime.train.evaluate import HeldOutEval, held_out_documents

    if domain_evaluation(args):
        return domain_evals(args, job, tok, end_of_text, scheduler(job, "fixed", args.seed, args.cp))
    if args.eval_corpus is None:
        return None
    corpus = stdlib_corpus() if args.eval_corpus == "stdlib" else read_corpus(args.eval_corpus)
    tokens = tokenize_corpus(corpus, tok, cache_dir=args.cache_dir, end_of_text=end_of_text)
    docs = held_out_documents(tokens, args.eval_docs, job.seq_len)
    if not docs:
        raise DataError(f"--eval-corpus {args.eval_corpus} has no document of two tokens or more; give another")
    return HeldOutEval.of(docs, args.eval_every, scheduler(job, "fixed", args.seed, args.cp))


def document_loader(args: argparse.Namespace, job: Job, tokens: RunTokens | None = None,  # noqa: ANN201
                    records: list | None = None):
    """The run's seeded loader over ``--corpus`` (with the job's tasks, over every task's corpus, each its
    own batch per step: flexmesh.data.tasks.TaskLoader) under the run's tokenizer (``tokens``:
    :func:`corpus_tokens_of`' answer, made here with ``records`` when not given)."""
    from flexmesh.data.loader import DocumentLoader, tokenize_corpus

    tasks = job.parts.tasks
    corpus_tokens, tok, named = tokens if tokens is not None else corpus_tokens_of(args, job, records)
    if getattr(args, "domains", None):
        return mixture_loader(args, job, [tokenize_corpus(corpus, tok, cache_dir=args.cache_dir,
                                                          end_of_text=corpus_tokens.end_of_text)
                                          for _, corpus in named])
    if tasks is not None:
        from flexmesh.data.tasks import TaskLoader

        # the corpora corpus_tokens_of resolved (one per task, in order): their fingerprints are read already
        corpora = [tokenize_corpus(corpus, tok, cache_dir=args.cache_dir, end_of_text=corpus_tokens.end_of_text)
                   for _, corpus in named]
        return TaskLoader(tasks.names, corpora, job.task_batches, [t.steps or args.max_steps for t in tasks],
                          job.seq_len, seed=args.seed)
    if job.tokens_per_batch is not None:  # --tokens-per-step: documents until that many tokens
        return DocumentLoader(corpus_tokens, max_len=job.seq_len, seed=args.seed, tokens_per_step=job.tokens_per_batch)
    return DocumentLoader(corpus_tokens, global_batch=job.global_batch, max_len=job.seq_len, seed=args.seed)


def first_lengths(args: argparse.Namespace, job: Job, tokens, steps: int) -> list:  # noqa: ANN001
    """The document lengths of the run's first ``steps`` batches, one array per step, drawn from a loader of
    their own as the run's loader draws them (same corpus, seed and batch; past ``--max-steps`` too, so that a
    resume under another ``--max-steps`` sees the same batches)."""
    import itertools

    import numpy as np

    return [np.array([len(d) for d in getattr(batch, "docs", batch)], dtype=np.int64)
            for batch in itertools.islice(document_loader(args, job, tokens), steps)]


def tokenizer_of_weights(weights: str | None) -> str | None:
    """The tokenizer.json in the folder of ``--weights`` (a Hugging Face model folder, or a flexmesh export,
    holds the one its weights were trained with); None without --weights. Weights with no tokenizer beside
    them are refused in one line: a BPE trained now on the corpus would give every id another meaning than
    the one the weights learnt."""
    if not weights:
        return None
    if not Path(weights).exists():
        from flexmesh.errors import DataError

        raise DataError(f"--weights {weights}: no such file or folder; give a .safetensors file, its index, or a "
                        "Hugging Face model folder")
    folder = Path(weights) if Path(weights).is_dir() else Path(weights).parent
    found = folder / "tokenizer.json"
    if not found.is_file():
        from flexmesh.errors import DataError

        raise DataError(f"--weights {weights} has no tokenizer.json beside it, and a tokenizer trained on the corpus "
                        "would not match the ids the weights learnt: pass --tokenizer with the weights' own")
    return str(found)
