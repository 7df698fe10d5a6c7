"""Energy meters: the backend picked per platform, RAPL on a sysfs-shaped folder tree, the
powermetrics parser, and the macOS meters on macOS (skipped elsewhere)."""

import glob
import os
import plistlib
import time
from pathlib import Path

from mirror_mlx.energy.ioreport import rail_of
from mirror_mlx.energy.meter import MeterUnavailable, measure
from mirror_mlx.energy.powermetrics import sample_joules, split_samples
from mirror_mlx.energy.rapl import RaplMeter
from mirror_mlx.energy.select import open_meter
from mirror_mlx.errors import InvalidParameter
from mirror_mlx.platform import is_macos

import pytest

NOT_MACOS = "IOReport and powermetrics exist only on macOS"


def _zone(root: Path, name: str, label: str, energy: int, wrap: int = 262143328850) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "name").write_text(label + "\n")
    (folder / "energy_uj").write_text(f"{energy}\n")
    (folder / "max_energy_range_uj").write_text(f"{wrap}\n")
    return folder


@pytest.fixture
def powercap(tmp_path):
    """Two packages (one with core and dram subzones), a psys zone, an mmio duplicate."""
    root = tmp_path / "powercap"
    _zone(root, "intel-rapl:0", "package-0", 1_000_000, wrap=10_000_000)
    _zone(root, "intel-rapl:0:0", "core", 500_000)
    _zone(root, "intel-rapl:0:1", "dram", 200_000)
    _zone(root, "intel-rapl:1", "package-1", 3_000_000)
    _zone(root, "intel-rapl:2", "psys", 9_000_000)
    _zone(root, "intel-rapl-mmio:0", "package-0", 7_000_000)
    return root


def _set(root: Path, zone: str, energy: int) -> None:
    (root / zone / "energy_uj").write_text(f"{energy}\n")


def test_rapl_sums_packages_and_dram_only(powercap):
    meter = RaplMeter(powercap)
    assert meter.read() == {"cpu": 0.0, "dram": 0.0}

    def work():
        _set(powercap, "intel-rapl:0", 3_500_000)  # +2.5 J
        _set(powercap, "intel-rapl:1", 4_000_000)  # +1.0 J
        _set(powercap, "intel-rapl:0:0", 900_000)  # core: inside the package, not added
        _set(powercap, "intel-rapl:0:1", 450_000)  # dram +0.25 J
        _set(powercap, "intel-rapl:2", 99_000_000)  # psys: overlaps the packages, not added
        _set(powercap, "intel-rapl-mmio:0", 99_000_000)
        time.sleep(0.05)
        return "done"

    reading, out = measure(meter, work)
    assert out == "done"
    assert reading.joules == pytest.approx({"cpu": 3.5, "dram": 0.25})
    assert reading.total_j == pytest.approx(3.75)
    assert reading.seconds >= 0.05
    assert reading.watts == pytest.approx(3.75 / reading.seconds)


def test_rapl_counter_wraparound(powercap):
    meter = RaplMeter(powercap)
    _set(powercap, "intel-rapl:0", 9_000_000)  # +8 J
    assert meter.read()["cpu"] == pytest.approx(8.0)
    _set(powercap, "intel-rapl:0", 500_000)  # wrapped at 10 J: +1.5 J
    assert meter.read()["cpu"] == pytest.approx(9.5)


def test_rapl_unreadable_counter_is_unavailable(powercap):
    # energy_uj is root-only on Linux >= 5.10; a folder in its place cannot be read either
    # (the tests may run as root, for whom file modes do not stop reading).
    counter = powercap / "intel-rapl:1" / "energy_uj"
    counter.unlink()
    counter.mkdir()
    choice = open_meter("auto", rapl_root=powercap) if not is_macos() else \
        open_meter("rapl", rapl_root=powercap)
    assert not choice.available and choice.backend == "none"
    assert "cannot read" in choice.note and "intel-rapl:1" in choice.note


@pytest.mark.skipif(is_macos(), reason="on macOS 'auto' picks IOReport or powermetrics")
def test_auto_picks_rapl_off_macos(powercap, tmp_path):
    choice = open_meter("auto", rapl_root=powercap)
    choice.close()
    assert choice.available and choice.backend == "rapl" and choice.meter.backend == "rapl"
    empty = open_meter("auto", rapl_root=tmp_path / "nothing")
    assert not empty.available and empty.backend == "none"
    assert empty.note.startswith("unavailable: rapl: no RAPL zones")


@pytest.mark.skipif(is_macos(), reason="checks the answer on a machine that is not a Mac")
def test_auto_on_this_machine_is_honest():
    counters = glob.glob("/sys/class/powercap/intel-rapl:*/energy_uj")
    readable = bool(counters) and all(os.access(c, os.R_OK) for c in counters)
    choice = open_meter("auto")
    choice.close()
    if readable:
        assert choice.backend == "rapl"
    else:
        assert choice.backend == "none" and not choice.available
        assert choice.note.startswith("unavailable: rapl: ")


@pytest.mark.skipif(is_macos(), reason="checks the refusal on a machine that is not a Mac")
def test_macos_backends_refuse_elsewhere():
    for backend, name in (("ioreport", "IOReport"), ("powermetrics", "powermetrics")):
        choice = open_meter(backend)
        assert not choice.available
        assert choice.note == f"unavailable: {backend}: {name} exists only on macOS"


def test_none_and_bad_choice():
    assert open_meter("none").note == "energy not measured (--energy none)"
    with pytest.raises(InvalidParameter, match="--energy must be one of"):
        open_meter("joulemeter")


def test_ioreport_channel_matching_is_anchored():
    expected = {"CPU Energy": "cpu", "DIE_0_CPU Energy": "cpu", "DIE_1_CPU Energy": "cpu",
                "GPU Energy": "gpu", "ANE": "ane", "ANE0": "ane", "ANE0_1": "ane",
                "DRAM": "dram", "DRAM0": "dram", "DRAM0_1": "dram"}
    for name, rail in expected.items():
        assert rail_of(name) == rail, name
    # Per-core, per-cluster and duplicate channels must not be added to any rail.
    for name in ("ECPU0", "PCPU1", "EACC_CPU Energy", "PACC_0", "MCPU0", "ECPM", "GPU0",
                 "GPU0_0", "GPU SRAM", "ANE_SRAM", "DRAM_DTL", "CPU Energy 2"):
        assert rail_of(name) is None, name


def test_powermetrics_stream_parsing():
    a = {"elapsed_ns": 500_000_000,
         "processor": {"cpu_energy": 1500, "gpu_energy": 250, "ane_energy": 0}}
    # A newer layout: the GPU under "gpu", and only powers (mW) for the ANE.
    b = {"elapsed_ns": 250_000_000, "processor": {"cpu_energy": 800, "ane_power": 400.0},
         "gpu": {"gpu_energy": 100}}
    stream = plistlib.dumps(a) + b"\x00" + plistlib.dumps(b) + b"\x00" + plistlib.dumps(a)[:40]
    samples, rest = split_samples(stream)
    assert samples == [a, b] and rest == plistlib.dumps(a)[:40]
    assert sample_joules(a) == pytest.approx({"cpu": 1.5, "gpu": 0.25, "ane": 0.0})
    assert sample_joules(b) == pytest.approx({"cpu": 0.8, "gpu": 0.1, "ane": 0.1})


@pytest.mark.macos
@pytest.mark.skipif(not is_macos(), reason=NOT_MACOS)
def test_ioreport_measures_cpu_work_on_macos():
    from mirror_mlx.energy.ioreport import IOReportMeter

    meter = IOReportMeter()
    try:
        def spin():
            end = time.perf_counter() + 3.0  # longer than the ~2 s publishing cadence
            while time.perf_counter() < end:
                sum(i * i for i in range(10_000))

        reading, _ = measure(meter, spin)
    finally:
        meter.close()
    assert reading.joules.get("cpu", 0.0) > 0.0
    assert all(v >= 0.0 for v in reading.joules.values())
    assert 0.0 < reading.watts < 500.0
    choice = open_meter("auto")
    choice.close()
    assert choice.backend == "ioreport"


SAMPLE = {"elapsed_ns": 500_000_000, "processor": {"cpu_energy": 1500, "ane_energy": 20}}


@pytest.fixture
def sudo_rule(tmp_path, monkeypatch):
    """The usual sudoers rule, on any OS: `sudo -n` runs powermetrics and refuses anything
    else. powermetrics itself exists only on macOS; elsewhere an executable of that name
    prints samples as it does (plists, NUL-separated, every 50 ms)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sudo = bin_dir / "sudo"
    sudo.write_text('#!/bin/sh\n[ "$1" = -n ] && [ "$2" = powermetrics ] && shift && exec "$@"\n'
                    'echo "sudo: a password is required" >&2; exit 1\n')
    fake = bin_dir / "powermetrics"
    sample = plistlib.dumps(SAMPLE).decode()
    fake.write_text(f"#!/usr/bin/env python3\nimport sys, time\nwhile True:\n"
                    f"    sys.stdout.write({sample!r} + '\\0'); sys.stdout.flush()\n"
                    f"    time.sleep(0.05)\n")
    for f in (sudo, fake):
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return sudo


@pytest.mark.skipif(is_macos(), reason="a Mac has the real powermetrics (the next test)")
def test_powermetrics_with_a_sudo_rule_for_it_alone(sudo_rule):
    from mirror_mlx.energy.powermetrics import PowermetricsMeter

    meter = PowermetricsMeter()
    try:
        time.sleep(0.3)
        assert meter.read()["cpu"] >= 1.5 and meter.read()["ane"] >= 0.02
    finally:
        meter.close()
    # Where sudo wants a password, the meter says what the real command said.
    sudo_rule.write_text('#!/bin/sh\necho "sudo: a password is required" >&2; exit 1\n')
    with pytest.raises(MeterUnavailable, match="a password is required.*needs sudo without"):
        PowermetricsMeter(first_sample_timeout_s=2.0)


@pytest.mark.macos
@pytest.mark.skipif(not is_macos(), reason=NOT_MACOS)
def test_powermetrics_meter_on_macos():
    from mirror_mlx.energy.powermetrics import PowermetricsMeter

    try:
        meter = PowermetricsMeter()
    except MeterUnavailable as e:
        if "password" not in str(e):
            raise
        pytest.skip(f"powermetrics needs sudo without a password prompt: {e}")
    try:
        reading, _ = measure(meter, lambda: time.sleep(2.0))
    finally:
        meter.close()
    assert reading.joules.get("cpu", 0.0) > 0.0
