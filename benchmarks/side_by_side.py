"""What the head-to-head benchmarks share: ``bench_vs_monai.py`` and ``bench_vs_opacus.py`` each time one fedpate cell
against a plain loop of the library it wraps, on the same cached world, in one process, and report the ratio.

Both take the same options (:func:`parser`), prepare the same way before anything is timed (:func:`prepare`: the
world generated and cached, both sides' libraries imported, one untimed forward and backward pass), measure each
side ``--repeats`` times in alternating order (:func:`alternate`), and report medians and their ratios
(:func:`median`, :func:`ratios`). Timings on a shared 2-core CPU swing by +-30% between runs: only the ratios of one
run mean anything.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

#: the presets a head-to-head benchmark runs
PRESETS = ("tiny", "quick", "paper")


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every head-to-head benchmark takes; a benchmark adds its own."""
    options = argparse.ArgumentParser(description=doc.splitlines()[0])
    options.add_argument("--preset", default="quick", choices=PRESETS)
    options.add_argument("--epochs", type=int, default=None, help="training epochs (default: the preset's)")
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--device", default="cpu")
    options.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    options.add_argument("--repeats", type=int, default=1, help="measurements per side, alternating the order")
    options.add_argument("--out", default=None, help="work folder (default: a fresh temporary one)")
    options.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    return options


def work_folder(args: argparse.Namespace, name: str) -> Path:
    """``--out``, else a fresh temporary folder named after the benchmark."""
    return Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"fedpate-bench-{name}-"))


def warm_up(preset, world: dict, device: torch.device) -> None:
    """One forward and backward pass of the network on a training batch, untimed: one-time kernel set-up (allocator,
    oneDNN / cuDNN plans) then goes to neither side."""
    from task.learning.networks import build_unet

    model = build_unet(preset.unet).to(device)
    model(torch.as_tensor(world["train_images"][:2]).to(device)).sum().backward()


def prepare(args: argparse.Namespace, libraries: tuple[str, ...]):
    """Everything before the first timed side: ``--threads``, the preset, the device, the world (generated and
    cached), both sides' libraries imported (the first side would pay them otherwise) and :func:`warm_up`. Returns
    (preset, device, world)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from sim.runners.central import load_central_data
    from task.learning.device import resolve_device
    from task.settings.presets import get_preset

    preset = get_preset(args.preset)
    device = resolve_device(args.device)
    world = load_central_data(preset, seed=args.seed, progress=False)
    for library in libraries:
        importlib.import_module(library)
    warm_up(preset, world, device)
    return preset, device, world


def report_start_up() -> None:
    """Print this process's start-up so far (imports, world): the benchmark's, not a cell's (``task.learning.phases`` gives
    the first window a process reports its start-up as "imports"), so it goes to neither side."""
    from task.learning import phases

    print(f"start-up (imports, world): {phases.seconds_since(time.perf_counter())['imports']:.1f} s", flush=True)


def alternate(sides: tuple[str, str], repeats: int, work: Path, run: Callable[[str, Path], dict]) -> dict[str, list]:
    """Each side measured ``repeats`` times, the order alternating (``sides`` first, then reversed): ``run(side,
    folder)`` returns the side's record, to which its wall and CPU seconds are added."""
    runs: dict[str, list] = {side: [] for side in sides}
    for repeat in range(repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        for side in order:
            folder = work / f"{side}-{repeat}"
            folder.mkdir(parents=True, exist_ok=True)
            started, cpu = time.perf_counter(), time.process_time()
            record = run(side, folder)
            record["wall"], record["cpu"] = time.perf_counter() - started, time.process_time() - cpu
            runs[side].append(record)
            print(f"  {side} run {repeat + 1}: {record['wall']:.1f} s wall, {record['cpu']:.1f} s CPU", flush=True)
    return runs


def median(runs: dict[str, list], side: str, key: str) -> float:
    """The median of ``key`` over ``side``'s measurements."""
    return float(np.median([record[key] for record in runs[side]]))


def ratios(runs: dict[str, list], ours: str, theirs: str) -> dict[str, float]:
    """fedpate's medians over the plain loop's: the training loop alone, the whole cell's wall and CPU seconds."""
    return {"training": median(runs, ours, "training") / median(runs, theirs, "training"),
            "cell_wall": median(runs, ours, "wall") / median(runs, theirs, "wall"),
            "cell_cpu": median(runs, ours, "cpu") / median(runs, theirs, "cpu")}
