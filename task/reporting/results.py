"""The results record of one run (docs/PRIVACY.md, "Results") and the one place a run folder is written.

:class:`RunResults` holds every key of the ``results.json`` schema -- always present, ``None``
where it does not apply (``dice`` on a classification task, ``accuracy`` on segmentation, every privacy
field of a non-private run) -- plus the same run's ε under each neighbouring relation where it is defined,
and one dict of method-specific ``extras`` that is merged in without ever overriding a schema key.

Its privacy fields are read from the run's ledger (:meth:`RunResults.account`): ε is the worst owner's
(a model trained on several owners' patients is as private as its least private owner), with that owner's
relation and accountant, never a number a caller computed.

:func:`write_run` is the only writer of ``results.json``: model bundle first (``task.reporting.bundle.save_bundle``,
its privacy card built from the same ledger), then the predicted test segmentations if any, then
``results.json`` atomically, with the commit of the code that ran (``task.reporting.provenance``). Nothing patches
``results.json`` afterwards. When the run is given a real-scan check (``task.reporting.realcheck``), the released model is
scored on its labelled real cases there, before
``results.json`` is written (``real_check``).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import nibabel as nib
import numpy as np

from privacy.ledger import Ledger
from task.reporting.bundle import CardGuarantee, privacy_card, save_bundle, update_card
from task.data.preprocess import invert_label
from task.learning import inference, phases
from task.reporting import realcheck
from task.learning.accounting import memoised_per_relation
from task.io import atomic_write_bytes, atomic_write_json
from task.learning.phases import phase
from task.reporting.provenance import code_commit, commit_moved
from task.learning.metrics import DICE_KEYS



@dataclass
class RunResults:
    """One run's ``results.json``: the schema keys, then ``extras``."""

    method: str
    dice: dict | None = None                  # {"1", "2", "3", "mean", "WT", "TC", "ET"}; None on classification
    accuracy: float | None = None             # classification tasks only
    epsilon: float | None = None              # what the ledger says was spent (worst owner)
    epsilon_budget: float | None = None
    delta: float | None = None
    relation: str | None = None               # "replace-one" | "add-remove" | "zero-out"
    accountant: str | None = None
    epsilon_add_remove: float | None = None   # the same mechanisms under each relation (None: undefined)
    epsilon_replace_one: float | None = None
    teachers: int | None = None
    hospitals: int | None = None
    queries: int | None = None
    sigma: float | None = None
    teacher_dice_mean: float | None = None
    ensemble_dice_mean: float | None = None
    bytes_up_per_query_per_teacher: int | None = None
    wall_seconds: float | None = None
    seed: int | None = None                   # None when it would let anyone regenerate the noise
    #: where the released model was trained (``task.learning.device.device_name``: "cpu", "cuda:0 (<GPU>)") and
    #: the forward-pass precision ("32" | "bf16"); None where the producer does not train a model on a device
    device: str | None = None
    precision: str | None = None
    #: the released model scored on labelled real cases (``--real-check``, ``task.reporting.realcheck.score_model``):
    #: {"dice": mean over cases, "cases": per-case rows, "folders", "seconds"}; None when no real case was given
    real_check: dict | None = None
    #: how the released model's Dice (phantom test set and real check) was computed (``task.learning.inference``);
    #: None on classification
    inference: str | None = None
    #: the commit of the code that ran (``task.reporting.provenance.code_commit``: ``git rev-parse HEAD``, ``-dirty`` when a
    #: tracked file differed, ``unknown`` without a checkout; the one the command started from); filled by
    #: :func:`write_run`, which adds the extra ``commit_when_written`` when the checkout has moved on since
    commit: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def account(self, ledger: Ledger, delta: float, relation: str | None = None) -> "RunResults":
        """Fill ε, δ, relation and accountant from ``ledger``: the worst owner's, plus that mechanism's ε
        under each relation where it is defined (``privacy.accountants.epsilon_per_relation``, memoised). An empty
        ledger has spent nothing: ε = 0 under the ``relation`` the method declares."""
        self.delta = float(delta)
        owners = ledger.owners()
        if not owners:
            self.epsilon, self.relation, self.accountant = 0.0, relation, None
            self.epsilon_add_remove = self.epsilon_replace_one = None
            return self
        spent = {owner: ledger.spent(owner, delta) for owner in owners}
        worst = max(spent.values(), key=lambda s: s.epsilon)
        self.epsilon, self.relation, self.accountant = float(worst.epsilon), worst.relation, worst.accountant
        per_relation = _worst_per_relation(ledger, spent, delta)
        self.epsilon_add_remove = per_relation["epsilon_add_remove"]
        self.epsilon_replace_one = per_relation["epsilon_replace_one"]
        return self

    def to_dict(self) -> dict[str, Any]:
        """The ``results.json`` content: every schema key, then the extras (which may add, never override)."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        clash = sorted(set(record) & set(self.extras))
        if clash:
            raise ValueError(f"results extras may not override schema keys: {clash}")
        return {**record, **self.extras}


#: scalar schema fields, in record order: the columns every comparison's cells.csv has (sim.report)
SCALAR_FIELDS = tuple(f.name for f in dataclasses.fields(RunResults)
                      if f.name not in ("dice", "real_check", "inference", "extras"))
CSV_COLUMNS = SCALAR_FIELDS + tuple(f"dice_{key}" for key in DICE_KEYS) + realcheck.CSV_COLUMNS


def csv_row(results: Mapping[str, Any]) -> dict[str, Any]:
    """One results.json as a row of :data:`CSV_COLUMNS` (Dice flattened into ``dice_<key>``, the real-scan
    check's mean Dice into ``real_dice_<key>``)."""
    row = {key: results.get(key) for key in SCALAR_FIELDS}
    dice = results.get("dice") or {}
    row.update({f"dice_{key}": dice.get(key) for key in DICE_KEYS})
    row.update(realcheck.csv_fields(results))
    return row


def _worst_per_relation(ledger: Ledger, spent: Mapping[str, Any], delta: float) -> dict[str, float | None]:
    """Max over owners of each relation's ε (None as soon as one owner's is undefined). Owners charged the
    same events (pooled training: every hospital alike) are accounted once."""
    rows, seen = [], {}
    for owner, owner_spent in spent.items():
        events = ledger.events(owner)
        key = (tuple(repr(event) for event in events), owner_spent.relation)
        if key not in seen:
            # memoised on disk (task.learning.accounting): the run's DP-SGD session asked for the same figure
            seen[key] = memoised_per_relation(events, delta, owner_spent.relation, owner_spent.epsilon)
        rows.append(seen[key])
    return {name: None if any(row[name] is None for row in rows) else max(row[name] for row in rows)
            for name in ("epsilon_add_remove", "epsilon_replace_one")}


@dataclass
class ModelRelease:
    """A trained model leaving with its results: what ``fedpate predict`` needs, and its card's inputs."""

    model: Any                                  # torch.nn.Module
    network: Mapping[str, Any]                  # task.learning.networks.network_config
    preprocessing: Mapping[str, Any]            # task.reporting.bundle.preprocessing_of
    data_source: Mapping[str, Any]
    card_extra: Mapping[str, Any] | None = None
    #: predicted test label maps (n, *grid) and the world they belong to: written as NIfTI in each scan's grid
    test_predictions: tuple[np.ndarray, Any] | None = None


def write_run(out: str | Path, results: RunResults, release: ModelRelease | None = None,
              started: float | None = None, real_check: "realcheck.RealCheck | None" = None) -> dict[str, Any]:
    """Write a run folder: the model bundle (card from ``out/ledger.jsonl``, with the test Dice; resealed with the
    real-scan check's Dice when one ran), predictions, results.json (with the code's commit).

    ``started`` (``time.perf_counter()`` at the start of the run): ``wall_seconds`` then covers
    everything up to this write, and ``phase_seconds`` (an extra) says where it went (``task.learning.phases``).
    ``real_check``: the run's real-scan check (``task.reporting.realcheck``; None: none), on which the released model is
    scored into ``real_check``. Returns the dict written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if results.dice is not None and results.inference is None:
        # every segmentation producer scores its release with task.learning.training.evaluate_release
        results.inference = inference.DESCRIPTION
    if results.commit is None:
        results.commit = code_commit()   # the commit the command started from
        moved = commit_moved()
        if moved is not None:   # the checkout moved on during the run: this cell's process may run newer code
            results.extras["commit_when_written"] = moved
    with phase("writing"):
        _write_release(out, results, release)
    if started is not None:
        results.wall_seconds = round(time.perf_counter() - started, 3)
        # where the wall time went (task.learning.phases); under the same privacy note as the wall time where it has one
        results.extras["phase_seconds"] = phases.seconds_since(started)
        flagged = results.extras.get("not_private_diagnostics")
        if isinstance(flagged, list) and "wall_seconds" in flagged and "phase_seconds" not in flagged:
            flagged.append("phase_seconds")
    if release is not None and results.real_check is None:
        # after wall_seconds: the run's time stays comparable with and without the check (it records its own)
        results.real_check = realcheck.score_release(real_check, release.model, release.preprocessing,
                                                     results.precision)
        if (results.real_check or {}).get("dice"):
            update_card(out, {"test_dice": dice_for_card(results)})   # the card states the real check's Dice too
    record = results.to_dict()
    atomic_write_json(out / "results.json", record)
    return record


def _write_release(out: Path, results: RunResults, release: ModelRelease | None) -> None:
    """The model bundle (its card from ``out/ledger.jsonl``) and the test predictions of ``release``, if any."""
    if release is not None:
        card = privacy_card(method=results.method, ledger_path=out / "ledger.jsonl", data_source=release.data_source,
                            guarantee=CardGuarantee(delta=results.delta, epsilon_budget=results.epsilon_budget,
                                                    relation=results.relation, accountant=results.accountant),
                            teachers=results.teachers, hospitals=results.hospitals, queries=results.queries,
                            extra={**({"device": results.device} if results.device else {}),
                                   **({"precision": results.precision} if results.precision else {}),
                                   **dict(release.card_extra or {}), **trust_of(results),
                                   **({"test_dice": dice_for_card(results)} if results.dice else {}),
                                   "commit": results.commit})
        save_bundle(out, release.model, release.network, release.preprocessing, card)
        if release.test_predictions is not None:
            labels, world = release.test_predictions
            results.extras["predictions"] = write_test_predictions(out / "predictions", labels, world)


def dice_for_card(results: RunResults) -> dict[str, Any]:
    """The test Dice a model card states: on the held-out test patients and, where it ran, on the real-scan check
    (mean over its cases), each as WT, TC, ET and the mean over the classes, with its number of cases."""
    shown = ("WT", "TC", "ET", "mean")
    per_case = (results.extras or {}).get("dice_per_case")
    found: dict[str, Any] = {"inference": results.inference}
    if results.dice:
        found["test"] = {"cases": len(per_case) if isinstance(per_case, list) else None,
                         **{key: results.dice.get(key) for key in shown}}
    check = results.real_check or {}
    if check.get("dice"):
        cases = check.get("cases") or []
        references = {}
        for case in cases:
            if case.get("reference"):
                references[case["reference"]] = references.get(case["reference"], 0) + 1
        found["real_check"] = {"cases": len(cases), "references": references,
                               **{key: check["dice"].get(key) for key in shown}}
    return found


def trust_of(results: RunResults) -> dict[str, Any]:
    """The card's trust model: the run's own ``aggregation`` and ``who_sees_what`` (``task.reporting.trust``), as the
    report states them per cell; nothing for a producer that records none."""
    extras = results.extras or {}
    if not extras.get("who_sees_what"):
        return {}
    return {"aggregation": extras.get("aggregation"), "who_sees_what": dict(extras["who_sees_what"])}


def write_test_predictions(folder: Path, labels: np.ndarray, world) -> dict:
    """Predicted test label maps as NIfTI, each back in its scan's own grid (what ``fedpate predict`` writes too)."""
    note = "each scan's own grid (task.data.preprocess.invert_label)"
    for case_id, label in zip(world.test_ids, labels):
        affine = np.eye(4)
        try:
            record = world.prepared.record(case_id)
            label = invert_label(label, record)
            affine = np.asarray(getattr(record, "affine", affine))
        except Exception as exc:  # noqa: BLE001 - fall back to the working grid, say so
            note = f"working grid (inversion failed: {exc})"
        image = nib.Nifti1Image(np.asarray(label, np.uint8), affine)
        buffer = io.BytesIO()
        file_map = image.make_file_map({"image": buffer, "header": buffer})
        image.to_file_map(file_map)
        # mtime=0: the same labels give the same bytes
        atomic_write_bytes(folder / f"{case_id}.nii.gz", gzip.compress(buffer.getvalue(), compresslevel=6, mtime=0))
    return {"folder": str(folder), "cases": len(labels), "grid": note}
