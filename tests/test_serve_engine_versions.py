"""flexmesh's engine on both ends of the transformers range the project admits (``transformers>=5.17`` in the serve
extra): the installed release (the newest pip finds) in this process, and 5.17.0, the oldest, which ``setup.sh``
puts beside it in ``.venvs/transformers-5.17`` (``pip install --target``, with the dependencies it pins), in a
process of its own. On each, the engine is built from the continuous-batching config as that release names its
fields (flexmesh.serve.engine.engine.batching_config), every field it sets is taken as given, and it decodes the
tokens transformers' own ``generate`` gives. A release whose config differs from what the engine was written for fails
here: a field missing or renamed, a value not taken, its scheduler's loop hook gone."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
OLDEST = ROOT / ".venvs" / "transformers-5.17"  # setup.sh installs 5.17.0 there

CHECK = """
import json, sys, inspect
import torch, transformers
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.engine import Engine, batching_config
from flexmesh.serve.engine.model import build_model
from flexmesh.serve.engine.replay import prompt_ids

cfg = EngineConfig(model="tiny", num_blocks=256, page_size=16, max_batch_tokens=64, max_requests_per_batch=8)
fields = inspect.signature(ContinuousBatchingConfig).parameters
kw = batching_config(cfg, fields)
made = ContinuousBatchingConfig(**kw)
taken = {k: getattr(made, k) == v for k, v in kw.items()}
hook = list(inspect.signature(ContinuousBatchingManager._generation_loop_body).parameters)
lengths = [(5, 12), (90, 6), (33, 1), (140, 9)]
prompts = [prompt_ids(i, n, 4096) for i, (n, _) in enumerate(lengths)]
outputs = [o for _, o in lengths]
with Engine(cfg) as engine:
    got = [f.tokens for f in engine.run(prompts, outputs)]
model = build_model(cfg)
with torch.no_grad():
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, outputs)]
print(json.dumps({"version": transformers.__version__, "kw": sorted(kw), "taken": taken, "hook": hook,
                  "equal": got == want}))
"""


def _run(env_path: str | None) -> dict:
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env_path, str(ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(got: dict, version: str) -> None:
    assert got["version"] == version
    assert all(got["taken"].values()), got["taken"]  # every field the engine sets is one the release takes
    assert got["hook"][:3] == ["self", "batch_processor", "bootstrapping"]  # the loop body the engine times
    assert got["equal"]  # greedy tokens equal generate's


@pytest.mark.timeout(900)
def test_the_installed_transformers_runs_the_engine_as_written():
    _check(_run(None), transformers.__version__)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not (OLDEST / "transformers").is_dir(),
                    reason=f"no transformers 5.17 at {OLDEST} (setup.sh installs it)")
def test_the_oldest_admitted_transformers_runs_the_engine_as_written():
    _check(_run(str(OLDEST)), "5.17.0")


def test_a_release_without_a_field_the_engine_sets_is_one_line():
    from flexmesh.errors import ServeError
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.engine import batching_config

    fields = [f for f in inspect.signature(transformers.ContinuousBatchingConfig).parameters if f != "num_blocks"]
    with pytest.raises(ServeError, match="continuous batching has no num_blocks"):
        batching_config(EngineConfig(), fields)
