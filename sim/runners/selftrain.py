"""The ``public-selftrain`` cell of a comparison (the public floor): ``server.selftrain.self_train`` on the
comparison's public world, written like ``public-only`` (results.json, an empty ledger, a model bundle).

It reads the world through :func:`task.world.load_world` without the query scans' labels (they are the
population's: a simulation diagnostic elsewhere, never a training input here), so it holds only what the
server holds in a deployment: the query scans, the public reference and validation sets and the test set
that scores every method. No hospital is asked anything and nothing is charged: ``epsilon`` is null and
the ledger is empty, as for ``public-only``.

One exception, stated in its results (``labels_used``, :func:`labels_used`): where a preset has no separate
public reference set (``paper``: Fay et al. pre-train on the labels of the student's partition), the
reference set *is* the query set, so the reference maps it trains on are the query scans' labels. Those are
still public data (no hospital, no privacy cost), but the cell then is not "the query scans without their
labels".
"""

from __future__ import annotations

import time

from server.selftrain import train_public_models
from sim.runners.floors import FloorRun
from task.options import PublicStart
from task.reporting.bundle import preprocessing_of
from task.learning.networks import network_config
from task.learning.device import device_name, model_device
from task.reporting.results import ModelRelease, RunResults, write_run
from task.learning.training import evaluate_release, per_class_of
from task.world import build_world, load_world
from task.reporting import trust

METHOD = "public-selftrain"


def labels_used(world) -> str:
    """Which labels the self-training read: the public reference maps, which are the query scans' own labels
    when the reference set is the query set (module docstring)."""
    if list(world.reference_ids) == list(world.query_ids):
        return ("the query scans' labels: this preset has no separate public reference set, so the reference maps "
                "trained on beside the pseudo-labels are the query set's own labels (Fay et al.'s choice)")
    return "public reference maps only; the query scans' labels are never read"


def run_public_selftrain(run: FloorRun) -> dict:
    """Self-train the public model (``run.shared_dir/public-model.pt``) on the public query scans, in ``run.out``
    (:class:`sim.runners.floors.FloorRun`); rounds and temperature from the preset's ``self_training``
    (:class:`task.settings.presets.SelfTraining`). The rounds are checkpointed beside the public model, where a comparison
    whose ``public_start`` is ``self-trained`` finds them: this baseline is then the model every cell starts from.
    """
    started = time.perf_counter()
    preset, seed, out, compute = run.preset, run.seed, run.out, run.compute
    precision = compute.precision
    world = load_world(*build_world(preset, run.data, seed, compute.progress, **run.where), with_query_labels=False)
    # the same call, and so the same checkpoints, as the comparison's start model when that is self-trained
    outcome = train_public_models(world, preset.with_changes(public_start=PublicStart.SELF_TRAINED), seed=seed,
                                  checkpoint=run.shared_dir / "public-model.pt", compute=compute).selftrain
    rounds = len(outcome.validation_dice)
    dice, dice_per_case = evaluate_release(outcome.model, world.test_images, world.test_labels,
                                           precision=precision)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger.jsonl").touch(mode=0o600)   # no private data: an empty ledger, no privacy cost
    results = RunResults(method=METHOD, dice=dice, seed=seed if run.publish_seed else None,
                         device=device_name(model_device(outcome.model)), precision=precision)
    results.extras = {
        "dice_per_case": dice_per_case, "dice_per_case_class": per_class_of(dice_per_case),
        "reference_cases": len(world.reference_labels), "query_scans": outcome.query_scans,
        "validation_dice_mean": outcome.validation_dice[outcome.chosen_round - 1],
        "selftrain": {"rounds": rounds, "temperature": outcome.temperature,
                      "epochs_per_round": outcome.epochs_per_round,
                      "validation_dice_per_round": outcome.validation_dice, "round_chosen": outcome.chosen_round,
                      "selection": "best mean Dice on the public validation set",
                      "labels_used": labels_used(world)},
        "role": "floor: public data only, no hospital involved",
        "aggregation": "none", "who_sees_what": trust.public_only("the public reference data and query scans"),
    }
    release = ModelRelease(outcome.model, network_config(preset.unet), preprocessing_of(world), world.source,
                           card_extra={"note": "the public model self-trained on the public query scans "
                                               "(pseudo-labels) with the public reference data (labels read: "
                                               f"{labels_used(world)}): no private data, no privacy cost"})
    return write_run(out, results, release, started=started, real_check=run.real_check)
