"""benchmarks/soak.py in short: one engine per mode, a chat overflowing its context, callers on
fresh threads, cancellations from another thread; memory and threads must hold flat after the
warm-up (a per-generation leak of a thread, or of a KV cache, ~12 MB here, fails it)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_soak_holds_memory_and_threads(tmp_path, default_gguf):
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), str(out), "--model",
         str(default_gguf), "--generations", "20", "--modes", "ar", "--every", "2",
         "--max-tokens", "8", "--warmup", "0.2"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    for mode, verdict in report["verdicts"].items():
        assert verdict["ok"], (mode, verdict)
        finishes = report["finishes"][mode]
        assert finishes.get("cancelled") and (finishes.get("context") or finishes.get(
            "too long: turns dropped")), (mode, finishes)
    assert (out / "soak.png").stat().st_size > 0
