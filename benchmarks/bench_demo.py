"""Wall time and CPU utilisation of the README's main job, ``fedpate demo``.

    python benchmarks/bench_demo.py                      # the demo as the README runs it (quick preset)
    python benchmarks/bench_demo.py --preset tiny        # a smoke run of the same path
    python benchmarks/bench_demo.py --engine flower      # the same cells as Flower apps (Ray: 1 core per hospital)

Runs the demo in a fresh process with its own cache and output folder (nothing reused: phantoms, world and
every cell are computed), and prints, from that one run: wall minutes, CPU minutes (the process and its
children, from ``getrusage``), CPU utilisation = CPU time / (wall time x cores), and every line of its
output that mentions a deprecation or a warning. Ratios, not absolute seconds, are what carries between
machines (on a 2-core machine timings swing +-30% from run to run).

On a machine with a CUDA GPU (``nvidia-smi`` answers), the GPU's utilisation is sampled every half second while
the demo runs (``nvidia-smi --query-gpu=utilization.gpu``: the share of the sample period in which a kernel ran):
it prints the share of samples in which the GPU was busy, the mean and median utilisation. Without one it says
that it skipped the sampling. ``--device`` is passed to the demo (default: auto, a GPU when there is one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARNING = re.compile(r"deprecat|warning", re.IGNORECASE)


class GpuSampler:
    """Samples ``nvidia-smi``'s utilisation of GPU 0 on a thread every ``period`` seconds until :meth:`stop`."""

    QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,name", "--format=csv,noheader,nounits", "--id=0"]

    def __init__(self, period: float, name: str) -> None:
        self.period, self.name, self.values = period, name, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def start(cls, period: float = 0.5) -> "GpuSampler | None":
        """A running sampler, or None when there is no CUDA GPU to sample."""
        first = cls._read()
        if first is None:
            return None
        sampler = cls(period, first[1])
        sampler._thread.start()
        return sampler

    @classmethod
    def _read(cls) -> tuple[float, str] | None:
        try:
            line = subprocess.run(cls.QUERY, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
            value, name = (part.strip() for part in line.split(",", 1))
            return float(value), name
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            read = self._read()
            if read is not None:
                self.values.append(read[0])

    def stop(self) -> dict | None:
        self._stop.set()
        self._thread.join(timeout=15)
        if not self.values:
            return None
        values = sorted(self.values)
        return {"name": self.name, "samples": len(values), "period_s": self.period,
                "busy_share": round(sum(1 for v in values if v > 0) / len(values), 3),
                "mean": round(sum(values) / len(values), 1), "median": values[len(values) // 2]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quick", choices=("tiny", "quick"))
    parser.add_argument("--engine", default="inprocess", choices=("inprocess", "flower"))
    parser.add_argument("--out", default=None, help="demo output folder (default: a fresh temporary folder)")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    parser.add_argument("--device", default="auto", help="the demo's --device (auto: a GPU when there is one)")
    args = parser.parse_args(argv)

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedpate-bench-demo-"))
    env = {**os.environ, "FEDPATE_CACHE": str(work / "cache"), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "sim.cli", "demo", "--preset", args.preset, "--engine", args.engine,
               "--out", str(work / "demo"), "--no-progress", "--device", args.device]
    print("running: " + " ".join(command), flush=True)
    sampler = GpuSampler.start()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    gpu = sampler.stop() if sampler is not None else None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cores = os.cpu_count() or 1
    output = completed.stdout + completed.stderr
    warnings = [line for line in output.splitlines() if WARNING.search(line)]
    measured = {"preset": args.preset, "engine": args.engine, "exit_code": completed.returncode,
                "wall_minutes": round(wall / 60, 2), "cpu_minutes": round(cpu / 60, 2), "cores": cores,
                "cpu_utilisation": round(cpu / (wall * cores), 3), "warning_lines": warnings,
                "peak_rss_mb_of_largest_child": round(after.ru_maxrss / 1024, 1)}
    print(f"fedpate demo --preset {args.preset} --engine {args.engine}: exit {completed.returncode}, "
          f"{measured['wall_minutes']} min wall, {measured['cpu_minutes']} min CPU, "
          f"utilisation {measured['cpu_utilisation']:.0%} of {cores} cores, "
          f"{len(warnings)} warning/deprecation line(s) in its output")
    for line in warnings:
        print("  " + line)
    measured["gpu"] = gpu
    if gpu is None:
        print("GPU busy share: skipped (no CUDA GPU: nvidia-smi is missing or lists none)")
    else:
        print(f"GPU busy share: {gpu['busy_share']:.0%} of {gpu['samples']} samples (every {gpu['period_s']} s) had a "
              f"kernel running; utilisation mean {gpu['mean']:.0f} %, median {gpu['median']:.0f} % ({gpu['name']})")
    if completed.returncode != 0:
        print(output[-3000:])
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=2))
    return completed.returncode


if __name__ == "__main__":
    raise SystemExit(main())
