"""Which benchmark records hold at HEAD: one row per section of bench/RESULTS.md, with the commit it was
measured at, the date, the machine, its headline figure, its targets, and whether the code it depends on
changed since that commit.

    python -m bench.status            # the table (rich on a terminal, markdown otherwise)
    python -m bench.status --files    # and, under it, the files changed since each changed record
    python -m bench.status --write    # rewrite RESULTS.md's summary block from its sections

Each bench declares the code its figures depend on in one place, a module-level tuple of paths from the
repository root (packages, modules or data under flexmesh/, other benches it imports), its own file
counted without being named::

    DEPENDS_ON = ("flexmesh/search", "flexmesh/cost", "flexmesh/layout", "flexmesh/spec")

"Code since" is ``git diff --name-only COMMIT HEAD -- <own file> <declared paths>``, less the Python files whose
change is to comments and docstrings only (their syntax trees, docstrings dropped, are equal at both commits;
a rename or a deleted file always counts), and less the modules of ``flexmesh/`` that no process of the bench can
import at HEAD (:func:`reachable`: a module added for another bench, or changed where only other benches reach
it). That is sound: a module the bench's processes imported at COMMIT through modules that did not change is
imported through them still, and the first changed module on such a path is reachable and counts. "unchanged"
means the record's figures came from the code HEAD holds (the machine aside); "changed" means re-run it to know.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench._results import RESULTS, Section, markdown_table, parse_sections, results_text, short_machine

ROOT = RESULTS.parent.parent
DECLARATION = "DEPENDS_ON"


def declared(module: Path) -> tuple[str, ...] | None:
    """A bench module's ``DEPENDS_ON``, read from its source (nothing is imported, so this takes
    milliseconds), or None where it declares none."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == DECLARATION for t in targets) and node.value is not None:
            value = ast.literal_eval(node.value)
            if not (isinstance(value, tuple) and all(isinstance(p, str) for p in value)):
                raise ValueError(f"{module}: {DECLARATION} must be a tuple of paths (strings)")
            return value
    return None


@dataclass(frozen=True)
class Status:
    """A section and what git says of its code since the commit it was measured at."""

    section: Section
    code: str  # "unchanged", "changed (N files)", or why it cannot be told
    changed: tuple[str, ...] = ()


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def code_since(section: Section, root: Path = ROOT) -> Status:
    """Whether the code ``section``'s bench declares changed between its commit and HEAD."""
    module = root / "bench" / f"{section.script}.py"
    if not module.exists():
        return Status(section, f"bench/{section.script}.py is gone")
    paths = declared(module)
    if paths is None:
        return Status(section, f"bench/{section.script}.py declares no {DECLARATION}")
    gone = [p for p in paths if not (root / p).exists()]
    if gone:
        return Status(section, f"declared path gone: {', '.join(gone)}")
    sha = section.base_commit
    if _git(root, "merge-base", "--is-ancestor", sha, "HEAD").returncode != 0:
        return Status(section, f"commit {sha} not in history")
    diff = _git(root, "diff", "--name-only", sha, "HEAD", "--", module.relative_to(root).as_posix(), *paths)
    if diff.returncode != 0:
        return Status(section, f"git diff failed: {diff.stderr.strip()}")
    listed = tuple(diff.stdout.split())
    words_only = _text_only(root, sha, listed)
    reach = reachable(root, module.relative_to(root).as_posix())
    unreached = set() if reach is None else {p for p in listed if p.startswith(f"{PACKAGE}/") and p.endswith(".py")
                                             and (root / p).exists() and p not in reach}
    changed = tuple(p for p in listed if p not in words_only and p not in unreached)
    return Status(section, f"changed ({len(changed)} file{'s' * (len(changed) != 1)})" if changed else "unchanged",
                  changed)


PACKAGE = "flexmesh"


def _module_files(root: Path) -> dict[str, str]:
    """Every module of the package and of bench/ at ``root``: dotted name -> file path from the root."""
    out = {}
    for top in (PACKAGE, "bench"):
        for f in sorted((root / top).rglob("*.py")):
            rel = f.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = f.relative_to(root).as_posix()
    return out


def _imports(tree: ast.AST, name: str, is_package: bool) -> tuple[set[str], set[str] | None, bool]:
    """What a module's source imports: the dotted names (``from a import b``: ``a`` and ``a.b``), the prefixes of
    ``importlib.import_module(f"prefix.{...}")`` calls (None when one's name has no constant prefix), and whether
    it starts a Python process (``sys.executable``)."""
    names: set[str] = set()
    prefixes: set[str] | None = set()
    launches = False
    here = name.split(".") if is_package else name.split(".")[:-1]
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = ".".join(here[:len(here) - n.level + 1] + ([n.module] if n.module else [])) if n.level else n.module
            if base:
                names |= {base, *(f"{base}.{a.name}" for a in n.names)}
        elif isinstance(n, ast.Attribute) and n.attr == "executable" and isinstance(n.value, ast.Name) \
                and n.value.id == "sys":
            launches = True
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "import_module":
            arg = n.args[0] if n.args else None
            head = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
            if prefixes is not None and isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value:
                prefixes.add(head.value)
            else:
                prefixes = None
    return names, prefixes, launches


# (file, its mtime and size) -> _imports and whether it has a __main__ guard
_READ: dict[tuple[Path, int, int], tuple[set[str], set[str] | None, bool, bool] | None] = {}


def _read(path: Path, name: str) -> tuple[set[str], set[str] | None, bool, bool] | None:
    """:func:`_imports` of one file and whether it has a ``__main__`` guard, read once per file over every section
    (None: it does not parse)."""
    st = path.stat()
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _READ:
        try:
            text = path.read_text()
            _READ[key] = (*_imports(ast.parse(text), name, path.name == "__init__.py"),
                          '__name__ == "__main__"' in text)
        except (SyntaxError, UnicodeDecodeError):
            _READ[key] = None
    return _READ[key]


def reachable(root: Path, bench: str) -> set[str] | None:
    """The files of ``flexmesh/`` and ``bench/`` that the processes of the bench in file ``bench`` can import at
    ``root``'s checkout: its imports and theirs (read from the sources: every import statement, function-local and
    type-checking ones included, and each module's parent packages); where one of them starts a Python
    (``sys.executable``), also everything a ``python -m`` of the package can start from (its ``__main__`` and every
    module with a ``__main__`` guard); ``importlib.import_module`` with a constant prefix reaches every module under
    it. None (nothing can be left out) where a module imports by a name without a constant prefix or does not
    parse."""
    files = _module_files(root)
    start = {f: m for m, f in files.items()}.get(bench)
    if start is None:
        return None
    seen: set[str] = set()
    todo = [start]
    launched = False
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in files:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        read = _read(root / files[mod], mod)
        if read is None:
            return None
        names, prefixes, launches, _ = read
        if prefixes is None:
            return None
        todo += [m for m in names if m in files]
        todo += [m for m in files if any(m.startswith(p) for p in prefixes)]
        if launches and not launched:
            launched = True
            for m, f in files.items():
                entry = _read(root / f, m)
                if m.startswith(PACKAGE) and (f.endswith("/__main__.py") or (entry is not None and entry[3])):
                    todo.append(m)
    return {files[m] for m in seen}


def _code_tree(source: str) -> str | None:
    """A module's syntax tree without its docstrings (comments are not in it), or None where it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


_TREES: dict[str, str | None] = {}  # blob id -> its code tree (_code_tree)


def _text_only(root: Path, sha: str, paths: tuple[str, ...]) -> set[str]:
    """Those of ``paths`` that changed between ``sha`` and HEAD in their comments and docstrings only: Python files
    at both commits whose code trees are equal (both versions read by one ``git cat-file --batch``)."""
    py = [p for p in paths if p.endswith(".py")]
    if not py:
        return set()
    asked = "".join(f"{rev}:{p}\n" for p in py for rev in (sha, "HEAD"))
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=root, input=asked.encode(), capture_output=True).stdout
    blobs: list[str | None] = []  # each blob's code tree, parsed once per blob (_TREES) over every section
    at = 0
    for _ in range(2 * len(py)):  # "<oid> blob <size>\n<content>\n", or "<name> missing\n"
        end = out.index(b"\n", at)
        head = out[at:end].split()
        if len(head) == 3 and head[1] == b"blob":
            size, oid = int(head[2]), head[0].decode()
            if oid not in _TREES:
                _TREES[oid] = _code_tree(out[end + 1:end + 1 + size].decode("utf-8", "replace"))
            blobs.append(_TREES[oid])
            at = end + 2 + size
        else:  # added, deleted or renamed: it counts
            blobs.append(None)
            at = end + 1
    same = set()
    for i, p in enumerate(py):
        old, new = blobs[2 * i], blobs[2 * i + 1]
        if old is not None and old == new:
            same.add(p)
    return same


def statuses(root: Path = ROOT) -> list[Status]:
    results = root / "bench" / "RESULTS.md"
    return [code_since(s, root) for s in parse_sections(results.read_text())] if results.exists() else []


COLUMNS = ["section", "commit", "date", "machine", "headline", "targets", "code since"]


def _row(st: Status) -> list[str]:
    s = st.section
    return [s.name, s.commit, s.date, short_machine(s.machine), s.headline, s.targets, st.code]


def _colour(targets: str) -> str:
    """Green where every stated target was met, red where one was missed, none where none was stated."""
    met, _, rest = targets.partition(" of ")
    return "" if not rest else "green" if met == rest.removesuffix(" met") else "red"


def print_table(rows: list[Status], files: bool) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        head = _git(ROOT, "rev-parse", "--short", "HEAD").stdout.strip()
        table = Table(*COLUMNS, title=f"bench records against HEAD ({head})")
        for st in rows:
            cells = [escape(c) for c in _row(st)]  # a headline may hold "[...]", which rich reads as markup
            colour = _colour(cells[5])
            cells[5] = f"[{colour}]{cells[5]}[/]" if colour else cells[5]
            cells[6] = f"[{'green' if st.code == 'unchanged' else 'yellow' if st.changed else 'red'}]{cells[6]}[/]"
            table.add_row(*cells)
        Console().print(table)
    else:
        print("\n".join(markdown_table(COLUMNS, [_row(st) for st in rows])))
    if files:
        for st in rows:
            if st.changed:
                print(f"\n{st.section.name} ({st.section.commit}..HEAD):", *st.changed, sep="\n  ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", action="store_true", help="list the changed files of each changed record")
    ap.add_argument("--write", action="store_true", help="rewrite RESULTS.md's summary block from its sections")
    args = ap.parse_args(argv)
    try:
        if args.write:
            RESULTS.write_text(results_text(parse_sections(RESULTS.read_text())))
        rows = statuses()
    except ValueError as e:  # a section not in the writer's form, or a DEPENDS_ON that is not a tuple of paths
        print(f"bench.status: {e}; records are written by bench/_results.record, not by hand", file=sys.stderr)
        return 2
    print_table(rows, args.files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
