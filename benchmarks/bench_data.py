"""Data-layer throughput: phantom generation (2 mm, 3 mm; incl. NIfTI .gz writing) and preprocessing to 32^3.

Run: ``.venv/bin/python benchmarks/bench_data.py [--cases N]``. Prints cases/second measured in one run
(the machine is shared: compare ratios within a run, not absolute numbers across runs). The one-off
template load/resample per resolution is timed separately and excluded from cases/second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=6, help="cases per measurement (default: 6)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from task.data.msd import load_case, read_msd
    from task.data.phantoms import PhantomSpec, anatomy_shape, generate_phantoms
    from task.data.preprocess import PreprocessConfig, preprocess_case

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for res in (2.0, 3.0):
            start = time.perf_counter()
            shape = anatomy_shape(res)
            setup = time.perf_counter() - start
            start = time.perf_counter()
            root = generate_phantoms(Path(tmp) / f"p{res:g}",
                                     PhantomSpec(cases=args.cases, institutions=4, seed=0, resolution_mm=res),
                                     progress=False)
            seconds = time.perf_counter() - start
            rates[f"generate {res:g} mm"] = args.cases / seconds
            print(f"generate  {res:g} mm  grid {'x'.join(map(str, shape))}: {args.cases / seconds:6.2f} cases/s "
                  f"({seconds / args.cases:.2f} s/case; template setup {setup:.1f} s once)")
        dataset = read_msd(Path(tmp) / "p2")
        config = PreprocessConfig(grid=(32, 32, 32))
        start = time.perf_counter()
        for case in dataset.training:
            image, label, affine = load_case(case)
        read_seconds = time.perf_counter() - start
        start = time.perf_counter()
        for case in dataset.training:
            image, label, affine = load_case(case)
            preprocess_case(image, label, affine, config)
        seconds = time.perf_counter() - start
        n = len(dataset.training)
        print(f"read      2 mm phantoms        : {n / read_seconds:6.2f} cases/s")
        print(f"read + preprocess 2 mm -> 32^3 : {n / seconds:6.2f} cases/s "
              f"(preprocess alone {n / max(seconds - read_seconds, 1e-9):.2f} cases/s)")
    print(f"ratio generation 3 mm / 2 mm: {rates['generate 3 mm'] / rates['generate 2 mm']:.2f}x")


if __name__ == "__main__":
    main()
