"""Options shared by every command that trains or runs a protocol (SPEC section 10)."""

from __future__ import annotations

import argparse

from sim.device import DEVICE_HELP, PRECISION_HELP, PRECISIONS   # no torch: spec strings and help text only


def add_run_options(parser: argparse.ArgumentParser, default_preset: str = "quick") -> None:
    parser.add_argument("--out", required=True, help="output folder (results.json, ledger.jsonl, model/, ...)")
    parser.add_argument("--preset", default=default_preset, choices=("tiny", "quick", "paper"),
                        help=f"experiment size (default: {default_preset})")
    parser.add_argument("--epsilon", type=float, default=None, help="privacy budget epsilon (default: preset's, 8)")
    parser.add_argument("--delta", type=float, default=None, help="privacy parameter delta (default: preset's, 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--data", default=None,
                        help="MSD Task01-layout folder; when omitted, the preset's phantoms are generated once and cached")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--reproducible-noise", action="store_true",
                        help="SIMULATION ONLY: draw the privacy noise from streams seeded by --seed so a run can be "
                             "repeated exactly. Such results are not private (whoever knows the seed can remove the "
                             "noise), so the seed is then left out of every artefact. Default: secure OS noise")


def add_compute_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--precision`` (issue 30), for every command that trains or predicts."""
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N", help=DEVICE_HELP)
    parser.add_argument("--precision", default="32", choices=PRECISIONS, help=PRECISION_HELP)


def resolved_device(args):
    """The ``torch.device`` of ``--device``, resolved before any work starts: asking for a GPU that is not
    there is refused in one line (exit 2) rather than discovered after minutes of data preparation."""
    from sim.device import resolve_device

    return resolve_device(args.device)


def add_federation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hospitals", type=int, default=None, help="number of hospitals (default: preset's)")
    parser.add_argument("--teachers-per-hospital", type=int, default=None,
                        help="teacher partitions per hospital (default: preset's); K = hospitals x this")
