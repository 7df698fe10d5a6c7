"""benchmarks/reliability.py in short: the real `mirror-mlx serve` (a child process) under a
few seconds of concurrent load, 75 Hypothesis-drawn malformed bodies, clients that
leave, and slow and broken clients. Every reply equals the lone request's, no 5xx, no lost
request, no leaked thread or descriptor (the benchmark's verdict)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_server_holds_under_load_and_abuse(tmp_path, default_gguf):
    out = tmp_path / "reliability"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "reliability.py"), str(out), "--modes", "ar",
         "--model", str(default_gguf), "--clients", "4", "--minutes", "0.05", "--max-tokens",
         "8", "--malformed", "75", "--disconnects", "1", "--read-timeout", "2"],
        capture_output=True, text=True, timeout=600)
    report = (out / "reliability.md").read_text() if (out / "reliability.md").exists() else ""
    assert run.returncode == 0, report + run.stderr[-3000:]
    [mode] = json.loads((out / "reliability.json").read_text())["modes"]
    load = mode["phases"]["load"]
    assert load["served"] > 0 and load["equal"] == load["served"], report
    assert mode["phases"]["malformed"]["cases"] >= 75, report
    assert mode["phases"]["disconnects"]["cancelled"] == 4, report
    assert mode["exit_status"] == 0
