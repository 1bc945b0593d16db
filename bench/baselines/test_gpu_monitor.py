"""Tests of gpu_monitor.py without a GPU: the nvidia-smi path against a stand-in script that
prints what nvidia-smi prints for the monitor's queries, and the fallback to no samples with a
note where neither NVML nor nvidia-smi is there. The stand-in's figures are test data.

  python3 -m pytest -q bench/baselines/test_gpu_monitor.py
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_monitor  # noqa: E402

STAND_IN = """#!/usr/bin/env bash
if [[ "$*" == *power.limit* ]]; then echo "700.00"; exit 0; fi
while true; do echo "1395, 695.12"; echo "[N/A], [N/A]"; sleep 0.02; done
"""


def test_samples_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(STAND_IN)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml fails: nvidia-smi it is
    monitor = gpu_monitor.GpuMonitor(0)
    try:
        assert monitor.source == "nvidia-smi" and monitor.power_limit_w == 700.0
        time.sleep(0.1)
        monitor.start()
        time.sleep(0.3)
        monitor.stop()
        window = monitor.window()
        assert window["clock_mhz"] == 1395.0 and window["power_w"] == 695.1
        assert window["samples"] >= 2  # the [N/A] lines are skipped
    finally:
        monitor.close()


def test_nothing_to_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monitor = gpu_monitor.GpuMonitor(0)
    monitor.start()
    monitor.stop()
    assert monitor.source is None and monitor.window() is None
    assert "clock and power not sampled" in monitor.note
    monitor.close()
