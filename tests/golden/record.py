"""Record tests/golden/*.json with the code of this commit: ``python tests/golden/record.py [NAME ...]``.

Run once, before a change that must keep these numbers (tests/test_goldens.py says which); each file
names the commit it was recorded at.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import test_goldens  # noqa: E402  (tests/ on the path, as pytest puts it)
import test_serve_goldens  # noqa: E402

COMPUTE = {**test_goldens.COMPUTE, "serving": test_serve_goldens.compute_serving}


def main(names: list[str]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=HERE).stdout.strip()
    for name in names or list(COMPUTE):
        values = COMPUTE[name]()
        doc = {"commit": commit + ("-dirty" if dirty else ""), "values": values}
        (HERE / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {name}.json", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
