"""`mirror-mlx doctor --selftest`, as a user runs it: where Core ML cannot run, the Core ML
checks go through the package's reference executor and say so, and what needs a Mac is
reported as skipped with the reason."""

import subprocess
import sys

from mirror_mlx.platform import coreml_can_run, coreml_status

import pytest


@pytest.mark.skipif(coreml_can_run(), reason="on a Mac every check runs: see the report there")
def test_selftest_report_off_macos():
    done = subprocess.run([sys.executable, "-m", "mirror_mlx", "doctor", "--selftest"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout
    lines = report.splitlines()
    assert lines[0].startswith("mirror-mlx ") and lines[0].endswith(" selftest")
    assert any(line.startswith("coreml: unavailable: ") for line in lines)
    status = {line.split("] ")[1].split(" (")[0].split(":")[0]: line.split("]")[0][1:]
              for line in lines if line.startswith("[")}
    assert status == {
        "target-only greedy": "ok",
        "Mirror-SD greedy identity, MLX draft": "ok",
        "Core ML export of the default draft": "ok",
        "Core ML draft predictions vs MLX draft": "ok",
        "Mirror-SD greedy identity, Core ML draft": "ok",
        "Core ML op placement": "skipped",
        "energy meter": status["energy meter"],
    }, report
    assert status["energy meter"] in ("ok", "skipped")
    assert report.count("through the reference executor, not Core ML") == 2
    assert f"[skipped] Core ML op placement: {coreml_status()[1]}" in report
    assert "identical on 2 prompts" in report and " 0 failed" in report
