import os
import sys
from pathlib import Path

# One intra-op thread per process: multi-process tests put up to four ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Test files import what they share from tests/helpers.py as `helpers`, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))
