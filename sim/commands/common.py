"""Options shared by every command that trains or runs a protocol (docs/PRIVACY.md, "Command line")."""

from __future__ import annotations

import argparse
import math

from task.learning.device import DEVICE_HELP, PRECISION_HELP, PRECISIONS   # no torch: spec strings and help text only
from task.settings.presets import get_preset


def _argument_type(kind, accepts, expected: str):
    """An argparse ``type``: the value converted by ``kind`` and checked by ``accepts``, or argparse's one-line
    error naming the flag (``argument --epsilon: expected ..., got '0'``) before any work starts."""
    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    parse.__name__ = expected
    return parse


positive_number = _argument_type(float, lambda v: math.isfinite(v) and v > 0, "a positive finite number")
open_fraction = _argument_type(float, lambda v: 0 < v < 1, "a number strictly between 0 and 1")
decay_fraction = _argument_type(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
positive_integer = _argument_type(int, lambda v: v >= 1, "a positive integer")
non_negative_integer = _argument_type(int, lambda v: v >= 0, "a non-negative integer")
at_least_one = _argument_type(float, lambda v: math.isfinite(v) and v >= 1, "a finite number >= 1")


def _size_of(name: str) -> str:
    """A preset's federation and grid in words, read from the preset itself (its numbers are written once, in
    ``task.settings.presets``)."""
    preset = get_preset(name)
    grid = "x".join(str(n) for n in preset.world.grid)
    return (f"{preset.federation.hospitals} hospitals x {preset.federation.teachers_per_hospital} teachers on a "
            f"{grid} grid")


#: what each preset is for (``--preset``'s help everywhere)
PRESET_SIZES = {"tiny": "a smoke test of the plumbing in minutes, too small to compare methods",
                "quick": f"the demo's size ({_size_of('quick')})",
                "paper": "the paper's size on the MSD folder at 64^3; for a GPU"}
SEED_HELP = ("seed of the data split, the initialisations and the batches (default: 0); the privacy noise is drawn "
             "from the OS's secure randomness unless --reproducible-noise")


def preset_help(default: str, choices=tuple(PRESET_SIZES)) -> str:
    return "experiment size: " + "; ".join(f"{name} = {PRESET_SIZES[name]}" for name in choices) + \
        f" (default: {default})"


def add_run_options(parser: argparse.ArgumentParser, default_preset: str = "quick", one_epsilon: bool = True) -> None:
    """The options of every command that runs something. ``one_epsilon=False`` (a grid of budgets) keeps
    ``--epsilon`` out of the help; the command then refuses it, pointing to its own option."""
    parser.add_argument("--out", required=True, help="output folder (results.json, ledger.jsonl, model/, ...)")
    parser.add_argument("--preset", default=default_preset, choices=tuple(PRESET_SIZES),
                        help=preset_help(default_preset))
    parser.add_argument("--epsilon", type=positive_number, default=None,
                        help="privacy budget epsilon (default: preset's, 8)" if one_epsilon else argparse.SUPPRESS)
    parser.add_argument("--delta", type=open_fraction, default=None,
                        help="privacy parameter delta, in (0, 1) (default: preset's, 1e-3)")
    parser.add_argument("--seed", type=non_negative_integer, default=0, help=SEED_HELP)
    parser.add_argument("--data", default=None,
                        help="MSD Task01 folder or a folder of BraTS case folders (2021/FeTS 2022 or 2023+ naming, "
                             "detected); when omitted, the preset's phantoms are generated once and cached")
    parser.add_argument("--layout", default=None, choices=("msd", "brats2021", "brats2023"),
                        help="the --data folder's layout (default: detected from its files)")
    parser.add_argument("--partition-file", default=None, metavar="CSV",
                        help="FeTS-style partition file (Partition_ID,Subject_ID, e.g. FeTS 2022 partitioning_1.csv) "
                             "with --data: each partition is a hospital (the largest H with --hospitals H, else all); "
                             "test and public patients are held out from each hospital proportionally")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--reproducible-noise", action="store_true",
                        help="SIMULATION ONLY: draw the privacy noise from streams seeded by --seed so a run can be "
                             "repeated exactly. Such results are not private (whoever knows the seed can remove the "
                             "noise), so the seed is then left out of every artefact. Default: secure OS noise")


def add_compute_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--precision``, for every command that trains or predicts."""
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N", help=DEVICE_HELP)
    parser.add_argument("--precision", default="32", choices=PRECISIONS, help=PRECISION_HELP)


def resolved_device(args):
    """The ``torch.device`` of ``--device``, resolved before any work starts: asking for a GPU that is not
    there is refused in one line (exit 2) rather than discovered after minutes of data preparation."""
    from task.learning.device import resolve_device

    return resolve_device(args.device)


def add_federation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hospitals", type=positive_integer, default=None,
                        help="number of hospitals (default: preset's)")
    parser.add_argument("--teachers-per-hospital", type=positive_integer, default=None,
                        help="teacher partitions per hospital (default: preset's); K = hospitals x this")


def add_threat_options(parser: argparse.ArgumentParser) -> None:
    """The secure methods' threat model (``*-secure``): each hospital counts only the noise shares of hospitals that
    are neither colluding nor dropped, and refuses a request below its own policy."""
    parser.add_argument("--secure-colluders", type=non_negative_integer, default=0, metavar="T",
                        help="secure methods: hospitals that may share everything with the aggregator (default 0); "
                             "each hospital adds noise as if their shares were missing")
    parser.add_argument("--secure-dropouts", type=non_negative_integer, default=0, metavar="D",
                        help="secure methods: hospitals that may leave mid-protocol (default 0); SecAgg+ recovers "
                             "their masks and each hospital adds noise as if their shares were missing")
    parser.add_argument("--secure-threshold", type=non_negative_integer, default=0, metavar="N",
                        help="secure methods: Shamir threshold of the masks' shares (default 0: the smallest the "
                             "hospitals accept, above the colluders)")


def threat_options(args) -> dict:
    """RunSettings' threat-model fields from the parsed options."""
    return {"secure_colluders": args.secure_colluders, "secure_dropouts": args.secure_dropouts,
            "secure_threshold": args.secure_threshold or None}


def check_secure_plan(args, methods) -> None:
    """Secure-sum parameters the hospitals cannot hold (``task.wire.secagg.check_secure_settings``), refused in one
    line before the device, the data or the output folder is touched."""
    from task.settings import methods as registry
    from task.wire.secagg import check_secure_settings

    if set(methods) & set(registry.names(secure_sum=True)):
        hospitals = resolve_hospitals(getattr(args, "hospitals", None), getattr(args, "partition_file", None))
        check_secure_settings(get_preset(args.preset, hospitals=hospitals).hospitals, args.secure_colluders,
                              args.secure_dropouts, args.secure_threshold or None)


def data_options(args) -> dict:
    """``layout`` / ``partition_file`` of the parsed options, checked (a layout or partition file without
    --data is a mistake, not something to ignore)."""
    from task.errors import UserError

    from pathlib import Path

    layout, partition_file = getattr(args, "layout", None), getattr(args, "partition_file", None)
    if (layout or partition_file) and not getattr(args, "data", None):
        raise UserError(f"{'--layout' if layout else '--partition-file'}: needs --data (a data folder to read)")
    data = getattr(args, "data", None)
    if data and not Path(data).exists():
        raise UserError(f"--data {data}: does not exist (expected an MSD Task01 folder or a folder of BraTS case "
                        "folders)")
    return {"layout": layout, "partition_file": partition_file}


def resolve_hospitals(hospitals: int | None, partition_file: str | None) -> int | None:
    """With a partition file and no --hospitals, every partition is a hospital."""
    if partition_file and hospitals is None:
        from task.data.fets import count_partitions

        return count_partitions(partition_file)
    return hospitals


def add_real_check_option(parser: argparse.ArgumentParser, environment: bool = False) -> None:
    """``--real-check DIR`` (repeatable): score every model the command trains on labelled real cases too
    (``task.reporting.realcheck``); ``environment``: FEDPATE_REAL_CHECK names folders when the option is not given."""
    parser.add_argument("--real-check", action="append", default=None, metavar="[KIND=]DIR",
                        help="a folder of labelled real cases (MSD Task01, BraTS 2021 or BraTS 2023 case folders, or "
                             "one case folder); every model is also scored on them, in each case's own grid, beside "
                             "its phantom Dice (repeatable: the cases of every folder are pooled). KIND says who drew "
                             "the folder's label maps, expert or algorithm (an algorithm's output), and the report "
                             "marks its cases so; fedpate cannot tell from the files"
                             + ("; default: the folders in FEDPATE_REAL_CHECK (separated by ':')" if environment else ""))


def open_real_check(args, environment: bool = False):
    """The :class:`task.reporting.realcheck.RealCheck` of ``--real-check`` (or, with ``environment``, of FEDPATE_REAL_CHECK),
    its folders checked now, before anything trains; None when no folder is named."""
    from task.reporting.realcheck import ENVIRONMENT, folders_from_environment, open_check

    folders = getattr(args, "real_check", None) or []
    if folders or not environment:
        return open_check(folders, "--real-check")
    return open_check(folders_from_environment(), ENVIRONMENT)


def real_check_line(method: str, found: dict) -> str:
    """One console line of a model's real-scan check (``results.json``'s ``real_check``)."""
    if found.get("error"):
        return f"{method} on real scans: scoring failed ({found['error']})"
    dice = found.get("dice") or {}

    def fmt(key):
        return "n/a" if dice.get(key) is None else f"{dice[key]:.3f}"

    return (f"{method} on {len(found.get('cases') or [])} real case(s): mean Dice {fmt('mean')} (WT {fmt('WT')}, "
            f"TC {fmt('TC')}, ET {fmt('ET')}; each case's own grid; scored in {found.get('seconds', 0):.1f} s)")
