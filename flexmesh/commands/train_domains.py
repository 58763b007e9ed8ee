"""``flexmesh train --domains``: the domains' corpora checked before any rank starts, the loader that draws
each step over them by ``--mixture``, and each domain's held-out set (docs/mixtures.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flexmesh.errors import DataError, PlanError
from flexmesh.job import Job


def check_domains(args: argparse.Namespace) -> None:
    """Refuse in one line, before anything starts, what ``--domains`` cannot run: a bad manifest or corpus,
    another source of documents beside it, batches counted in tokens, a doremi mixture without its
    reference, ``--mixture`` without domains; and ``--reweight-delta`` out of range or without ``--reweight``
    (what a plan refuses of ``--reweight``: flexmesh.commands.train_data.check_evaluation)."""
    from flexmesh.data.corpus import read_corpus
    from flexmesh.data.mixture import read_domains

    if getattr(args, "reweight", None) is None and args.reweight_delta != 1.0:
        raise PlanError("--reweight-delta sets --reweight's spread; give --reweight STRATEGY or drop it")
    if not args.reweight_delta > 0:
        raise PlanError(f"--reweight-delta must be above 0, got {args.reweight_delta}")
    if not args.domains:
        if args.mixture != "static" or args.mixture_reference:
            raise PlanError("--mixture and --mixture-reference draw over the domains of --domains; give --domains "
                            "PATH")
        return
    if args.corpus or args.tasks:
        raise PlanError("--domains is the run's corpus: drop --corpus and --tasks, or drop --domains")
    if getattr(args, "tokens_per_step", None):
        raise PlanError("--domains draws documents per step (--global-batch); drop --tokens-per-step")
    domains = read_domains(args.domains)
    for d in domains:
        for path in (d.corpus, d.eval):
            if path is not None and path != "stdlib":
                read_corpus(path)
    if args.mixture == "doremi" and not args.mixture_reference:
        raise PlanError("--mixture doremi needs --mixture-reference RUN: the folder of a --mixture static run of the "
                        "same --domains (DoReMi's reference losses)")
    if args.mixture != "doremi" and args.mixture_reference:
        raise PlanError("--mixture-reference is DoReMi's reference run; drop it or use --mixture doremi")
    evals = [d.eval is not None for d in domains]
    if any(evals) and not all(evals):
        raise DataError(f"{args.domains}: give every domain an eval corpus, or none (--eval-corpus then evaluates "
                        "one held-out set)")
    if args.eval_corpus is not None and any(evals):
        raise PlanError("the --domains manifest names each domain's held-out set (eval); drop --eval-corpus")


def mixture_loader(args: argparse.Namespace, job: Job, corpora: list):  # noqa: ANN201 - a MixtureLoader
    """The run's loader over the domains' tokenized ``corpora`` (in manifest order), drawing
    ``--global-batch`` documents per step by ``--mixture`` from the manifest's weights (else each domain's
    share of the tokens)."""
    from flexmesh.data.mixture import Mixture, MixtureLoader, initial_weights, read_domains, reference_losses

    domains = read_domains(args.domains)
    names = [d.name for d in domains]
    reference = None
    if args.mixture == "doremi":
        from flexmesh.runtime.state.rundir import METRICS, read_metrics

        path = Path(args.mixture_reference) / METRICS
        if not path.is_file():
            raise DataError(f"--mixture-reference {args.mixture_reference}: no {METRICS} there; give the folder of a "
                            "--mixture static run of the same --domains")
        reference = reference_losses([json.loads(line) for _, line in read_metrics(path)], names, str(path))
    weights = initial_weights(domains, [int(c.lengths.sum()) for c in corpora])
    mixture = Mixture(args.mixture, names, weights, reference)
    if job.global_batch is None:
        raise PlanError("--domains draws documents per step: give --global-batch")
    return MixtureLoader(corpora, mixture, job.global_batch, job.seq_len, seed=args.seed)


def domain_evals(args: argparse.Namespace, job: Job, tok, end_of_text: int | None, schedule_fn):  # noqa: ANN001, ANN201
    """The held-out sets the ``--domains`` manifest names (``eval`` per domain), each its first
    ``--eval-docs`` documents laid out by ``schedule_fn``: a DomainEvals; None when no domain names one."""
    from flexmesh.data.corpus import read_corpus, stdlib_corpus
    from flexmesh.data.loader import tokenize_corpus
    from flexmesh.data.mixture import read_domains
    from flexmesh.runtime.train.evaluate import DomainEvals, HeldOutEval, held_out_documents

    named = [(d.name, d.eval) for d in read_domains(args.domains) if d.eval]
    if not named:
        return None
    sets = []
    for name, path in named:
        corpus = stdlib_corpus() if path == "stdlib" else read_corpus(path)
        docs = held_out_documents(tokenize_corpus(corpus, tok, cache_dir=args.cache_dir, end_of_text=end_of_text),
                                  args.eval_docs, job.seq_len)
        if not docs:
            raise DataError(f"domain {name!r}: its eval corpus {path} has no document of two tokens or more")
        sets.append(HeldOutEval.of(docs, args.eval_every, schedule_fn))
    return DomainEvals(tuple(n for n, _ in named), tuple(sets))
