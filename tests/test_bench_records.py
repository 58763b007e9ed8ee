"""The benchmark records the machine keeps (bench/_results.py writes them, bench/status.py reads them):
every bench declares the code it depends on, status tells from git whether that code changed since a
record's commit, and bench/RESULTS.md holds only what the writer generates."""

import ast
import datetime
import doctest
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import _results, status
from bench._results import Section, count_targets, parse_sections, results_text

grimp = pytest.importorskip("grimp")  # a dev extra: a GPU machine's `pytest -m cuda` may lack it

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _recorders() -> list[Path]:
    """The bench modules that write a section: those that import ``record`` from bench._results."""
    out = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ImportFrom) and n.module == "bench._results"
               and any(a.name == "record" for a in n.names) for n in ast.walk(tree)):
            out.append(path)
    return out


def _imports(path: Path) -> set[str]:
    names = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module:
            names |= {n.module, *(f"{n.module}.{a.name}" for a in n.names)}
        elif isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
    return names


def _module_path(module: str) -> str:
    p = ROOT / module.replace(".", "/")
    return (p / "__init__.py" if p.is_dir() else p.with_suffix(".py")).relative_to(ROOT).as_posix()


def _covered(path: str, declared: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in declared)


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("flexmesh", cache_dir=None)


def test_every_bench_declares_the_code_it_depends_on(graph):
    recorders = _recorders()
    assert len(recorders) >= 20, [p.name for p in recorders]
    for path in recorders:
        deps = status.declared(path)
        assert deps, f"{path.name} declares no {status.DECLARATION}"
        assert all((ROOT / d).exists() for d in deps), f"{path.name}: declared paths missing: " + \
            ", ".join(d for d in deps if not (ROOT / d).exists())
        imported = _imports(path)
        # What it imports from flexmesh, and all that imports in turn (the root package's __init__ holds only
        # the version string, so it is left out).
        direct = {m for m in imported if m in graph.modules}
        reached = set(direct).union(*(graph.find_upstream_modules(m) for m in direct)) - {"flexmesh"}
        uncovered = sorted(m for m in reached if not _covered(_module_path(m), deps))
        assert not uncovered, f"{path.name} imports code its {status.DECLARATION} leaves out: {uncovered}"
        benches = {m for m in imported if m.startswith("bench.") and not m.startswith("bench._")
                   and (ROOT / _module_path(m)).exists()}
        assert all(_module_path(m) in deps for m in benches), f"{path.name} imports {benches}: declare their files"


def test_results_md_holds_only_generated_sections():
    text = (BENCH / "RESULTS.md").read_text()
    sections = parse_sections(text)
    assert sections and text == results_text(sections), "RESULTS.md differs from what bench/_results.py writes"
    for s in sections:
        assert s.targets == count_targets(s.body) or s.body.count("PASS") + s.body.count("FAIL") == 0, s.name
        assert (BENCH / f"{s.script}.py").exists(), s.name
    assert not re.search(r"stands at|stale|not re-run|still holds", text, re.I), "a hand-written note on staleness"


def test_gpu_sections_name_their_campaign_file():
    for s in parse_sections((BENCH / "RESULTS.md").read_text()):
        if s.campaign:
            campaign = parse_sections((BENCH / s.campaign).read_text())
            assert s in campaign, f"{s.name}: its campaign file holds another record"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _commit_all(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(repo, "rev-parse", "--short", "HEAD")


def test_status_flips_to_changed_when_a_declared_file_changes(tmp_path):
    repo = tmp_path
    _git(repo, "init", "-q")
    (repo / "bench").mkdir()
    (repo / "pkg").mkdir()
    (repo / "bench" / "foo.py").write_text('DEPENDS_ON = ("pkg/a.py",)\n')
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "pkg" / "b.py").write_text("B = 1\n")
    sha = _commit_all(repo, "first")
    section = Section("foo", "foo", sha + "-dirty", "2026-11-26", "x86_64", "python 3", "1.0x", "none stated", "| a |")
    (repo / "bench" / "RESULTS.md").write_text(results_text([section]))
    _commit_all(repo, "record")
    [st] = status.statuses(repo)
    assert st.code == "unchanged" and st.section == section

    (repo / "pkg" / "b.py").write_text("B = 2\n")  # not declared
    _commit_all(repo, "b")
    assert status.code_since(section, repo).code == "unchanged"

    (repo / "pkg" / "a.py").write_text("A = 2\n")
    _commit_all(repo, "a")
    st = status.code_since(section, repo)
    assert st.code == "changed (1 file)" and st.changed == ("pkg/a.py",)

    (repo / "pkg" / "a.py").write_text("A = 1\n")  # back as it was: the code is the record's again
    _commit_all(repo, "a back")
    assert status.code_since(section, repo).code == "unchanged"

    (repo / "pkg" / "a.py").write_text('"""What A is."""\n\n# one\nA = 1  # the first\n')  # words only
    _commit_all(repo, "a words")
    assert status.code_since(section, repo).code == "unchanged"
    (repo / "pkg" / "a.py").write_text('"""What A is."""\n\nA = "1"\n')  # a string that is code, not a docstring
    _commit_all(repo, "a string")
    assert status.code_since(section, repo).changed == ("pkg/a.py",)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    _commit_all(repo, "a back again")

    (repo / "bench" / "foo.py").write_text('DEPENDS_ON = ("pkg/a.py",)\nX = 1\n')  # the bench's own file counts
    _commit_all(repo, "bench")
    assert status.code_since(section, repo).changed == ("bench/foo.py",)


def test_status_leaves_out_package_modules_no_process_of_the_bench_can_import(tmp_path):
    repo = tmp_path
    _git(repo, "init", "-q")
    files = {
        "bench/foo.py": 'DEPENDS_ON = ("flexmesh",)\nfrom flexmesh.a import A\n',
        "flexmesh/__init__.py": "",
        "flexmesh/a.py": "from flexmesh import b\nA = 1\n",
        "flexmesh/b.py": "def f():\n    from flexmesh.c import C  # function-local: reachable\n",
        "flexmesh/c.py": "C = 1\n",
        "flexmesh/other.py": "O = 1\n",  # no process of foo imports it
        "flexmesh/__main__.py": "import importlib\nimportlib.import_module(f'flexmesh.commands.{1}')\n",
        "flexmesh/commands/__init__.py": "",
        "flexmesh/commands/run.py": "R = 1\n",
    }
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    sha = _commit_all(repo, "first")
    section = Section("foo", "foo", sha, "2026-11-28", "x86_64", "python 3", "1.0x", "none stated", "| a |")

    def changed(path: str, text: str) -> tuple[str, ...]:
        (repo / path).write_text(text)
        _commit_all(repo, path)
        return status.code_since(section, repo).changed

    assert changed("flexmesh/other.py", "O = 2\n") == ()  # unreached: left out
    assert changed("flexmesh/commands/run.py", "R = 2\n") == ()  # foo starts no Python
    assert changed("flexmesh/c.py", "C = 2\n") == ("flexmesh/c.py",)  # through b's function-local import
    # foo now starts `python -m flexmesh`: its __main__ and all it imports by constant prefix count
    assert changed("bench/foo.py", files["bench/foo.py"] + "import sys\nCMD = [sys.executable, '-m', 'flexmesh']\n") \
        == ("bench/foo.py", "flexmesh/c.py", "flexmesh/commands/run.py")
    # a module imported by a computed name: nothing can be left out
    assert "flexmesh/other.py" in changed("flexmesh/c.py", "import importlib\nimportlib.import_module(NAME)\n")
    # a module that stops importing another: the importer counts, so the record is still changed
    (repo / "flexmesh/c.py").write_text("C = 2\n")
    _commit_all(repo, "c back")
    sha2 = _git(repo, "rev-parse", "--short", "HEAD")
    section2 = Section("foo", "foo", sha2, "2026-11-28", "x86_64", "python 3", "1.0x", "none stated", "| a |")
    (repo / "flexmesh/b.py").write_text("B = 1\n")
    (repo / "flexmesh/c.py").write_text("C = 3\n")
    _commit_all(repo, "b drops c")
    assert status.code_since(section2, repo).changed == ("flexmesh/b.py",)


def test_status_says_when_it_cannot_tell(tmp_path):
    repo = tmp_path
    _git(repo, "init", "-q")
    (repo / "bench").mkdir()
    (repo / "bench" / "foo.py").write_text('DEPENDS_ON = ("pkg",)\n')
    (repo / "bench" / "bar.py").write_text("X = 1\n")
    sha = _commit_all(repo, "first")

    def code(**kw):
        return status.code_since(Section(**{"name": "foo", "script": "foo", "commit": sha, "date": "d", "machine": "m",
                                            "versions": "v", "headline": "h", "targets": "t", "body": "b", **kw}),
                                 repo).code

    assert code() == "declared path gone: pkg"
    (repo / "pkg").mkdir()
    (repo / "pkg" / "a.py").write_text("")
    _commit_all(repo, "pkg")
    assert code() == "changed (1 file)"
    assert code(commit="1234567") == "commit 1234567 not in history"
    assert code(script="bar") == "bench/bar.py declares no DEPENDS_ON"
    assert code(script="gone") == "bench/gone.py is gone"


def test_record_writes_the_section_and_a_gpu_run_its_campaign_file(tmp_path, monkeypatch):
    monkeypatch.setattr(_results, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(_results, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(_results, "gpu_hardware", lambda: ("NVIDIA H200 x1", ["- GPU: NVIDIA H200 x1, 139.8 GiB"]))
    today = datetime.date.today().isoformat()

    _results.record("sim", "| a | b |\n|---|---|\n| 1 | PASS |", headline="1.5x | fast")
    _results.record("kernel", "| x |\n|---|\n| FAIL |", headline="2 ms", gpu=True)
    _results.record("sim", "| a | b |\n|---|---|\n| 2 | PASS |\n| 3 | FAIL |", headline="1.6x")  # replaces its section
    text = (tmp_path / "RESULTS.md").read_text()
    sim, kernel = parse_sections(text)
    assert (sim.name, sim.script, sim.headline, sim.targets, sim.date) == ("sim", "sim", "1.6x", "1 of 2 met", today)
    assert sim.commit.removesuffix("-dirty") == _git(ROOT, "rev-parse", "--short", "HEAD")
    assert sim.versions.startswith("python ") and "CPU cores" in sim.machine
    assert (kernel.machine, kernel.campaign, kernel.targets) == ("NVIDIA H200 x1", f"records/{today}-h200.md",
                                                                "0 of 1 met")
    assert text == results_text([sim, kernel])  # the summary block is rewritten with every section
    assert "| sim | " in text.split("<!-- bench:")[0]

    campaign = (tmp_path / kernel.campaign).read_text()
    assert campaign.startswith(f"# NVIDIA H200, {today}") and "- GPU: NVIDIA H200 x1" in campaign
    assert parse_sections(campaign) == [kernel]
    _results.record("kernel2", "| y |", headline="3 ms", script="kernel", gpu=True)  # the same campaign, one file
    assert [s.name for s in parse_sections((tmp_path / kernel.campaign).read_text())] == ["kernel", "kernel2"]


def test_writer_doctests():  # bench/ lies outside pytest's doctest paths
    result = doctest.testmod(_results)
    assert result.failed == 0 and result.attempted >= 4


@pytest.mark.slow
def test_status_command_prints_a_row_per_section():
    out = subprocess.run([sys.executable, "-m", "bench.status"], cwd=ROOT, capture_output=True, text=True, check=True)
    names = [s.name for s in parse_sections((BENCH / "RESULTS.md").read_text())]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in out.stdout.splitlines()[2:]]
    assert rows == names


def test_the_readme_timing_line_is_the_scripts_between_its_markers(tmp_path):
    from bench import readme_timing

    assert readme_timing.BEGIN in readme_timing.README.read_text()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{readme_timing.BEGIN}\nold line\n{readme_timing.END}\n\nmore\n")
    readme_timing.write("new line", readme)
    assert readme.read_text() == f"# x\n\n{readme_timing.BEGIN}\nnew line\n{readme_timing.END}\n\nmore\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="has no <!-- timing -->"):
        readme_timing.write("new line", readme)
