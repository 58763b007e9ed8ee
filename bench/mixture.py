"""Data mixtures on a tiny model: DoReMi and ODM against the proportional mixture, at equal tokens.

Three domains of very unequal size, each split into training and held-out documents (every tenth file held out, at
most 32): the standard library's ``.py`` sources (code, tens of MB), this repository's ``docs/`` (prose about
flexmesh, half a MB) and the installed packages' ``METADATA`` files (their READMEs: prose and markup about other
projects, about a MB; what is installed varies a little from machine to machine, so the table says how many). One
byte-level BPE is trained on the three training sets together. Each run trains the same tiny Llama (2 layers, hidden
128) from the same initial weights for ``--steps`` steps of 16 documents of up to 512 tokens, evaluating every
domain's held-out set every ``--eval-every`` steps:

- ``static``: the proportional mixture (each domain's share of the tokens), the run a user gets without a mixture;
- ``doremi``: DoReMi's excess-loss weights, the static run of the same seed as its reference;
- ``odm``: ODM's bandit;
- ``reweight``: the proportional mixture with each step's documents weighed by their loss (``--reweight linupper``,
  Sow et al.'s choice for pre-training); it runs a forward more per step, so each run's training time per token
  over ``static``'s is given beside it (measured two runs at a time).

A mixture changes how many tokens a step holds (its documents' lengths differ per domain), so runs are compared at
equal tokens: each run's mean per-domain held-out loss (every domain counts alike, as DataFlex and DoReMi report),
interpolated linearly in tokens seen at the fewest tokens any run of that seed reached. Three seeds (data order and
initial weights); the gap to static is per seed, then its mean and standard deviation.

Run: ``OMP_NUM_THREADS=1 python -m bench.mixture [--steps 200] [--no-record]`` (two runs at a time on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench._results import markdown_table, record

DEPENDS_ON = ("flexmesh/data", "flexmesh/runtime", "flexmesh/commands", "flexmesh/layout", "flexmesh/spec",
              "flexmesh/schedule", "flexmesh/sim", "flexmesh/cost", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py", "flexmesh/units.py")
ROOT = Path(__file__).resolve().parent.parent
MIXTURES = ("static", "doremi", "odm", "reweight")
FLAGS = {"static": ["--mixture", "static"], "doremi": ["--mixture", "doremi"], "odm": ["--mixture", "odm"],
         "reweight": ["--mixture", "static", "--reweight", "linupper"]}
SEEDS = (0, 1, 2)
HELD_OUT_EVERY, HELD_OUT_MAX = 10, 32


def _sources() -> dict[str, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = sorted(p for p in stdlib.rglob("*.py") if not {"site-packages", "dist-packages", "__pycache__"}
                  & set(p.parts))
    docs = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
    meta = sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA"))
    return {"stdlib": code, "docs": docs, "metadata": meta}


def _lay_out(folder: Path) -> dict[str, int]:
    """The domains' training and held-out folders (links to the files) and the manifest; files per domain."""
    rows, counts = [], {}
    for name, files in _sources().items():
        held = set(files[::HELD_OUT_EVERY][:HELD_OUT_MAX])
        for split in ("train", "eval"):
            (folder / name / split).mkdir(parents=True)
        for i, f in enumerate(files):
            (folder / name / ("eval" if f in held else "train") / f"{i:05d}.txt").symlink_to(f)
        counts[name] = len(files)
        rows.append({"name": name, "corpus": f"{name}/train", "eval": f"{name}/eval"})
    (folder / "domains.json").write_text(json.dumps({"domains": rows}, indent=1))
    return counts


def _inputs(folder: Path) -> None:
    from flexmesh.data.corpus import read_corpus
    from flexmesh.data.tokenizer import train_bpe
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    corpus = read_corpus(folder, extensions=(".txt",), exclude_dirs=("eval",))  # the three training sets
    train_bpe(corpus, vocab_size=2048, cache_dir=folder / "cache").save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 2048, "torch_dtype": "float32",
        "max_position_embeddings": 512}))
    st = StagePlan(0, 2, (LayerStrategy.parse("tp1-dp1z0"),) * 2)
    Plan.uniform(model=str(folder / "config.json"), cluster="1xA100-80GB", world_size=1, pp=1,
                 pipeline_schedule="1f1b", num_microbatches=1, seq_len=512, global_batch=16,
                 stages=(st,)).save(folder / "plan.json")


def _train(folder: Path, mixture: str, seed: int, steps: int, every: int) -> Path:
    out = folder / f"{mixture}-{seed}"
    extra = ["--mixture-reference", str(folder / f"static-{seed}")] if mixture == "doremi" else []
    cmd = [sys.executable, "-m", "flexmesh", "train", "--plan", str(folder / "plan.json"), "--model",
           str(folder / "config.json"), "--tokenizer", str(folder / "tokenizer.json"), "--domains",
           str(folder / "domains.json"), *FLAGS[mixture], *extra, "--max-steps", str(steps), "--seed", str(seed),
           "--eval-every", str(every), "--eval-docs", "32", "--out", str(out), "--no-progress", "--cache-dir",
           str(folder / "cache"), "--lr", "2e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{mixture} seed {seed} failed:\n{proc.stderr[-3000:]}")
    print(f"  {mixture} seed {seed} done", flush=True)
    return out


def _curve(out: Path) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """(tokens seen, mean per-domain held-out loss) at each evaluated step, and every row."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seen = np.cumsum([r["tokens"] for r in rows])
    at = [i for i, r in enumerate(rows) if r["eval_domain_loss"]]
    return seen[at], np.array([rows[i]["eval_loss"] for i in at]), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--no-record", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flexmesh-mixture-") as tmp:
        folder = Path(tmp)
        counts = _lay_out(folder)
        _inputs(folder)
        runs: dict[tuple[str, int], Path] = {}
        with ThreadPoolExecutor(2) as pool:  # two runs at a time, one core each; doremi waits for its reference
            static = {s: pool.submit(_train, folder, "static", s, args.steps, args.eval_every) for s in SEEDS}
            odm = {s: pool.submit(_train, folder, "odm", s, args.steps, args.eval_every) for s in SEEDS}
            for s in SEEDS:
                runs["static", s] = static[s].result()
            doremi = {s: pool.submit(_train, folder, "doremi", s, args.steps, args.eval_every) for s in SEEDS}
            weighed = {s: pool.submit(_train, folder, "reweight", s, args.steps, args.eval_every) for s in SEEDS}
            for s in SEEDS:
                runs["odm", s], runs["doremi", s] = odm[s].result(), doremi[s].result()
                runs["reweight", s] = weighed[s].result()
        curves = {k: _curve(v) for k, v in runs.items()}
    names = curves["static", 0][2][0]["domains"]
    at = {s: min(curves[m, s][0][-1] for m in MIXTURES) for s in SEEDS}  # equal tokens, per seed
    loss = {(m, s): float(np.interp(at[s], curves[m, s][0], curves[m, s][1])) for m in MIXTURES for s in SEEDS}
    per_domain = {}
    for m in MIXTURES:
        finals = np.array([curves[m, s][2][-1]["eval_domain_loss"] for s in SEEDS])
        per_domain[m] = finals.mean(axis=0)
    def per_token(rows: list[dict]) -> float:  # training seconds per token, the first step (one-off costs) left out
        return sum(r["step_time_s"] for r in rows[1:]) / sum(r["tokens"] for r in rows[1:])

    step_s = {m: np.mean([per_token(curves[m, s][2]) for s in SEEDS]) for m in MIXTURES}
    table = []
    for m in MIXTURES:
        gaps = np.array([loss[m, s] - loss["static", s] for s in SEEDS])
        weights = np.mean([curves[m, s][2][-1]["domain_weight"] for s in SEEDS], axis=0)
        table.append([m, f"{np.mean([loss[m, s] for s in SEEDS]):.4f}",
                      "-" if m == "static" else f"{gaps.mean():+.4f} ± {gaps.std(ddof=1):.4f}",
                      " / ".join(f"{x:.3f}" for x in per_domain[m]), " / ".join(f"{w:.2f}" for w in weights),
                      f"{step_s[m] / step_s['static']:.2f}"])
    best = min(("doremi", "odm"), key=lambda m: np.mean([loss[m, s] - loss["static", s] for s in SEEDS]))
    gap = np.mean([loss[best, s] - loss["static", s] for s in SEEDS])
    lines = [f"Domains ({' / '.join(names)}): {', '.join(f'{n} {counts[n]} files' for n in names)}; {args.steps} steps "
             f"of 16 documents, held-out every {args.eval_every}; compared at {np.mean(list(at.values())):,.0f} tokens "
             "(mean over seeds). Single process per run, two runs at a time on two cores, OMP_NUM_THREADS=1.", ""]
    lines += markdown_table(["mixture", "mean per-domain held-out loss", "gap to static (mean ± sd, 3 seeds)",
                             "final held-out loss per domain", "final weights", "time per token / static"], table)
    rw = np.array([loss["reweight", s] - loss["static", s] for s in SEEDS])
    lines += ["", "Time per token: each run's step time over its tokens (the first step left out), mean over seeds, "
                  "over static's.", "",
              f"Target (#81): DoReMi or ODM below the proportional mixture at equal tokens: {best} "
              f"{gap:+.4f} {'PASS' if gap < 0 else 'FAIL'}",
              f"Reweighting (linupper) against the proportional mixture at equal tokens: {rw.mean():+.4f} ± "
              f"{rw.std(ddof=1):.4f} (no target)"]
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        record("mixture", body, headline=f"{best} {gap:+.4f} mean per-domain held-out loss vs proportional "
                                         "(3 seeds, equal tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
