"""Wall time and CPU utilisation of the README's main job, ``fedpate demo``.

    python benchmarks/bench_demo.py                      # the demo as the README runs it (quick preset)
    python benchmarks/bench_demo.py --preset tiny        # a smoke run of the same path
    python benchmarks/bench_demo.py --engine flower      # the same cells as Flower apps (Ray: 1 core per hospital)

Runs the demo in a fresh process with its own cache and output folder (nothing reused: phantoms, world and
every cell are computed), and prints, from that one run: wall minutes, CPU minutes (the process and its
children, from ``getrusage``), CPU utilisation = CPU time / (wall time x cores), and every line of its
output that mentions a deprecation or a warning. Ratios, not absolute seconds, are what carries between
machines (on a 2-core machine timings swing +-30% from run to run).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARNING = re.compile(r"deprecat|warning", re.IGNORECASE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quick", choices=("tiny", "quick"))
    parser.add_argument("--engine", default="inprocess", choices=("inprocess", "flower"))
    parser.add_argument("--out", default=None, help="demo output folder (default: a fresh temporary folder)")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    args = parser.parse_args(argv)

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedpate-bench-demo-"))
    env = {**os.environ, "FEDPATE_CACHE": str(work / "cache"), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "sim.cli", "demo", "--preset", args.preset, "--engine", args.engine,
               "--out", str(work / "demo"), "--no-progress"]
    print("running: " + " ".join(command), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
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
    if completed.returncode != 0:
        print(output[-3000:])
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=2))
    return completed.returncode


if __name__ == "__main__":
    raise SystemExit(main())
