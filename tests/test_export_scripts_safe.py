"""What a generated launch script carries cannot become a command: device names hold a defined set of characters
wherever they enter (cluster files, plan files), and every text a script writes is one quoted word or one comment."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from flexmesh.errors import PlanError, SpecError
from flexmesh.serve.export import EXAMPLE_PLAN, Launch, launch_script, launches
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.spec.cluster import parse_mixed_cluster

HOSTILE = ["H100\ntouch /tmp/pwned", "H100; rm -rf ~", "$(id)", "`id`", "a b", "x" * 65, "-H100", "H100\r",
           "H\u2028100", ""]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_device_name_in_a_cluster_file_is_one_line(tmp_path, name):
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device": {"base": "H100", "name": name}}))
    with pytest.raises(SpecError, match="is not a device name") as err:
        parse_mixed_cluster(str(f))
    assert "\n" not in str(err.value).replace("\\n", "")


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_device_name_in_a_plan_file_is_refused(name):
    d = json.loads(EXAMPLE_PLAN)
    d["groups"][0]["device"] = name
    with pytest.raises(PlanError, match="is not a device name"):
        ServingPlan.from_dict(d)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_field_a_script_writes_stays_one_word_or_one_comment(tmp_path):
    plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
    odd = "/models/m y $(touch pwned);`id`'\"\\"
    for engine in ("vllm", "sglang"):
        cmds = launches(engine, plan, odd, host="127.0.0.1")
        cmds = [Launch(c.replica, c.node, c.device, c.role, c.port, c.argv, c.env, c.max_running,
                       "note\nrm -rf ~ $(id)") for c in cmds]
        script = launch_script(engine, cmds, "checked\ntouch pwned")
        path = tmp_path / f"{engine}.sh"
        path.write_text(script)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
        lines = script.splitlines()
        # a shebang, comments, one command line per replica (ending in &), and wait: nothing else
        commands = [x for x in lines[1:] if not x.startswith("#")]
        assert commands[-1] == "wait" and len(commands) == len(cmds) + 1
        assert all(x.endswith(" &") for x in commands[:-1])
        # the model path reaches the engine as one argument, exactly as given
        for x, c in zip(commands[:-1], cmds):
            words = subprocess.run(["bash", "-c", f"printf '%s\\0' {x[x.index(' ', x.index('=') ) + 1:-2]}"],
                                   capture_output=True, cwd=tmp_path).stdout.split(b"\0")[:-1]
            assert [w.decode() for w in words] == list(c.argv)
        assert not (tmp_path / "pwned").exists()
    for bad in ("/models/m\nid", "", "/m\x00"):
        with pytest.raises(SpecError, match="control character"):
            launches("vllm", plan, bad)
