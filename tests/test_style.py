"""The code base stays ruff-clean (pyproject.toml holds the rules)."""

import subprocess
import sys
from pathlib import Path


def test_ruff_clean():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", str(root)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
