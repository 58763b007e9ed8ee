"""Hostile places to write: what flexmesh writes is a regular file or a real folder at the place the
user named, never reached through a symlink and never replacing what is not flexmesh's own; the run
folder's lock cannot be bypassed by an environment variable nor outlived by orphaned ranks;
``--overwrite`` moves only a run folder; user text prints verbatim.

The run the multi-process test kills is the real command (launcher, torchrun, two ranks of a 2-layer
model on CPU) as in tests/test_failures.py, with its marker to find every process of a run; the runs
it starts beside and after that one are the command's ranks from the fork server, or the launcher in this process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import flexmesh_here, flexmesh_ranks, unlocked, write_inputs

from flexmesh.cli import main
from flexmesh.errors import OutputError, RunFolderError
from flexmesh.files import append_file, check_file_target, make_folder, write_atomic

VICTIM = "precious\n"


def _hostile(tmp: Path, kind: str) -> tuple[Path, Path | None]:
    """Something at ``tmp/<kind>`` that is not a regular file, and the file it must leave alone (None: none)."""
    path = tmp / kind
    if kind == "device":
        return Path("/dev/null"), None
    victim = tmp / f"{kind}-victim"
    if kind == "symlink":
        victim.write_text(VICTIM)
        path.symlink_to(victim)
    elif kind == "dangling-symlink":
        path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "folder":
        path.mkdir()
    return path, victim


KINDS = ["device", "symlink", "dangling-symlink", "fifo", "socket", "folder"]


def _unchanged(path: Path, victim: Path | None, before: int) -> None:
    assert stat.S_IFMT(os.lstat(path).st_mode) == before, f"{path} was replaced"
    if victim is not None and victim.exists():
        assert victim.read_text() == VICTIM
    elif victim is not None:
        assert not victim.exists(), "a dangling symlink was written through"


@pytest.mark.parametrize("kind", KINDS)
def test_the_atomic_writer_refuses_anything_but_a_regular_file(tmp_path, kind):
    path, victim = _hostile(tmp_path, kind)
    before = stat.S_IFMT(os.lstat(path).st_mode)
    word = {"dangling-symlink": "symlink"}.get(kind, kind)
    with pytest.raises(OutputError, match=f"{path} is a {word}, not a file flexmesh writes"):
        write_atomic(path, "x")
    _unchanged(path, victim, before)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    regular = tmp_path / "plain.json"
    regular.write_text("old")
    write_atomic(regular, "new")  # a regular file is still replaced
    assert regular.read_text() == "new"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "folder"])
def test_appending_and_locking_never_follow_a_symlink_or_open_a_fifo(tmp_path, kind):
    from flexmesh.data.cache import file_lock

    path, victim = _hostile(tmp_path, kind)
    before = stat.S_IFMT(os.lstat(path).st_mode)
    with pytest.raises(OutputError):
        append_file(path)  # metrics.jsonl
    with pytest.raises(OutputError):
        with file_lock(path):  # the token and tokenizer caches' lock
            pass
    _unchanged(path, victim, before)


@pytest.mark.parametrize("command", [["plan"], ["plan", "--check", "PLAN"], ["profile", "hardware", "--quick"]])
@pytest.mark.parametrize("kind", ["device", "symlink", "fifo", "socket"])
def test_out_onto_a_device_fifo_socket_or_symlink_is_a_one_line_error(tmp_path, capsys, command, kind):
    path, victim = _hostile(tmp_path, kind)
    before = stat.S_IFMT(os.lstat(path).st_mode)
    if "PLAN" in command:
        _, _, plan = write_inputs(tmp_path, world=2)
        command = [str(plan) if a == "PLAN" else a for a in command]
    t0 = time.monotonic()
    assert main([*command, "--out", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"error: {path} is a ") and "not a file flexmesh writes" in err, err
    assert time.monotonic() - t0 < 20  # refused before searching or profiling
    _unchanged(path, victim, before)


def test_the_lock_file_is_never_followed_nor_truncated(tmp_path):
    from flexmesh.runtime.state.rundir import LOCK, hold_run_folder

    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    (out / LOCK).symlink_to(victim)
    with pytest.raises(OutputError, match="is a symlink"):
        hold_run_folder(out)
    assert victim.read_text() == VICTIM and (out / LOCK).is_symlink()
    (out / LOCK).unlink()
    os.mkfifo(out / LOCK)  # opening a fifo would block: refused at once instead
    with pytest.raises(OutputError, match="is a fifo"):
        hold_run_folder(out)


def test_folders_flexmesh_writes_in_are_real_folders(tmp_path):
    from flexmesh.report.report import Report
    from flexmesh.runtime.state.export import export_checkpoint
    from flexmesh.runtime.state.rundir import hold_run_folder
    from flexmesh.sim.plots import save_figure
    from flexmesh.spec.model import parse_model

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    for write in (lambda: hold_run_folder(link), lambda: Report("r", link), lambda: make_folder(link),
                  lambda: export_checkpoint(tmp_path / "no-checkpoint", link, parse_model("tiny"))):
        with pytest.raises(OutputError, match=f"{link} is a symlink; flexmesh writes only into a real folder"):
            write()
    assert list(elsewhere.iterdir()) == []
    (tmp_path / "file").write_text(VICTIM)
    with pytest.raises(OutputError, match="is a file, not a folder"):
        make_folder(tmp_path / "file")

    import matplotlib.pyplot as plt

    fig = plt.figure()
    with pytest.raises(OutputError, match="is a symlink, not a file"):
        save_figure(fig, _hostile(tmp_path, "symlink")[0])
    assert (tmp_path / "symlink-victim").read_text() == VICTIM
    png = save_figure(plt.figure(), tmp_path / "plots" / "x.png")
    assert png.read_bytes()[:4] == b"\x89PNG"

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").symlink_to(tmp_path / "file")  # replaced by an export: refused, not unlinked
    with pytest.raises(OutputError, match="config.json is a symlink"):
        export_checkpoint(tmp_path / "no-checkpoint", folder, parse_model("tiny"))
    assert (folder / "config.json").is_symlink()
    check_file_target(tmp_path / "missing")  # nothing there: fine


def _run_folder(root: Path, *extra: str) -> Path:
    out = root / "run"
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ".flexmesh.lock").write_text("")
    for name in extra:
        (out / name).write_text("")
    return out


def test_starting_over_moves_only_a_run_folder(tmp_path):
    from flexmesh.runtime.state.rundir import start_over

    run = _run_folder(tmp_path / "a", "migration.json", "plan-migrated-000004.json", "plan.json")
    moved = start_over(run, overwrite=True)
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoints", "metrics.jsonl", "migration.json",
                                                       "plan-migrated-000004.json", "plan.json"]
    assert sorted(p.name for p in run.iterdir()) == [".flexmesh.lock", moved.name]

    project = _run_folder(tmp_path / "b")
    (project / ".git").mkdir()
    (project / "train.py").write_text("")
    for overwrite in (True, False):
        with pytest.raises(RunFolderError, match=r"holds '\.git' and 1 more, which no flexmesh run writes"):
            start_over(project, overwrite=overwrite)
    assert sorted(p.name for p in project.iterdir()) == [".flexmesh.lock", ".git", "checkpoints", "metrics.jsonl",
                                                         "train.py"]
    linked = tmp_path / "c"
    linked.mkdir()
    (linked / "metrics.jsonl").write_text("")
    (linked / "checkpoints").symlink_to(tmp_path / "b")  # a run writes a real folder there, not a link
    with pytest.raises(RunFolderError, match="holds 'checkpoints'"):
        start_over(linked, overwrite=True)


def test_one_process_starts_over_its_own_run_folder(tmp_path):
    """--no-resume into a new folder and --overwrite of a run flexmesh wrote train (the tokenizer the
    command records for its attempt is no earlier run); --no-resume over a run is still refused."""
    _, corpus, plan = write_inputs(tmp_path, world=1)
    out = tmp_path / "run"
    common = ["train", "--plan", str(plan), "--corpus", str(corpus), "--out", str(out), "--max-steps", "1",
              "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    first = flexmesh_here(*common, "--no-resume")
    assert first.returncode == 0, first.stderr
    again = flexmesh_here(*common, "--overwrite")
    assert again.returncode == 0, again.stderr
    previous = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert len(previous) == 1 and sorted(p.name for p in previous[0].iterdir()) == ["checkpoints", "corpus.json",
                                                                                    "metrics.jsonl", "tokenizer"]
    assert (out / "metrics.jsonl").is_file() and (out / "tokenizer").is_dir()
    refused = flexmesh_here(*common, "--no-resume")
    assert refused.returncode == 2 and "already holds a run" in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_overwrite_refuses_a_project_folder_before_starting_anything(tmp_path):
    _, corpus, plan = write_inputs(tmp_path, world=2)
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "README.md").write_text(VICTIM)
    for launch in ([], ["--nproc", "2"]):  # in this process: a launcher that went on would start ranks and fail
        done = flexmesh_here("train", "--plan", str(plan), "--corpus", str(corpus), "--out", str(project),
                             "--max-steps", "1", "--overwrite", *launch)
        said = " ".join(done.stderr.split())
        assert done.returncode == 2 and said.startswith(f"error: output folder {project} holds '.git' and 1 more"), said
    assert sorted(p.name for p in project.iterdir()) == [".flexmesh.lock", ".git", "README.md"]


def test_user_text_prints_verbatim(tmp_path, capsys, monkeypatch):
    odd = ":smile: [red]x[/red] :a:"
    assert main(["plan", "--model", odd]) == 2
    err = capsys.readouterr().err
    assert f"error: unknown model '{odd}'" in " ".join(err.split()), err
    assert "😄" not in err and "\x1b" not in err
    monkeypatch.chdir(tmp_path)
    out = f"{odd}.json"
    assert main(["plan", "--model", "tiny", "--cluster", "2xA100-80GB", "--seq-len", "512", "--global-batch", "4",
                 "--out", out]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"wrote the best plan to {out}" in said, said
    assert (tmp_path / out).is_file()


def test_a_hand_set_variable_does_not_pass_for_the_launchers_hold(tmp_path):
    """The ranks believe FLEXMESH_RUN_FOLDER_HELD only with the secret of a hold held right now by one
    of their ancestors."""
    from flexmesh.runtime.state.rundir import HELD_ENV, hold_run_folder, launcher_holds, release_run_folder

    out = tmp_path / "run"
    check = f"from flexmesh.runtime.state.rundir import launcher_holds; print(launcher_holds({str(out)!r}))"

    def child_says(value: str) -> str:
        env = dict(os.environ, **{HELD_ENV: value})
        return subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                              timeout=60).stdout.strip()

    secret = hold_run_folder(out)
    try:
        assert child_says(secret) == "True"  # this process is the child's launcher
        assert child_says(str(out.resolve())) == "False"  # what the variable used to hold
        assert child_says("0" * 32) == "False"
    finally:
        release_run_folder(out)
    assert unlocked(out)
    assert child_says(secret) == "False"  # the hold is over
    # Held by a process that is not an ancestor: its secret, read off its output, proves nothing.
    code = ("import sys, time; from flexmesh.runtime.state.rundir import hold_run_folder\n"
            f"print(hold_run_folder({str(out)!r}), flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        other = holder.stdout.readline().strip()
        os.environ[HELD_ENV] = other
        try:
            assert not launcher_holds(out)
        finally:
            del os.environ[HELD_ENV]
        with pytest.raises(RunFolderError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            hold_run_folder(out)
    finally:
        holder.kill()
        holder.wait()


# ---- the real command ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hostile")
    _, corpus, plan = write_inputs(tmp, world=2)
    return {"tmp": tmp, "corpus": corpus, "plan": plan,
            "common": ["train", "--plan", str(plan), "--corpus", str(corpus), "--cache-dir", str(tmp / "cache"),
                       "--no-progress", "--lr", "1e-3"]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_launcher_killed_outright_takes_every_rank_along_and_the_lock_cannot_be_bypassed(inputs):
    from test_failures import Run, _marked

    from flexmesh.runtime.state.rundir import HELD_ENV

    out = inputs["tmp"] / "killed"
    run = Run(inputs, out, "--checkpoint-every", "1")
    try:
        run.wait_steps(2)
        ranks = run.ranks()
        assert len(ranks) == 2
        for pid in ranks.values():  # paused while the checks below run: training on adds nothing to them
            os.kill(pid, signal.SIGSTOP)
        # While it trains, the variable that tells ranks their launcher holds the folder lets nobody in:
        # neither a launcher nor plain torchrun, whatever it is set to. The launcher takes the lock itself
        # and never reads the variable: one forged value (what it used to hold), the launcher run in this
        # process (it fails before starting a rank). Ranks under plain torchrun check it: the peer marker,
        # and the digest the lock file shows (the full check against the held lock; other forged values
        # take that same path, and the test above covers them in process), in the command's ranks forked
        # here as torchrun would start them.
        for value, launcher in ((str(out.resolve()), True), ("peer", False), (_digest_in(out), False)):
            if launcher:
                os.environ[HELD_ENV] = value
                try:
                    other = flexmesh_here(*inputs["common"], "--nproc", "2", "--out", str(out), "--max-steps", "2")
                finally:
                    del os.environ[HELD_ENV]
            else:
                other = flexmesh_ranks(2, *inputs["common"], "--out", str(out), "--max-steps", "2", timeout=240,
                                       env={HELD_ENV: value})
            said = " ".join(other.stderr.split())
            assert other.returncode != 0 and f"{out} is in use by another run (pid {run.proc.pid})" in said, said
        steps_before = len(run.steps())
        for pid in ranks.values():  # training again when the launcher goes
            os.kill(pid, signal.SIGCONT)
        run.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while _marked(run.mark) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        took, survivors = time.monotonic() - t0, sorted(_marked(run.mark))
    finally:
        run.kill()
    assert survivors == [], f"still running {time.monotonic() - t0:.0f} s after the launcher was killed: {survivors}"
    assert took < 30
    assert unlocked(out)
    assert steps_before >= 2
    # The next run into the folder takes it and resumes from the last checkpoint (its ranks from the fork server:
    # the lock is the folder's, whichever process of the next run takes it).
    done = run.steps()[-1] + 2 if run.steps() else 3
    again = flexmesh_ranks(2, *inputs["common"], "--out", str(out), "--max-steps", str(done), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.endswith("}")]
    assert [r["step"] for r in rows] == list(range(1, done + 1))


def _digest_in(out: Path) -> str:
    """What the lock file of a held folder shows besides the pid (a digest, not the secret)."""
    return (out / ".flexmesh.lock").read_text().split()[1]


@pytest.mark.parametrize("planted", ["out", "metrics", "checkpoints"])
def test_a_run_refuses_a_symlinked_folder_or_metrics_file(inputs, planted):
    """A single-process run (the command in this process: it stops before training): the folder named by
    --out, its metrics.jsonl and checkpoints/ are never reached through a symlink; the file or folder the
    link points to is left alone."""
    (inputs["tmp"] / f"one-{planted}").mkdir()
    _, _, plan = write_inputs(inputs["tmp"] / f"one-{planted}", world=1)
    root = inputs["tmp"] / f"planted-{planted}"
    elsewhere = root / "elsewhere"
    elsewhere.mkdir(parents=True)
    victim = root / "victim.jsonl"
    victim.write_text(VICTIM)
    out = root / "run"
    if planted == "out":
        out.symlink_to(elsewhere)
    else:
        out.mkdir()
        (out / ("metrics.jsonl" if planted == "metrics" else "checkpoints")).symlink_to(
            victim if planted == "metrics" else elsewhere)
    done = flexmesh_here("train", "--plan", str(plan), "--corpus", str(inputs["corpus"]), "--cache-dir",
                         str(inputs["tmp"] / "cache"), "--no-progress", "--out", str(out), "--max-steps", "1")
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and said.startswith("error: ") and "is a symlink" in said, said  # before training
    assert victim.read_text() == VICTIM and list(elsewhere.iterdir()) == []
