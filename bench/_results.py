"""Benchmark records, written only here: every bench run calls :func:`record`, which

- replaces the bench's section of bench/RESULTS.md (what holds now: the latest table of each section) with
  its table, the commit it ran on, the date, the machine, the versions, a headline figure and its targets,
- rewrites the summary at the top of RESULTS.md from the sections,
- and, for a run on a GPU, writes the same section into the campaign's own file,
  ``bench/records/<date>-<gpu>.md`` (torchtitan's habit: one file per campaign, with its hardware and
  versions; a later campaign is a new file, an old one is never re-stamped).

Whether a record's code changed since it ran is computed by ``python -m bench.status`` from the paths each
bench declares in ``DEPENDS_ON``; nothing in these files is written by hand.

A section, as written (``- key: value`` lines, then the bench's body)::

    <!-- bench:search -->
    ## search (`bench/search.py`)

    - commit: c2ac8ca
    - date: 2026-11-26
    - machine: x86_64, 2 CPU cores
    - versions: python 3.11.7, torch 2.13.0+cpu
    - headline: (f) 504x8xH100 searched in 7.44 s (target 10)
    - targets: 7 of 7 met

    | case | ... |
    <!-- /bench:search -->

A bench states each target it checks as PASS or FAIL in its body; ``targets`` counts them.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import TypeVar

RESULTS = Path(__file__).with_name("RESULTS.md")
RECORDS = Path(__file__).with_name("records")  # one file per GPU campaign
HEADER = """# Benchmark results

What holds now: the latest record of each bench, one section each, written by the bench when it runs
(`python -m bench.<script>`, through `bench/_results.py`); runs on a GPU also go to their campaign's file
under [bench/records/](records/). Whether a record's code changed since it ran: `python -m bench.status`.
"""
SUMMARY_BEGIN, SUMMARY_END = "<!-- summary: written from the sections below -->", "<!-- /summary -->"
KEYS = ("commit", "date", "machine", "versions", "headline", "targets", "campaign")
REPEATS = 3  # timed runs of a search; the fastest is recorded
S = TypeVar("S")
T = TypeVar("T")


def fastest(setup: Callable[[], S], run: Callable[[S], T], label: str) -> tuple[S, T, float]:
    """``run(setup())`` :data:`REPEATS` times, a fresh ``setup()`` (cost models, their caches empty) each
    time and only ``run`` timed: the last (state, result) and the fastest time, as timeit reports (what
    other work on the machine adds is noise, not the code's time); the times are printed after ``label``."""
    times = []
    for _ in range(REPEATS):
        state = setup()
        t0 = time.perf_counter()
        out = run(state)
        times.append(time.perf_counter() - t0)
    print(f"{label}: {', '.join(f'{t:.2f}' for t in times)} s")
    return state, out, min(times)


def markdown_table(columns, rows) -> list[str]:
    """Lines of a markdown table.

    >>> markdown_table(["a", "b"], [[1, 2]])
    ['| a | b |', '|---|---|', '| 1 | 2 |']
    """
    return ["| " + " | ".join(map(str, columns)) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def fold_plan(layout: str) -> str:
    """A plan's one-line layout with runs of equal consecutive chunks folded into one, so that a table
    cell holds a 126-layer pipeline (chunks split by `` | `` or, inside a markdown table, `` / ``).

    >>> fold_plan("pp4 1f1b m8 / [0,2) 2x tp8 / [2,4) 2x tp8 / [4,6) 2x tp8 / [6,7) 1x tp8-ac + 1x tp8")
    'pp4 1f1b m8 / [0,6) 3 chunks of 2x tp8 / [6,7) 1x tp8-ac + 1x tp8'
    """
    sep = " | " if " | " in layout else " / "
    head, *chunks = layout.split(sep)
    out: list[tuple[int, int, str, int]] = []  # (start, end, what, chunks)
    for chunk in chunks:
        m = re.fullmatch(r"\[(\d+),(\d+)\) (.*)", chunk)
        if m is None:
            return layout  # not a layout this function knows: leave it whole
        a, b, what = int(m[1]), int(m[2]), m[3]
        if out and out[-1][2] == what and out[-1][1] == a and b - a == (out[-1][1] - out[-1][0]) // out[-1][3]:
            out[-1] = (out[-1][0], b, what, out[-1][3] + 1)
        else:
            out.append((a, b, what, 1))
    return sep.join([head, *(f"[{a},{b}) {what}" if n == 1 else f"[{a},{b}) {n} chunks of {what}"
                             for a, b, what, n in out)])


# ---- what a record says ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """One bench run's record: ``name`` its section, ``script`` the bench module under bench/ that wrote it."""

    name: str
    script: str
    commit: str  # short hash; "-dirty" when tracked files other than the records differed
    date: str
    machine: str
    versions: str
    headline: str
    targets: str
    body: str
    campaign: str = ""  # the campaign file (relative to bench/) of a run on a GPU

    def render(self) -> str:
        meta = [f"- {k}: {getattr(self, k) or '-'}" for k in KEYS if k != "campaign" or self.campaign]
        return "\n".join([f"<!-- bench:{self.name} -->", f"## {self.name} (`bench/{self.script}.py`)", "", *meta, "",
                          self.body.strip(), f"<!-- /bench:{self.name} -->"])

    @property
    def base_commit(self) -> str:
        return self.commit.removesuffix("-dirty")


SECTION_RE = re.compile(r"<!-- bench:(?P<name>\S+) -->\n(?P<text>.*?)<!-- /bench:(?P=name) -->", re.S)
HEADING_RE = re.compile(r"## (?P<name>\S+) \(`bench/(?P<script>\w+)\.py`\)\n")


def parse_sections(text: str) -> list[Section]:
    """The sections of a results or campaign file, in order (the inverse of :meth:`Section.render`)."""
    out = []
    for m in SECTION_RE.finditer(text):
        body = m["text"]
        head = HEADING_RE.match(body)
        if head is None or head["name"] != m["name"]:
            raise ValueError(f"section {m['name']}: its heading does not name it and its bench/<script>.py")
        meta, rest = {}, body[head.end():].lstrip("\n").split("\n")
        while rest and (kv := re.fullmatch(r"- (\w+): (.*)", rest[0])) and kv[1] in KEYS:
            meta[kv[1]] = kv[2]
            rest.pop(0)
        missing = [k for k in KEYS[:6] if k not in meta]
        if missing:
            raise ValueError(f"section {m['name']} lacks {', '.join(missing)}")
        out.append(Section(m["name"], head["script"], body="\n".join(rest).strip(), **meta))
    return out


def count_targets(body: str) -> str:
    """How many of the targets a body states (each as a PASS or a FAIL) were met.

    >>> count_targets("| a | 1.2x | PASS |\\n| b | 21 ms (<= 20) | FAIL |")
    '1 of 2 met'
    >>> count_targets("a table without targets")
    'none stated'
    """
    met, missed = len(re.findall(r"\bPASS\b", body)), len(re.findall(r"\bFAIL\b", body))
    return f"{met} of {met + missed} met" if met + missed else "none stated"


# ---- where and on what it ran ---------------------------------------------------------------------------


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd).stdout.strip()


def commit(root: Path = RESULTS.parent) -> str:
    """HEAD's short hash, with ``-dirty`` when tracked files differ from it (the records themselves aside:
    earlier benches of the same run rewrite them). A device machine's copy of the tree reads the hash that
    ``bench/gpu_session.sh`` was handed (``.commit``, written where the tree was clean): the git folder that
    travels with such a copy can be older than the tree (seen on 2026-11-30: HEAD 023b5a7, tree a575626)."""
    given = os.environ.get("FLEXMESH_BENCH_COMMIT")
    if given:
        return given
    sha = _git("rev-parse", "--short", "HEAD", cwd=root)
    if not sha:
        return "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)bench/RESULTS.md",
                   ":(exclude,top)bench/records", cwd=root)
    return sha + ("-dirty" if changed else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> str:
    """Python and the installed torch and transformers (read from their metadata: nothing is imported)."""
    found = [(p, _version(p)) for p in ("torch", "transformers")]
    return ", ".join([f"python {platform.python_version()}", *(f"{p} {v}" for p, v in found if v)])


def cpu_machine() -> str:
    """``x86_64, 2 CPU cores (AMD EPYC ...), 24 GiB``: what a CPU run ran on."""
    model = ""
    if Path("/proc/cpuinfo").exists():
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores{f' ({model})' if model else ''}{memory}"


def gpu_hardware() -> tuple[str, list[str]]:
    """The GPU a run measured (its name and count) and the campaign file's hardware lines."""
    import torch  # only a bench that ran on a GPU asks, and it has imported torch already

    props = torch.cuda.get_device_properties(0)
    name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
    lines = [f"- GPU: {name} x{count}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs",
             f"- CUDA (torch's build): {torch.version.cuda}", f"- host: {cpu_machine()}"]
    return f"{name} x{count}", lines


# ---- writing ------------------------------------------------------------------------------------------


def short_machine(machine: str) -> str:
    """The machine without its CPU model and memory.

    >>> short_machine("x86_64, 2 CPU cores (AMD EPYC 7B13), 24 GiB")
    'x86_64, 2 CPU cores'
    """
    return re.split(r" \(|, \d+ GiB", machine)[0]


def summary(sections: Iterable[Section]) -> str:
    """The table at the top of RESULTS.md: one row per section (whether its code changed since is asked of
    git by ``python -m bench.status``, never written down)."""
    rows = [[s.name, s.commit, s.date, short_machine(s.machine), s.headline, s.targets] for s in sections]
    return "\n".join([SUMMARY_BEGIN, *markdown_table(["section", "commit", "date", "machine", "headline",
                                                      "targets"], rows), SUMMARY_END])


def results_text(sections: Sequence[Section]) -> str:
    """All of RESULTS.md, from its sections."""
    return "\n\n".join([HEADER.rstrip(), summary(sections), *(s.render() for s in sections)]) + "\n"


def put(sections: Sequence[Section], new: Section) -> list[Section]:
    """``sections`` with ``new`` in place of the section of its name (appended when it is new)."""
    names = [s.name for s in sections]
    return [new if s.name == new.name else s for s in sections] if new.name in names else [*sections, new]


def campaign_text(old: str | None, title: str, hardware: Sequence[str], new: Section) -> str:
    """A campaign file with ``new`` written in: a new file gets the hardware and versions it ran on."""
    if old is None:
        old = "\n".join([f"# {title}", "", "Written by `bench/_results.py` as each bench of this campaign ran; a "
                         "later campaign is a new file.", "", "## Hardware", "", *hardware, "", "## Versions", "",
                         f"- {new.versions}", "", ""])
    first = SECTION_RE.search(old)
    head = old[:first.start()] if first else old.rstrip() + "\n\n"
    return head + "\n\n".join(s.render() for s in put(parse_sections(old), new)) + "\n"


def record(name: str, body: str, *, headline: str, script: str | None = None, gpu: bool = False) -> None:
    """Write a bench run's section ``name`` (its markdown ``body``: tables and the lines that explain them,
    each target as PASS or FAIL; ``headline`` its one-line key figure) into RESULTS.md, stamped with the
    commit, date, machine and versions; ``script`` is the bench module (default ``name``). ``gpu``: the run
    measured a GPU, so the section also goes to the campaign file ``bench/records/<date>-<gpu>.md``."""
    today = datetime.date.today().isoformat()
    headline = " ".join(headline.split()).replace("|", "/")  # one line, and one cell of the summary
    section = Section(name, script or name, commit(), today, cpu_machine(), versions(), headline,
                      count_targets(body), body)
    if gpu:
        machine, hardware = gpu_hardware()
        slug = re.sub(r"[^a-z0-9]+", "-", machine.lower().removeprefix("nvidia ").rsplit(" x", 1)[0]).strip("-")
        path = RECORDS / f"{today}-{slug}.md"
        section = replace(section, machine=machine, campaign=f"records/{path.name}")
        RECORDS.mkdir(exist_ok=True)
        path.write_text(campaign_text(path.read_text() if path.exists() else None,
                                      f"{machine.rsplit(' x', 1)[0]}, {today}", hardware, section))
    sections = parse_sections(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(results_text(put(sections, section)))
