"""Regenerate (or check) the example outputs in docs/*.md from the commands that make them.

An example in a doc is a fenced block between two markers; the first names the command, the block
shows it after ``$`` and then its output, as a terminal of ``COLUMNS`` columns prints it:

    <!-- example: flexmesh plan --model llama3-8b --cluster 8xH100 --top 3 -->
    ```
    $ flexmesh plan --model llama3-8b --cluster 8xH100 --top 3
    ...
    ```
    <!-- /example -->

``python docs/examples.py`` runs every example's command and rewrites its block; ``--check`` runs
them and fails (exit 1, naming the doc and command) where a block differs from what the command
prints now. Wall-clock figures (search seconds, scheduler milliseconds) are masked in the
comparison: they change from run to run, nothing else may. ``--quick`` leaves out the examples
marked ``<!-- example(slow): ... -->`` (those whose MILP schedules depend on the solver's time limit,
hence on the machine's load). tests/test_docs_examples.py runs ``--check --quick``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
COLUMNS = 120
MARK = re.compile(r"<!-- example(\(slow\))?: (.+?) -->\n```\n(.*?)```\n<!-- /example -->", re.S)
# Wall-clock figures: a search's seconds, plan's phases, a table's scheduler-milliseconds column, the serving
# simulator's speed.
TIMES = [re.compile(r"(configurations,\s+)\d+(\.\d+)?\s+s"), re.compile(r"(search\s+)\d+(\.\d+)?\s+s"),
         re.compile(r"(baselines\s+)\d+(\.\d+)?\s+s"), re.compile(r"(scored\s+in\s+)\d+(\.\d+)?\s+s"),
         re.compile(r"(requests\s+in\s+)\d+(\.\d+)?\s+s\s+\([\d,]+\s+requests\s+a\s+minute\)"),
         re.compile(r"((?:took|recommendation|rest)\s+)\d+(\.\d+)?\s+s")]  # plan's line of its phases


def run(command: str) -> str:
    """What ``command`` (``flexmesh ...``) prints on stdout and stderr, as the block shows it.

    Run by flexmesh's own entry point (flexmesh.cli.main) in this process, as ``python -m flexmesh`` in a
    child would run it (a terminal of COLUMNS columns, the repository as the working folder), without a
    Python and its imports started for every example; the environment and folder are put back after."""
    import contextlib
    import io
    import traceback

    if str(DOCS.parent) not in sys.path:  # this repository's flexmesh, as `python -m flexmesh` run here finds it
        sys.path.insert(0, str(DOCS.parent))
    from flexmesh.cli import main

    argv = shlex.split(command)
    env = dict(COLUMNS=str(COLUMNS), OMP_NUM_THREADS="1", TERM="dumb")
    while "=" in argv[0]:  # leading VAR=value words, as a shell reads them (COLUMNS=200 flexmesh ...)
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    saved, here = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update(env)
        os.chdir(DOCS.parent)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # a traceback, as a child process would print it
                err.write(traceback.format_exc())
                code = 1
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    if code != 0:
        raise SystemExit(f"{command} failed (exit {code}):\n{err.getvalue()[-2000:]}")
    lines = [ln.rstrip() for ln in (out.getvalue() + err.getvalue()).splitlines()]
    return f"$ {command}\n" + "\n".join(lines).strip("\n") + "\n"


def masked(block: str) -> str:
    r"""``block`` with its wall-clock figures replaced by ``#`` and its white space folded: rich centres
    and wraps a title by its width, so a search of 10.4 s moves a title that one of 3.9 s does not.

    >>> masked(" plan (636 configurations;\n   search 3.89 s)") == masked("  plan (636 configurations; search 10.38 s)")
    True
    """
    for pattern in TIMES:
        block = pattern.sub(lambda m: m.group(1) + "# s", block)
    out, sched = [], None
    for line in block.splitlines():
        cells = re.split(r"[┃│]", line)
        if line.startswith("┃") and any("sched" in c for c in cells):
            sched = next(i for i, c in enumerate(cells) if "sched" in c)
        elif line.startswith("│") and sched is not None and len(cells) > sched:
            cells[sched] = re.sub(r"\d", "#", cells[sched])
            line = "│".join(cells)
        elif not line.startswith(("┃", "│", "┡", "┏", "└")):
            sched = None
        out.append(line)
    return re.sub(r"\s+", " ", "\n".join(out)).strip()


def _redo(m: re.Match, doc: Path, args: argparse.Namespace, stale: list[str]) -> str:
    """The example ``m`` of ``doc`` with its command's output now; a difference noted in ``stale``."""
    if m.group(1) and args.quick:
        return m.group(0)
    now = run(m.group(2))
    if args.check and masked(now) != masked(m.group(3)):
        stale.append(f"stale example: {doc.name}: {m.group(2)} (regenerate: python docs/examples.py {doc})")
    return m.group(0).replace(m.group(3), now)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of rewriting; exit 1 on a difference")
    ap.add_argument("--quick", action="store_true", help="leave out the examples marked slow")
    ap.add_argument("docs", nargs="*", help="docs to process (default: every docs/*.md)")
    args = ap.parse_args()
    stale = []
    for doc in [Path(d) for d in args.docs] or sorted(DOCS.glob("*.md")):
        text = doc.read_text()
        new = MARK.sub(lambda m, doc=doc: _redo(m, doc, args, stale), text)
        if not args.check and new != text:
            doc.write_text(new)
            print(f"rewrote {doc.name}")
    print("\n".join(stale), end="\n" if stale else "")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
