"""vLLM engines started on this machine's CPU: each held with all its processes to cores of its own, and the CPU a
sweep counts as the host's (flexmesh.serve.engine.external). No vLLM needed."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from flexmesh.serve.engine.external import ExternalEngine, externals, sharing_pids
from flexmesh.serve.engine.processes import _die_with_parent
from flexmesh.serve.export import Launch

ARGV = ("vllm", "serve", "/m", "--host", "0.0.0.0", "--port", "8100")


def _launches(device: str, n: int) -> list[Launch]:
    return [Launch(k, 0, device, "aggregated", 8100, ARGV, {}, 8) for k in range(n)]


def test_cpu_engines_are_each_held_to_their_own_cores(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    got = externals("vllm", _launches("cpu", 2), "/py", [9000, 9001], [], {"OMP_NUM_THREADS": "2"}, [64, 64])
    assert [e.cores for e in got] == [(0, 1), (2, 3)]
    assert [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in got] == ["0,1", "2,3"]
    assert [e.argv[e.argv.index("--port") + 1] for e in got] == ["9000", "9001"]
    # one engine of one thread on 2 cores: its worker on core 0, its scheduler and API server free to use core 1
    one = externals("vllm", _launches("cpu", 1), "/py", [9000], [], {"OMP_NUM_THREADS": "1"}, [64])
    assert one[0].cores == () and one[0].env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    # two of one thread on 4 cores: each its worker's core and the two no worker is bound to
    two = externals("vllm", _launches("cpu", 2), "/py", [9000, 9001], [], {"OMP_NUM_THREADS": "1"}, [64, 64])
    assert [e.cores for e in two] == [(0, 2, 3), (1, 2, 3)]


def test_gpu_engines_and_a_users_binding_are_left_where_they_are(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    gpu = externals("vllm", _launches("H100", 2), "/py", [9000, 9001], [], {"OMP_NUM_THREADS": "1"}, [64, 64])
    assert [e.cores for e in gpu] == [(), ()]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    own = externals("vllm", _launches("cpu", 2), "/py", [9000, 9001], [], {"OMP_NUM_THREADS": "1"}, [64, 64])
    assert [e.cores for e in own] == [(), ()]
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in e.env for e in own)


def test_only_unpinned_engines_count_as_the_hosts_cpu():
    cfgs = [ExternalEngine("vllm", (), {}, 1, 8, 64, cores=(0,)), ExternalEngine("vllm", (), {}, 2, 8, 64)]
    engines = [SimpleNamespace(proc=SimpleNamespace(pid=101)), SimpleNamespace(proc=SimpleNamespace(pid=102))]
    assert sharing_pids(engines, cfgs) == [102]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_started_engine_and_what_it_starts_run_on_its_cores():
    core = max(os.sched_getaffinity(0))
    child = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)));" \
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                         preexec_fn=functools.partial(_die_with_parent, (core,)))
    assert out.stdout.split() == [f"[{core}]", f"[{core}]"]
