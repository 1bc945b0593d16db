"""The GPU's SM clock and power draw, sampled in the background while a benchmark loop runs.

Under the 700 W power cap an H200's clock settles where the power drawn meets the cap, so a time
means little without the clock it ran at. GpuMonitor samples every ~20 ms from a background thread
for the life of the process (NVML through pynvml, from the `nvidia-ml-py` package, when it
imports; else one `nvidia-smi --query-gpu=clocks.sm,power.draw -lms 20` process); `start()` and
`stop()` mark a window (timing.median_ms marks its timed calls) and `window()` gives the median
clock and power of the samples in it. Where neither source works the figures are None and
`note` says why. NVML's power reading (like nvidia-smi's power.draw) is the driver's average over
its last second on Hopper, so for loops shorter than that it includes the warm-up just before,
which runs the same work.

  python3 gpu_monitor.py [--seconds 2]     prints what it samples from GPU 0 (a check by hand)
"""
import argparse
import statistics
import subprocess
import threading
import time

SAMPLE_SECONDS = 0.02


def device_uuid(device_index):
    """The NVML/nvidia-smi id of torch's CUDA device `device_index` ("GPU-<uuid>"), which stays
    right under CUDA_VISIBLE_DEVICES; None when torch does not say."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class GpuMonitor:
    """Background samples of (time, SM MHz, W) from one GPU; see the module docstring."""

    def __init__(self, device_index=0):
        self.samples = []  # (monotonic seconds, SM clock MHz, power W)
        self.source = None
        self.note = None
        self.power_limit_w = None  # the enforced power cap, where the source reports it
        self._window_start = None
        self._last_window = (0.0, 0.0)
        self._stopping = threading.Event()
        self._process = None
        gpu_id = device_uuid(device_index) or str(device_index)
        reader = self._nvml_reader(gpu_id) or self._smi_reader(gpu_id)
        if reader is None:
            return
        self._thread = threading.Thread(target=reader, daemon=True)
        self._thread.start()

    def _nvml_reader(self, gpu_id):
        try:
            import pynvml

            pynvml.nvmlInit()
            if gpu_id.startswith("GPU-"):
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_id)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu_id))
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            pynvml.nvmlDeviceGetPowerUsage(handle)
        except Exception as error:  # not installed, no driver, no such GPU
            self.note = f"pynvml: {type(error).__name__}: {error}"
            return None
        self.source = "pynvml"
        try:
            self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
        except Exception:
            pass  # the cap stays unknown

        def read():
            while not self._stopping.is_set():
                try:
                    mhz = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
                    watts = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                    self.samples.append((time.monotonic(), float(mhz), watts))
                except Exception:
                    pass  # one failed read: skip the sample
                time.sleep(SAMPLE_SECONDS)

        return read

    def _smi_reader(self, gpu_id):
        command = ["nvidia-smi", "-i", gpu_id, "--query-gpu=clocks.sm,power.draw",
                   "--format=csv,noheader,nounits", "-lms", str(int(SAMPLE_SECONDS * 1000))]
        try:
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)
        except OSError as error:
            self.note = f"{self.note or 'pynvml unavailable'}; nvidia-smi: {error}; clock and power not sampled"
            return None
        self.source = "nvidia-smi"
        try:
            limit = subprocess.run(["nvidia-smi", "-i", gpu_id, "--query-gpu=power.limit",
                                    "--format=csv,noheader,nounits"], capture_output=True,
                                   text=True, timeout=20).stdout.strip()
            self.power_limit_w = float(limit)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass  # the cap stays unknown

        def read():
            for line in self._process.stdout:
                fields = [field.strip() for field in line.split(",")]
                try:
                    self.samples.append((time.monotonic(), float(fields[0]), float(fields[1])))
                except (ValueError, IndexError):
                    continue  # "[N/A]" or a partial line: skip the sample

        return read

    def start(self):
        """Opens a window: samples from now on count, until stop()."""
        self._window_start = time.monotonic()

    def stop(self):
        """Closes the window that start() opened."""
        if self._window_start is not None:
            self._last_window = (self._window_start, time.monotonic())
            self._window_start = None

    def window(self):
        """{"clock_mhz", "power_w", "samples"} of the last closed window (medians); None where
        nothing was sampled in it."""
        begin, end = self._last_window
        if self.source == "nvidia-smi":
            time.sleep(2 * SAMPLE_SECONDS)  # let the last lines of the window arrive
        chosen = [sample for sample in list(self.samples) if begin <= sample[0] <= end]
        if not chosen:
            return None
        return {"clock_mhz": round(statistics.median(s[1] for s in chosen), 1),
                "power_w": round(statistics.median(s[2] for s in chosen), 1),
                "samples": len(chosen)}

    def close(self):
        self._stopping.set()
        if self._process is not None:
            self._process.terminate()
            self._process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="how long to sample")
    parser.add_argument("--device", type=int, default=0, help="torch CUDA device index")
    args = parser.parse_args()
    monitor = GpuMonitor(args.device)
    print(f"source: {monitor.source}; note: {monitor.note}")
    monitor.start()
    time.sleep(args.seconds)
    monitor.stop()
    print(monitor.window())
    monitor.close()


if __name__ == "__main__":
    main()
