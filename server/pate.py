"""High-dimensional PATE, written against a transport (Fay et al., Algorithms 1-2; SPEC sections 3-5, 11).

``run_pate`` reads like the algorithm:

(a) pre-train a public model on the public reference split; ship it as the teachers' initialisation;
(b) calibrate: ``c = sigma / S`` for N queries at (epsilon, delta) (exact mu-GDP by default, eq. 15 on
    request; both are linear in S), fit the compressor on the public reference label maps (the AE is
    trained with the deployment sigma in its bottleneck; PCA chooses l by eq. 7), ``sigma = c S(K)``;
(c) query loop: every query is one Gaussian mechanism, charged to every answering hospital in the
    ledger **before** its noise is drawn (server/aggregation.py);
(d) decode the noisy latents into pseudo-labels, train the student (public model + public data);
(e) evaluate: student, public-only baseline, per-teacher Dice (computed at the hospitals on the public
    test set), noise-free ensembles; (f) write results.json, ledger.jsonl, model bundle, predictions.

Dropouts: a hospital that does not answer (or whose reply is rejected) is simply not in that query's
sum; K shrinks, S = S(K) grows and the ledger records the S actually used. If a charge would exceed a
budget, querying stops (nothing more is released) and the student is trained on the answered queries;
``results["stopped_early"]`` says why. The budget is never exceeded: the guard refuses first.

Diagnostics that are NOT covered by the DP guarantee (simulation only, flagged in results.json under
``not_private_diagnostics``): the mean teacher Dice, the noise-free ensembles (one extra, un-noised
query of the public test scans), and the pseudo-label Dice on the query scans.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
import secrets
from typing import Any, Mapping, Protocol

import numpy as np

from server.aggregation import aggregate_query
from server.compressors import make_compressor
from sim import codecs
from sim.world import public_validation_dice

log = logging.getLogger("fedpate.pate")

METHODS = ("pate-pca", "pate-ae", "pate-naive")
#: the server checks its own codec as the hospitals will (any kind it can build, any length)
SERVER_POLICY = codecs.CodecPolicy(max_latent_dim=1 << 62, allow_identity=True)


class HospitalTransport(Protocol):
    """How the protocol talks to hospitals (in-process, or Flower: server/flower_transport.py)."""

    def hospital_ids(self) -> list[str]: ...

    def train(self, config: dict, init_weights: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        """Per hospital: teacher metrics (incl. "teachers") and local epsilon."""

    def query(self, scans: np.ndarray, codec: Mapping[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
        """Per responding hospital: (T_h, n, l) encodings; missing hospitals are simply absent."""

    def evaluate(self, config: dict, test: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        """Per hospital: {"teacher_dice": [...], ...} on the public test arrays sent."""


def _state_arrays(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()}


def _dice(model, images, labels) -> tuple[dict, list]:
    """(Dice dict, per-case mean Dice) on the test set."""
    from sim.training import evaluate_segmentation_per_case

    return evaluate_segmentation_per_case(model, images, labels)


def _label_dice(probs: np.ndarray, labels: np.ndarray) -> dict:
    from sim.metrics import dice_scores

    return dice_scores(np.asarray(probs).argmax(axis=1), labels)


def run_pate(transport: HospitalTransport, world, preset, method: str, epsilon: float, delta: float,
             out_dir, seed: int = 0, calibration: str = "exact", progress: bool = True, soft_labels: bool = True,
             *, pca_mode: str = "public", query_batch: int = 8, diagnostics: bool = True,
             include_reference: bool = True, local_dp: Mapping | None = None,
             compressor_options: Mapping | None = None, shared_dir: str | Path | None = None,
             noise=None) -> dict:
    """Run PATE end to end and write ``out_dir/results.json`` (SPEC section 10); returns the results.

    ``noise``: the ``privacy.mechanisms.NoiseSource`` of this run's releases (secure when None); each
    query draws from its own stream named after its release id.
    """
    import torch

    from privacy.calibration import pate_sigma
    from privacy.events import GaussianEvent
    from privacy.errors import BudgetExceeded
    from privacy.guard import BudgetGuard
    from privacy.ledger import Ledger
    from privacy.mechanisms import NoiseSource
    from server.student import train_public_model, train_student
    from sim.errors import UserError
    from sim.io import atomic_write_json

    if method not in METHODS:
        raise UserError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    started = time.perf_counter()
    out = Path(out_dir)
    ledger_path = out / "ledger.jsonl"
    if ledger_path.exists() and ledger_path.stat().st_size > 0:
        # an earlier run released from these patients: running again would be a second release that a
        # fresh ledger would hide (its releases stay counted in the hospitals' own ledgers)
        raise UserError(f"--out {out}: already holds {ledger_path.name} from an earlier run; use a new folder")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # Un-noised diagnostics (teacher Dice, noise-free ensembles) exist only in simulation: deployed
    # hospitals refuse them, so the server does not ask.
    deployed = sorted(h for h, is_deployed in getattr(transport, "deployed", {}).items() if is_deployed)
    diagnostics = diagnostics and not deployed

    # (a) public model -> teachers' initialisation; teachers trained at the hospitals
    # ``shared_dir``: checkpoints of the epsilon-independent public models, so a comparison trains them
    # (and, through identical initial weights, the teachers) once for all its cells.
    shared = Path(shared_dir) if shared_dir is not None else None
    public_model = train_public_model(world, preset, seed=seed, progress=progress,
                                      checkpoint=shared / "public-model.pt" if shared else None)
    train_metrics = transport.train({"teacher_epochs": preset.teacher_epochs, "seed": seed,
                                     **({"local_dp": dict(local_dp)} if local_dp else {})},
                                    init_weights=_state_arrays(public_model))
    planned = {h: int(m.get("teachers", 0)) for h, m in train_metrics.items() if int(m.get("teachers", 0)) > 0}
    teachers_planned = int(sum(planned.values()))
    if teachers_planned == 0:
        raise UserError("no hospital trained any teacher: nothing to query")

    # (b) calibration and compressor (fitted on PUBLIC reference label maps only)
    queries = len(world.query_images)
    noise_per_sensitivity = pate_sigma(epsilon, delta, queries, 1.0, mode=calibration)
    options = dict(compressor_options or {})
    if method == "pate-pca":
        options.setdefault("sensitivity_mode", pca_mode)
    compressor = make_compressor(method, preset, seed=seed, checkpoint=out / "compressor" / "autoencoder.pt",
                                 progress=progress, **options)
    reference_maps = codecs.one_hot(world.reference_labels, world.classes)
    if method == "pate-ae":
        compressor.train_sigma = noise_per_sensitivity * compressor.sensitivity(teachers_planned)
    compressor.fit(reference_maps)
    if method == "pate-pca":
        compressor.resolve_components(noise_per_sensitivity, teachers_planned)
    # The codec state as shipped is the one source of the sensitivity: the hospitals recompute S from it
    # (sim.codecs.verify_codec / codec_sensitivity) and charge their own ledgers, so the server uses the
    # very same numbers (the float32 basis shipped, not the float64 one kept here).
    state = codecs.verify_codec(compressor.state(), SERVER_POLICY)
    sensitivity = codecs.codec_sensitivity(state, teachers_planned)
    sigma = pate_sigma(epsilon, delta, queries, sensitivity, mode=calibration)
    # pate_sigma aims 1e-9 below the budget, so the guard's own re-computation of the planned queries
    # (batch checks and per-query charges) fits it: tests/test_privacy_calibration.py checks exactly that.
    collapse = compressor.collapsed() if method == "pate-ae" else None

    # (c) the query loop under the budget guard
    ledger = Ledger(ledger_path)
    guard = BudgetGuard(ledger, float(epsilon), float(delta))
    noise = noise if noise is not None else NoiseSource()
    answered, latents, teachers_seen, rejected, unreleased = [], [], [], {}, []
    stopped_early = None
    # Release ids are unique per run (a nonce): the hospitals' own ledgers outlive this run, and an
    # identical id would merge a new release into an old one.
    run_nonce = secrets.token_hex(4)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=queries, desc=f"{method} queries", leave=False)
    for start in range(0, queries, max(1, int(query_batch))):
        batch = list(range(start, min(queries, start + query_batch)))
        # The K this batch will be averaged over: the teachers of the hospitals still connected. The
        # hospitals charge their own ledgers for that K, so a query with fewer answers is not released.
        asked = {h: planned[h] for h in transport.hospital_ids() if h in planned}
        declared = int(sum(asked.values()))
        if declared == 0:
            stopped_early = "no hospital with teachers is connected"
            break
        # refuse before any teacher runs if not even one query of the batch fits the budget; after a
        # dropout (larger S) only a prefix of the batch may still fit
        batch, refusal = _largest_affordable(batch, guard, sorted(asked), codecs.codec_sensitivity(state, declared),
                                             sigma)
        if not batch:
            stopped_early = refusal
            break
        release_ids = [f"{method}:{run_nonce}:query-{index}" for index in batch]
        replies = transport.query(world.query_images[batch], state, {
            "method": method, "seed": seed, "queries": batch, "release_ids": release_ids, "sigma": float(sigma),
            "teachers": declared, "delta": float(delta)})
        for j, index in enumerate(batch):
            per_query = {}
            for hospital, rows in replies.items():
                rows = np.asarray(rows)
                per_query[hospital] = rows[:, j, :] if rows.ndim == 3 and rows.shape[1] == len(batch) else rows
            try:
                noisy, teachers = aggregate_query(per_query, sigma, compressor, guard, release_ids[j],
                                                  note={"query": int(index)}, rejected=rejected, state=state,
                                                  noise=noise, expected_rows=asked)
            except BudgetExceeded as exc:
                stopped_early = str(exc)
                break
            if noisy is None:
                unreleased.append(index)
            if noisy is not None:
                answered.append(index)
                latents.append(noisy)
                teachers_seen.append(teachers)
            if bar is not None:
                bar.update(1)
        if stopped_early:
            break
    if bar is not None:
        bar.close()
    if stopped_early:
        log.warning("query phase stopped early after %d queries: %s", len(answered), stopped_early)

    # (d) pseudo-labels and the student
    pseudo = compressor.decode(np.stack(latents)) if latents else np.zeros((0, world.classes, *world.grid),
                                                                             np.float32)
    targets = pseudo if soft_labels else pseudo.argmax(axis=1)
    public_init = {k: v.clone() for k, v in public_model.state_dict().items()}
    student = train_student(world, targets, answered, preset, seed=seed, init=public_init,
                            include_reference=include_reference, progress=progress)
    public_only = train_public_model(world, preset, seed=seed, epochs=preset.student_epochs, init=public_init,
                                     progress=progress, checkpoint=shared / "public-only.pt" if shared else None)

    # (e) evaluation
    student_dice, student_per_case = _dice(student, world.test_images, world.test_labels)
    public_dice, public_per_case = _dice(public_only, world.test_images, world.test_labels)
    student_validation = public_validation_dice(student, world)
    evaluation = transport.evaluate({"seed": seed}, test={"images": world.test_images,
                                                          "labels": world.test_labels}) if diagnostics else {}
    teacher_scores = [d for m in evaluation.values() for d in (m.get("teacher_dice") or []) if d is not None]
    teacher_dice_mean = float(np.mean(teacher_scores)) if teacher_scores else None
    ensemble_dice, ensemble_vote_dice, pseudo_dice = None, None, None
    if diagnostics:
        clean = transport.query(world.test_images, state, {"method": method, "diagnostic": True})
        rows = [np.asarray(r, np.float64) for r in clean.values() if np.asarray(r).ndim == 3]
        if rows:
            mean_latent = np.concatenate(rows, axis=0).mean(axis=0)
            ensemble_dice = _label_dice(compressor.decode(mean_latent), world.test_labels)
        if hasattr(transport, "ensemble_probabilities"):
            ensemble_vote_dice = _label_dice(transport.ensemble_probabilities(world.test_images), world.test_labels)
        if world.query_labels is not None and answered:
            pseudo_dice = _label_dice(pseudo, world.query_labels[answered])

    # (f) results, model bundle, predictions
    spent = [ledger.spent(owner, delta) for owner in ledger.owners()]
    epsilon_spent = float(max(s.epsilon for s in spent)) if spent else 0.0
    accountant = spent[0].accountant if spent else "gdp-exact"
    results: dict[str, Any] = {
        "method": method,
        "dice": student_dice, "dice_per_case": student_per_case,
        "epsilon": epsilon_spent, "epsilon_budget": float(epsilon), "delta": float(delta),
        "relation": "replace-one", "accountant": accountant,
        "teachers": teachers_planned, "hospitals": len(planned), "queries": len(answered), "sigma": float(sigma),
        "teacher_dice_mean": teacher_dice_mean,
        "ensemble_dice_mean": None if ensemble_dice is None else ensemble_dice.get("mean"),
        "bytes_up_per_query_per_teacher": int(compressor.bytes_per_query_per_teacher),
        "wall_seconds": 0.0,
        # with reproducible noise the seed would let anyone regenerate and subtract it: never published
        "seed": None if noise.is_reproducible else int(seed), **noise.describe(),
        # --- extras ---
        "preset": preset.name, "grid": list(world.grid), "calibration": calibration,
        "queries_planned": queries, "sensitivity": float(sensitivity),
        "noise_per_sensitivity": float(noise_per_sensitivity),
        "teachers_per_query": {"min": int(min(teachers_seen)) if teachers_seen else None,
                               "max": int(max(teachers_seen)) if teachers_seen else None},
        "compressor": compressor.describe(), "components": int(compressor.latent_dim),
        "ae_collapsed": None if collapse is None else collapse["collapsed"], "ae_collapse": collapse,
        "public_only_dice": public_dice, "public_only_dice_mean": public_dice.get("mean"),
        "public_only_dice_per_case": public_per_case,
        "ensemble_dice": ensemble_dice,
        "ensemble_vote_dice_mean": None if ensemble_vote_dice is None else ensemble_vote_dice.get("mean"),
        "pseudo_label_dice_mean": None if pseudo_dice is None else pseudo_dice.get("mean"),
        "teacher_dice_per_hospital": {h: m.get("teacher_dice_mean") for h, m in evaluation.items()},
        "local_epsilon": {h: m.get("local_epsilon") for h, m in train_metrics.items()},
        "soft_labels": bool(soft_labels), "student_includes_reference": bool(include_reference),
        "stopped_early": stopped_early,
        # counts only: a rejection's reason can carry numbers computed from private data (norms)
        "rejected_replies": {h: len(reasons) for h, reasons in rejected.items()},
        "unreleased_queries": len(unreleased),
        "fallback_teachers": _fallback_counts(transport),
        # public validation Dice: what model selection may look at (never the test set)
        "validation_dice_mean": student_validation,
        "ledger_owners": ledger.owners(),
        "not_private_diagnostics": ["teacher_dice_mean", "ensemble_dice_mean", "ensemble_dice",
                                    "ensemble_vote_dice_mean", "pseudo_label_dice_mean",
                                    "teacher_dice_per_hospital"] if diagnostics else [],
        "privacy_statement": (f"({epsilon_spent:.4g}, {delta:g})-DP per patient, replace-one adjacency, "
                              f"{accountant} accountant over {len(answered)} Gaussian queries (sigma={sigma:.4g}); "
                              "covers the pseudo-labels and the student"),
    }
    _save_outputs(out, student, world, preset, results)
    results["wall_seconds"] = float(time.perf_counter() - started)
    atomic_write_json(out / "results.json", results)
    return results


def _largest_affordable(batch: list, guard, owners: list, sensitivity: float, sigma: float) -> tuple[list, str | None]:
    """The longest prefix of ``batch`` whose queries all fit every owner's budget (and, when none fits,
    the guard's reason); nothing is recorded."""
    from privacy.errors import BudgetExceeded
    from privacy.events import GaussianEvent

    refusal = None
    for size in range(len(batch), 0, -1):
        try:
            guard.check(owners, GaussianEvent(sensitivity=sensitivity, sigma=sigma, count=size))
            return batch[:size], None
        except BudgetExceeded as exc:
            refusal = refusal or str(exc)
    return [], refusal


def _fallback_counts(transport) -> dict[str, int]:
    """How many teacher answers each hospital replaced by its fixed fallback row (counts only)."""
    totals: dict[str, int] = {}
    for round_notes in getattr(transport, "notes", []):
        for hospital, notes in round_notes.items():
            totals[hospital] = totals.get(hospital, 0) + int(notes.get("fallback_teachers", 0) or 0)
    return totals


def _save_outputs(out: Path, student, world, preset, results: dict) -> None:
    """Model bundle (sim.bundle) and predicted test segmentations as NIfTI."""
    from sim.training import predict_probs

    from sim.bundle import preprocessing_of, privacy_card, save_bundle
    from sim.networks import network_config

    card = privacy_card(method=results["method"], ledger_path=out / "ledger.jsonl", delta=results["delta"],
                        epsilon_budget=results["epsilon_budget"], relation="replace-one",
                        accountant=results["accountant"], teachers=results["teachers"],
                        hospitals=results["hospitals"], data_source=world.source, queries=results["queries"])
    save_bundle(out, student, network_config(preset.unet), preprocessing_of(world), card)
    labels = predict_probs(student, world.test_images).argmax(axis=1).astype(np.uint8)
    results["predictions"] = _write_predictions(out / "predictions", labels, world)


def _write_predictions(folder: Path, labels: np.ndarray, world) -> dict:
    import io

    import nibabel as nib

    from sim.io import atomic_write_bytes

    from sim.data.preprocess import invert_label

    note = "each scan's own grid (sim.data.preprocess.invert_label)"
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
        atomic_write_bytes(folder / f"{case_id}.nii.gz", _gzip(buffer.getvalue()))
    return {"folder": str(folder), "cases": len(labels), "grid": note}


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, compresslevel=6, mtime=0)
