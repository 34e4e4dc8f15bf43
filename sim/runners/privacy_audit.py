"""Empirical privacy audit of fedpate's two private mechanisms (docs/PRIVACY_AUDIT.md).

The product harness: it drives the server's aggregation (``server.*``) and the DP-SGD engine, so it lives
with the orchestration in ``sim/runners/`` (``sim`` core never imports ``server``); the framework-free
statistics are :mod:`privacy.audit`. Used by ``benchmarks/audit_privacy.py`` and
``tests/test_privacy_audit.py``.

An audit that does not trust our own maths: run the product's mechanism many times on two worst-case
neighbouring inputs D and D', score every run with the optimal (likelihood-ratio) statistic of an
adversary who knows everything except which of the two inputs was used, and turn the test's error rates
into a lower bound on ε (:func:`privacy.audit.epsilon_lower_bound`: Clopper-Pearson bounds, threshold
chosen on held-out runs). The many-runs method of Jagielski, Ullman & Oprea (NeurIPS 2020) and Nasr,
Song, Thakurta, Papernot & Carlini (IEEE S&P 2021), with their strongest adversaries: a worst-case input
for PATE, a "dirac" gradient canary seen in every intermediate model for DP-SGD (Nasr et al.'s
white-box gradient-canary threat model, the one DP-SGD's accounting covers). Steinke, Nasr & Jagielski
(NeurIPS 2023) audit from a single run with many canaries, which matters when one training run is
expensive; their bound is looser than the many-runs one, and here a run costs milliseconds, so the
many-runs method is used.

**PATE aggregator** (Fay et al., Alg. 1-2): the anchored residual codec the demo runs
(``pate-anchored``: :class:`task.codecs.AnchoredResidualCompressor` built by ``make_compressor`` with
the product's defaults, shells (-2, 5), C = 2.5 x the public model's median residual, fitted as
``plan_release`` fits it, on synthetic public reference maps and a "public model's" probabilities on them,
:func:`public_lesion_maps`), or a PCA codec in clip mode (:class:`task.codecs.PCACompressor`),
calibrated as ``server.pate.plan_release`` does (:func:`pate_calibration`: the codec state verified with the server's policy, S = ``task.codecs.
codec_sensitivity(state, K)`` -- the one function the server's calibration, its charge and every
hospital's own charge use -- and σ from :func:`privacy.calibration.pate_sigma` for the N-query
composition). K teachers over several hospitals, each hospital a real :class:`clients.hospital.Hospital`
answering the N queries through ``answer_query`` (it verifies the codec and the request, bounds the
declared K by its ``max_teachers``, charges its own ledger with the S it computes itself under ids with a
nonce it mints, then encodes its teachers' maps); the other K-1 teachers answer random probability maps
(anchored: around the public anchor), and the audited teacher answers the replace-one pair: a map the
codec clips to ``+C u`` in D and to ``-C u`` in D' (``||u|| = 1``), the two ends of the bound behind
S = 2C/K. For the anchored codec the query batch ships the public anchor p_n of every scan (the public
model's prediction, :func:`task.codecs.with_anchor`) and the pair is ``p_n ± t B_n^T u`` (t = 10C,
:func:`anchored_lift`): B_n -- per tumour class, the residual summed over each shell around p_n's lesion,
orthonormal rows -- maps it to ``±t u``, which the clip makes ``±C u``; the anchors are drawn so that every
shell is non-empty on every query, so u may use all l = 24 coordinates. The anchored encoder, like PCA's
clip mode, takes any finite map (its bound comes from the clip), so the pair is a valid input. Every query
goes through :func:`server.aggregation.aggregate_query` as ``server.pate`` calls it, with the server's
verified state and the declared ``expected_rows`` (validation,
``BudgetGuard.charge`` on a fresh :class:`privacy.ledger.Ledger` -- accountant verdicts memoised,
:func:`make_guard` -- then noise from the release's own :class:`privacy.mechanisms.NoiseSource` stream);
the claimed ε is what the server's ledger says after the N charges, which must equal the audited
hospital's own ledger. The adversary knows u and the other teachers' rows, so its optimal statistic is
the sum over queries of ``<release_n - others_n/K, u>`` (the log-likelihood ratio of the two Gaussians is
linear in it).

**DP-SGD** through the product's training loop, :func:`task.learning.training.train_segmentation` with a
:class:`task.learning.dpsgd.DPConfig` (its :class:`task.learning.dpsgd.DPSession`: Opacus per-sample clipping, Poisson batches
and noise from the stream the session opens after charging each epoch, noise-only steps for empty
batches, σ calibrated by the session in ``target`` mode; :func:`dpsgd_train`). The canary needs two of
``TrainConfig``'s optional hooks: ``loss_fn`` (the model's output is the per-sample loss; the targets are
the records' indices, so the loss also sees whether the watched record is in the batch) and
``optimizer_factory`` (SGD with learning rate 1 that records every step's parameter change: Opacus' DP
optimizer calls it once per step). The model is a tiny linear one with two parameter tensors (so
per-layer clipping is exercised, C_total = C sqrt 2) and a loss linear in the parameters, so every
record's gradient is constant. The other records'
gradients all point along one coordinate; the canary's gradient is large along another coordinate in
both tensors, which nobody else uses, so after clipping it contributes exactly C_total in a direction
where the only other thing is the noise. Both relations the product can claim (``DPConfig.relation``):

* ``"replace-one"`` (the default, what comparisons report): D = others + canary, D' = others + a record
  whose gradient points the opposite way (clipped: ``-C_total`` along the canary's direction). The clipped
  sums differ by 2C_total, the most a replacement can move them, and the per-step pair is exactly the one
  dp_accounting's PLD analyses under ``REPLACE_ONE`` (``q N(C) + (1-q) N(0)`` against ``q N(-C) + (1-q)
  N(0)``), so a perfect test converges to the claimed ε. Same size, same steps.
* ``"add-remove"`` (standalone runs): D = others + canary, D' = others (sizes chosen with the same number of
  steps, so the same q).

SGD with learning rate 1 makes every step's parameter change the noisy clipped sum / expected batch size:
the adversary reads each step's projection ``x_t ~ c b_t + σ ξ`` (b_t = the last record in the Poisson
batch; c = +1 on D, -1 on D' under replace-one, 0 on D' under add-remove; ξ standard normal) and scores
the run by the exact log-likelihood ratio ``Σ_t log(1 - q + q exp((2 x_t - 1)/(2σ²)))``, minus the same
with ``-x_t`` under replace-one.

Vectorised trials: both mechanisms reduce, for the adversary, to draws that numpy can make by the
million. :func:`pate_vectorised_scores` draws the full l-dimensional releases ``clean mean + σ Z`` (the
formula of ``aggregate_query`` with the clean means the product computed), :func:`dpsgd_vectorised_scores`
the per-step projections. ``tests/test_privacy_audit.py`` checks that they match the product paths
(exactly, for the PATE releases and the DP-SGD steps replayed from the same streams; in distribution, by
two-sample tests on the scores, for both).

Broken controls (to show the audit can fail): PATE with ``codec_sensitivity`` understated 4x (or 16x),
patched for the broken run only (:func:`understated_codec_sensitivity`): σ that much too small while
the server's and every hospital's ledger claim the budget. (A compressor that misreports its sensitivity,
the earlier control, no longer reaches the mechanism: S comes from the codec state.) DP-SGD with a
session whose optimizer adds a quarter of the noise the ledger charged, or does not clip per-sample
gradients, swapped in for ``DPSession`` inside ``train_segmentation`` for the broken run only
(:func:`broken_dpsgd_session`).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy as np
import torch

from clients.hospital import Hospital, HospitalSettings
from privacy.accountants import epsilon_spent, gdp_epsilon
from privacy.audit import AuditBound, epsilon_lower_bound, largest_resolvable
from privacy.calibration import pate_sigma
from privacy.errors import BudgetExceeded
from privacy.events import SampledGaussianEvent
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from server.aggregation import QueryRelease, aggregate_query, validate_reply
from server.pate import SERVER_POLICY
from task.learning.compute import Compute
from task import codecs
from task.learning import dpsgd, training
from task.codecs import PCACompressor, make_compressor
from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining, steps_per_epoch
from task.settings.presets import get_preset
from task.options import PcaMode, Relation, Sampling, look_up_option
from task.wire.requests import QueryRequest

# ======================================================================================== accounting

_VERDICTS: dict = {}
_SPENT: dict = {}
_ACCOUNTED: dict = {}


def _events_json(events) -> str:

    return json.dumps([e.to_dict() for e in events], sort_keys=True)


def _events_key(ledger, owners, extra=None) -> str:

    return json.dumps([[owner, [e.to_dict() for e in ledger.events(owner)]] for owner in owners]
                      + ([extra.to_dict()] if extra is not None else []), sort_keys=True)


def _memoised(key, compute):
    """``compute()`` once per key; its result or its exception (re-raised) is remembered."""
    if key not in _ACCOUNTED:
        try:
            _ACCOUNTED[key] = (True, compute())
        except Exception as exc:  # noqa: BLE001 - remembered and re-raised as the product raised it
            _ACCOUNTED[key] = (False, exc)
    ok, value = _ACCOUNTED[key]
    if not ok:
        raise value
    return value


def _memoised_ledger():
    """A fresh in-memory :class:`privacy.ledger.Ledger` whose ``spent`` is memoised on the events it composes."""

    class MemoisedLedger(Ledger):
        def spent(self, owner, delta, relation=None, accountant=None, extra=()):
            events = self.events(owner, relation) + list(extra)
            key = ("spent", owner, float(delta), relation, accountant, len(extra), _events_json(events))
            return _memoised(key, lambda: super(MemoisedLedger, self).spent(owner, delta, relation, accountant, extra))

    return MemoisedLedger(None)


def make_guard(epsilon: float, delta: float):
    """A fresh in-memory ``Ledger`` and ``BudgetGuard`` whose accountant verdicts are memoised.

    Every audit run charges the *same* sequence of events (the mechanism's randomness does not enter the
    accounting), and a PLD composition of a DP-SGD epoch costs seconds, so ``check`` caches the real
    ``BudgetGuard.check`` verdict per (budget, δ, owners' ledger events, new event) and the ledger caches
    ``spent`` per (owner, δ, events): the first run computes them, later runs reuse them. Recording,
    release ids and the charge-before-noise order are the product's own; :func:`ledger_epsilon` memoises
    ``ledger.spent`` the same way, :func:`memoised_accounting` the session's comparison figures.
    """

    class MemoisedGuard(BudgetGuard):
        def check(self, owners, event, count: int = 1) -> None:
            key = (repr(sorted(self.budget.items())), self.delta, int(count),
                   _events_key(self.ledger, list(owners), event))
            if key not in _VERDICTS:   # the refusal, or None when the check passed
                try:
                    super().check(owners, event, count)
                    _VERDICTS[key] = None
                except BudgetExceeded as exc:
                    _VERDICTS[key] = exc
            if _VERDICTS[key] is not None:
                raise _VERDICTS[key]

    return MemoisedGuard(_memoised_ledger(), epsilon, delta)


def ledger_epsilon(ledger, owner: str, delta: float) -> float:
    """``ledger.spent(owner, delta).epsilon``, memoised on the owner's events (see :func:`make_guard`)."""
    key = (owner, delta, _events_key(ledger, [owner]))
    if key not in _SPENT:
        _SPENT[key] = float(ledger.spent(owner, delta).epsilon)
    return _SPENT[key]


@contextmanager
def memoised_accounting():
    """While open, the comparison figures ``DPSession.spent`` adds at the end of a run (the same events'
    ε under the other relation, and RDP) are memoised per (events, δ, ...), like the guard's verdicts:
    they do not depend on the run's randomness, and each is a PLD / RDP composition."""

    real_per_relation, real_spent = dpsgd.memoised_per_relation, dpsgd.memoised_epsilon_spent

    def per_relation(events, delta, relation, epsilon):
        key = ("per-relation", _events_json(events), float(delta), relation, epsilon)
        return dict(_memoised(key, lambda: real_per_relation(events, delta, relation, epsilon)))

    def spent(events, delta, **options):
        key = ("epsilon_spent", _events_json(events), float(delta), repr(sorted(options.items())))
        return _memoised(key, lambda: real_spent(events, delta, **options))

    with mock.patch.object(dpsgd, "memoised_per_relation", per_relation), \
            mock.patch.object(dpsgd, "memoised_epsilon_spent", spent):
        yield

# ================================================================================================ PATE

def misreporting_compressor(compressor, factor: float = 4.0):
    """A copy of a fitted compressor whose ``sensitivity()`` reports ``1/factor`` of the truth (its codec
    still clips rows to C). The product no longer reads ``compressor.sensitivity``: the sensitivity comes
    from the shipped codec state (``task.codecs.codec_sensitivity``), so this bug is caught by construction
    (``tests/test_privacy_audit.py``), and the broken PATE control is :func:`understated_codec_sensitivity`."""
    honest = type(compressor)

    class Misreporting(honest):
        def sensitivity(self, teachers: int) -> float:   # the bug: S / factor
            return super().sensitivity(teachers) / factor

    broken = Misreporting.__new__(Misreporting)
    broken.__dict__.update(compressor.__dict__)
    return broken


@contextmanager
def understated_codec_sensitivity(factor: float | None):
    """Broken control: while open, ``task.codecs.codec_sensitivity`` returns ``1/factor`` of the truth.

    That function is the one source of PATE's sensitivity -- the server's calibration (``run_pate``), its
    charge in ``aggregate_query`` and every hospital's charge to its own ledger -- so a bug in it is the
    one left that understates S everywhere at once: σ ``factor`` x too small while every ledger says the
    budget holds. ``factor=None``: the unpatched product (a no-op context)."""
    if factor is None:
        yield
        return

    true = codecs.codec_sensitivity

    def understated(state, teachers):
        return true(state, teachers) / factor

    with mock.patch.object(codecs, "codec_sensitivity", understated):
        yield


def pate_calibration(compressor, epsilon: float, delta: float, queries: int, teachers: int):
    """The server's calibration, step 3 of ``server.pate`` (``plan_release``): the codec state as shipped,
    verified with the server's policy; S from that state (``codec_sensitivity``), never from the compressor;
    σ from ``pate_sigma`` (exact μ-GDP) for the N queries. Returns (verified state, S, σ)."""

    state = codecs.verify_codec(compressor.state(), SERVER_POLICY)
    sensitivity = float(codecs.codec_sensitivity(state, teachers))
    return state, sensitivity, float(pate_sigma(epsilon, delta, queries, sensitivity))


def audit_hospital(name: str, probs, workdir, lifetime_epsilon: float, delta: float, teachers: int | None = None,
                   max_teachers: int | None = None):
    """A real ``clients.hospital.Hospital`` whose teacher k answers the maps ``probs[k]`` or ``probs(k)``, the
    first ``len(scans)`` of them.

    Args:
        name: the hospital's id (also its ledger owner).
        probs: an array (T, N, C, *grid) of every teacher's maps, or a function k -> teacher k's (N, C, *grid).
        workdir: the hospital's folder (its own privacy ledger, its answer book).
        lifetime_epsilon / delta: its lifetime budget, which its own ledger enforces.
        teachers: T when ``probs`` is a function (None = ``len(probs)``).
        max_teachers: its node config's bound on the K a server may declare (None = no bound).
    """

    answer = probs if callable(probs) else (lambda k: probs[k])
    count = int(teachers) if teachers is not None else len(probs)

    class AuditHospital(Hospital):
        def load_teachers(self, config=None) -> None:   # the teachers are the given maps: nothing to load
            pass

        def teacher_probs(self, k: int, scans: np.ndarray, config=None) -> np.ndarray:
            return answer(k)[: len(scans)]

    return AuditHospital(name, prepared=None, partitions=[[f"{name}/teacher-{k}"] for k in range(count)],
                         preset=get_preset("tiny"), workdir=workdir,
                         settings=HospitalSettings(lifetime_epsilon=lifetime_epsilon, delta=delta,
                                                   max_teachers=max_teachers))


def public_lesion_maps(rng: np.random.Generator, n: int, grid=(16, 16, 16), classes: int = 4, shells=None):
    """Synthetic public data for the anchored codec: ``n`` label maps (one-hot, (n, C, *grid)) with one
    ball-shaped lesion each (edema outside, necrosis, an enhancing core), and a "public model's"
    probabilities on them (``softmax(4 onehot + N(0, 0.5²))``). With ``shells``, every map's anchor regions
    (:func:`task.codecs.anchor_regions`) are all non-empty (a map is redrawn until they are), so that every
    coordinate of the anchored latent is reachable on every query."""

    grid = tuple(int(g) for g in grid)
    coords = np.indices(grid).reshape(len(grid), -1).T.astype(np.float64)
    count = None if shells is None else codecs.anchored_latent_dim(2, shells)
    onehot, probs = [], []
    for _ in range(n):
        for _attempt in range(100):
            centre = (np.array(grid) - 1) / 2 + rng.uniform(-1.0, 1.0, len(grid))
            radius = rng.uniform(4.5, 5.5)
            d = np.linalg.norm(coords - centre, axis=1)
            labels = np.where(d < radius, 2, 0)
            labels = np.where(d < 0.7 * radius, 1, labels)
            labels = np.where(d < 0.4 * radius, 3, labels)
            one = codecs.one_hot(labels.reshape(1, *grid), classes)
            logits = 4.0 * one + rng.normal(0.0, 0.5, one.shape)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
            if count is None:
                break
            regions = codecs.anchor_regions(p, shells)[0]
            if np.all(np.bincount(regions[regions >= 0].ravel(), minlength=count) > 0):
                break
        else:
            raise ValueError(f"grid {grid} too small for anchored shells {shells}: a region stays empty")
        onehot.append(one[0])
        probs.append(p[0])
    return np.stack(onehot), np.stack(probs)


def anchored_lift(direction: np.ndarray, anchor: np.ndarray, shells, regions: np.ndarray | None = None) -> np.ndarray:
    """``B_n^T u`` for every query n: the residual map (N, C, *grid) whose anchored latent (before the clip)
    is exactly ``u`` on every query (the rows of B_n are orthonormal; every region must be non-empty).
    ``regions``: the batch's regions when its shells are split into intensity bins
    (:func:`task.codecs.binned_regions`); None = the shells alone."""

    anchor = np.asarray(anchor)
    classes = anchor.shape[1]
    per_class = np.asarray(direction, np.float64).reshape(classes - 1, -1)
    count = per_class.shape[1]
    regions = codecs.anchor_regions(anchor, shells) if regions is None else np.asarray(regions)
    out = np.zeros(anchor.shape, np.float64)
    for n in range(len(anchor)):
        index = regions[n].reshape(-1)
        inside = index >= 0
        size = np.bincount(index[inside], minlength=count)
        if np.any(size == 0):
            raise ValueError(f"query {n}: an anchored region is empty, so u is not reachable there")
        flat = out[n].reshape(classes, -1)
        flat[1:, inside] = per_class[:, index[inside]] / np.sqrt(size[index[inside]])
    return out


@dataclass
class PateSetup:
    """Everything a PATE audit run needs; built by :func:`pate_setup`."""

    epsilon: float
    delta: float
    teachers: int
    hospitals: int
    queries: int
    clip: float                           # C: the codec's row clip (anchored: fitted on public data)
    compressor: object
    state: dict                           # the codec state as verified by the server (and the hospitals)
    sigma: float                          # calibrated by pate_calibration (under the bug, for a broken setup)
    sensitivity: float                    # the true S of the shipped codec: codec_sensitivity(state, K), 2C/K
    charged_sensitivity: float            # what calibration and every ledger used (S/factor when broken)
    direction: np.ndarray                 # u, unit norm (l,)
    answers: dict                         # side (+1/-1) -> hospital -> (T_h, N, l) its answer_query rows
    expected_rows: dict                   # hospital -> teachers: the K the server declares (aggregate_query)
    hospital_epsilon: dict                # hospital -> ε its own ledger records for the N queries
    audited_hospital: str
    codec: str = "anchored"               # "anchored" (pate-anchored) or "pca" (clip mode)
    anchors: np.ndarray | None = None     # anchored: the public anchor of every query (N, C, *grid)
    clean_means: dict = field(default_factory=dict)   # side (+1/-1) -> (N, l) what aggregate_query averages
    broken_factor: float | None = None   # broken control: codec_sensitivity understated by this factor

    @property
    def broken(self) -> bool:
        return self.broken_factor is not None

    @property
    def latent_dim(self) -> int:
        return int(self.compressor.latent_dim)

    @property
    def mu_claimed(self) -> float:
        return math.sqrt(self.queries) * self.charged_sensitivity / self.sigma

    @property
    def mu_true(self) -> float:
        """GDP μ of the worst-case pair actually run: rows ±C u differ by 2C (the true S = 2C/K)."""
        return math.sqrt(self.queries) * (2.0 * self.clip / self.teachers) / self.sigma

    def release_id(self, query: int) -> str:
        """As ``server.pate.run_query_phase`` names a release (``<method>:<run nonce>:query-<n>``)."""
        return f"pate-{self.codec}:audit:query-{query}"

    @staticmethod
    def stream(query: int) -> str:
        """The release's noise stream, named as ``server.pate`` names it (without the run nonce)."""
        return f"query-{query}"

    def replies(self, query: int, side: int) -> dict:
        """The hospitals' replies to one query in D (side=+1) or D' (side=-1)."""
        return {h: rows[:, query, :].copy() for h, rows in self.answers[side].items()}


def _random_probabilities(rng: np.random.Generator, shape, around: np.ndarray | None = None) -> np.ndarray:
    """Random probability maps (n, C, *grid): softmax of N(0, 2²) logits, or around given maps
    (``softmax(log around + N(0, 1.5²))``: teachers that mostly agree with the public model)."""
    base = 0.0 if around is None else np.log(np.clip(around, 1e-6, 1.0))
    logits = base + rng.normal(0.0, 2.0 if around is None else 1.5, size=shape)
    maps = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (maps / maps.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass(frozen=True)
class PateAudit:
    """What a PATE audit audits (:func:`pate_setup`).

    ``epsilon`` / ``delta``: the budget the N queries are calibrated to (and each hospital's lifetime budget);
    ``codec``: ``anchored`` (default) or ``pca`` (:data:`PATE_CODECS`); ``teachers``: K, spread evenly over the
    ``hospitals`` (a multiple of them); ``queries``: N; ``latent_dim`` / ``clip``: l and C of the PCA codec
    (``anchored`` uses the fitted compressor's own l and C); ``grid``: the maps' grid (None = 16³ for ``anchored``,
    4³ for ``pca``); ``seed``: the public data, the other teachers' maps and the direction u (not the noise);
    ``broken_factor``: everything under :func:`understated_codec_sensitivity` (None = the honest product);
    ``intensity_bins``: ``anchored`` only, each shell split into this many intensity bins of the query scans (the
    quick preset's codec: 3; :func:`task.codecs.intensity_bin_map`). The scans are then random public volumes (the
    bins need intensities; the teachers still ignore them), the bin map is shipped with the anchor and verified by
    every hospital, and the audited pair is lifted through the binned regions.
    """

    epsilon: float
    delta: float = 1e-3
    codec: str = "anchored"
    teachers: int = 128
    hospitals: int = 8
    queries: int = 40
    latent_dim: int = 8
    clip: float = 1.0
    grid: tuple | None = None
    seed: int = 0
    broken_factor: float | None = None
    intensity_bins: int = 1

    def __post_init__(self) -> None:
        if self.codec not in AUDITED_CODECS:
            raise ValueError(f"codec: expected one of {PATE_CODECS}, got {self.codec!r}")
        if self.teachers % self.hospitals:
            raise ValueError("teachers must be a multiple of hospitals")


@dataclass
class AuditedPublicSide:
    """The audited codec fitted on public data, and the query batch's public side: its scans and, for the anchored
    codec, the public anchor of every query and the batch's regions."""

    compressor: object
    grid: tuple
    clip: float
    scans: np.ndarray
    anchors: np.ndarray | None = None
    regions: np.ndarray | None = None


def _fit_anchored(rng: np.random.Generator, audit: PateAudit, classes: int) -> AuditedPublicSide:
    """The product's compressor (``make_compressor("pate-anchored")``: its defaults, the bins asked for) fitted on
    synthetic public reference maps and a public model's probabilities on them, as ``plan_release`` fits it."""
    grid = tuple(audit.grid or (16, 16, 16))
    compressor = make_compressor("pate-anchored", intensity_bins=int(audit.intensity_bins))
    binned = int(audit.intensity_bins) > 1   # random draws only then: the bin-free audit stays what it was
    reference = public_lesion_maps(rng, 24, grid, classes)          # public reference maps + public model
    compressor.fit(*reference, rng.normal(size=(24, 4, *grid)).astype(np.float32) if binned else None)
    anchors = public_lesion_maps(rng, audit.queries, grid, classes, compressor.shells)[1]   # on the query scans
    # the public query scans: only the bins read them (the teachers answer fixed maps)
    shape = (audit.queries, 4, *grid)
    scans = (rng.normal(size=shape) if binned else np.zeros(shape)).astype(np.float32)
    regions = codecs.binned_regions(anchors, compressor.shells, scans, compressor.intensity_channel,
                                    int(audit.intensity_bins))[0]
    return AuditedPublicSide(compressor, grid, float(compressor.clip), scans, anchors, regions)


def _fit_pca(rng: np.random.Generator, audit: PateAudit, classes: int) -> AuditedPublicSide:
    """A PCA codec in clip mode (C = ``clip``, l = ``latent_dim``) fitted on random public one-hot maps."""
    grid = tuple(audit.grid or (4, 4, 4))
    public = codecs.one_hot(rng.integers(0, classes, size=(3 * audit.latent_dim, *grid)), classes)
    compressor = PCACompressor(n_components=audit.latent_dim, sensitivity_mode=PcaMode.CLIP, clip=audit.clip).fit(public)
    scans = np.zeros((audit.queries, 4, *grid), np.float32)      # the teachers ignore them (fixed maps)
    return AuditedPublicSide(compressor, grid, float(audit.clip), scans)


def _anchored_pair(public: AuditedPublicSide, direction: np.ndarray, state: dict, classes: int) -> dict:
    """``p_n + side t B_n^T u``: anchored latent ``side t u`` before the clip, ``side C u`` after it."""
    lift = anchored_lift(direction, public.anchors, public.compressor.shells, public.regions)
    return {side: (public.anchors + side * 10.0 * public.clip * lift).astype(np.float32) for side in (+1, -1)}


def _pca_pair(public: AuditedPublicSide, direction: np.ndarray, state: dict, classes: int) -> dict:
    """y with ``A_l (y - mean) = side t u``: clipped to ``side C u`` by the codec."""
    components = np.asarray(state["components"], np.float64)
    mean = np.asarray(state["mean"], np.float64)
    queries = len(public.scans)
    return {side: np.repeat((mean + side * 10.0 * public.clip * (components.T @ direction)).reshape(
        1, classes, *public.grid), queries, axis=0).astype(np.float32) for side in (+1, -1)}


@dataclass(frozen=True)
class AuditedCodec:
    """A codec the PATE audit knows: ``fit(rng, audit, classes) -> AuditedPublicSide`` and ``extreme_pair(public,
    u, verified state, classes) -> {+1: maps, -1: maps}``, the audited teacher's replace-one pair, which the codec
    maps to ``+C u`` and ``-C u``."""

    fit: Callable[..., AuditedPublicSide]
    extreme_pair: Callable[..., dict]


#: the codecs the PATE audit knows: "anchored" (the demo's pate-anchored, the default) and "pca" in clip mode
AUDITED_CODECS = {"anchored": AuditedCodec(_fit_anchored, _anchored_pair), "pca": AuditedCodec(_fit_pca, _pca_pair)}
PATE_CODECS = tuple(AUDITED_CODECS)


def _teacher_answers(audit: PateAudit, public: AuditedPublicSide, extreme: dict, seeds: np.ndarray, classes: int):
    """``answers_of(hospital index, side)`` -> teacher k's maps: random maps (a fixed stream per teacher), the
    extreme pair for the audited teacher (hospital 0's first)."""

    def answers_of(index: int, side: int):
        def answer(k: int) -> np.ndarray:
            if index == 0 and k == 0:
                return extreme[side]
            teacher_rng = np.random.default_rng([int(seeds[index]), k])
            return _random_probabilities(teacher_rng, (audit.queries, classes, *public.grid), public.anchors)
        return answer

    return answers_of


def _hospitals_answer(audit: PateAudit, public: AuditedPublicSide, answers_of, names: list[str]):
    """The server's calibration (:func:`pate_calibration`) and every hospital's answer to the N queries through
    the real ``Hospital.answer_query`` (D: every hospital; D': the audited one, the others' rows are the same),
    each checked to have charged its own ledger once per query. Returns (verified state, charged S, σ, answers,
    hospital -> ε its ledger records)."""
    compressor, per_hospital, audited = public.compressor, audit.teachers // audit.hospitals, names[0]
    answers: dict = {+1: {}, -1: {}}
    hospital_epsilon = {}
    with understated_codec_sensitivity(audit.broken_factor), tempfile.TemporaryDirectory() as tmp:
        state, charged, sigma = pate_calibration(compressor, audit.epsilon, audit.delta, audit.queries,
                                                 audit.teachers)
        shipped = compressor.batch_state(compressor.state(), public.anchors, public.scans)
        request = QueryRequest(method=f"pate-{audit.codec}", queries=list(range(audit.queries)),
                               release_ids=[f"pate-{audit.codec}:audit:query-{n}" for n in range(audit.queries)],
                               sigma=sigma, teachers=audit.teachers, delta=float(audit.delta))
        for side in (+1, -1):
            for index, name in enumerate(names if side == +1 else [audited]):
                hospital = audit_hospital(name, answers_of(index, side), Path(tmp) / f"{name}{side:+d}",
                                          audit.epsilon, audit.delta, teachers=per_hospital,
                                          max_teachers=audit.teachers)
                answers[side][name], _ = hospital.answer_query(public.scans, shipped, request.to_config())
                own = Ledger(hospital.privacy_ledger)
                charged_ids = sorted(r["release_id"].rsplit("@", 1)[0] for r in own.records())
                if charged_ids != sorted(request.release_ids):   # one charge per query, under its own nonce
                    raise RuntimeError(f"hospital {name} charged {charged_ids}, asked {list(request.release_ids)}")
                spent = own.spent(name, audit.delta).epsilon
                hospital_epsilon.setdefault(name, set()).add(float(spent))
        for name in names[1:]:
            answers[-1][name] = answers[+1][name]
    if any(len(v) != 1 for v in hospital_epsilon.values()):
        raise RuntimeError(f"a hospital's ledger recorded different ε for D and D': {hospital_epsilon}")
    return state, charged, sigma, answers, {h: v.pop() for h, v in hospital_epsilon.items()}


def pate_setup(audit: PateAudit) -> PateSetup:
    """A codec fitted on public data, calibrated as the server does (:func:`pate_calibration`), and every
    hospital's answer to the N queries through the real ``Hospital.answer_query`` (codec verified, the N
    releases charged to its own ledger with the S it computes itself, under ids with its own nonce, then
    every teacher's map encoded). The other teachers answer random probability maps; the audited teacher
    (h0's first) answers the replace-one pair, maps the codec clips to ``+C u`` in D and to ``-C u`` in D'
    -- the two ends of the bound behind S = 2C/K.

    ``codec="anchored"`` (the demo's ``pate-anchored``; grid 16³ by default): the product's compressor
    (``make_compressor("pate-anchored")``: shells (-2, 5), C = 2.5 x the public model's median residual on
    public reference maps, fitted as ``plan_release`` fits it) and one public anchor per query (the public
    model's probabilities, shipped with the batch by the compressor's ``batch_state``,
    :func:`task.codecs.with_anchor`); the other teachers answer maps around the anchor, the audited one
    ``p_n ± t B_n^T u`` (t = 10 C; the anchored latent before the clip is ``±t u``). ``codec="pca"`` (grid 4³): a
    PCA codec in clip mode (C = ``clip``, l = ``latent_dim``) fitted on random public one-hot maps; the audited
    teacher answers ``mean ± t A_l^T u``. The steps: the codec's ``fit`` and ``extreme_pair``
    (:data:`AUDITED_CODECS`), :func:`_hospitals_answer`, then the server's validated means (:func:`_clean_means`).
    """
    rng = np.random.default_rng(audit.seed)
    classes = 4
    codec = AUDITED_CODECS[audit.codec]
    public = codec.fit(rng, audit, classes)
    true_state = codecs.verify_codec(public.compressor.state())
    true_sensitivity = float(codecs.codec_sensitivity(true_state, audit.teachers))   # outside any patch
    direction = rng.normal(size=int(public.compressor.latent_dim))
    direction /= np.linalg.norm(direction)
    extreme = codec.extreme_pair(public, direction, true_state, classes)
    seeds = rng.integers(0, 2 ** 63, size=audit.hospitals)
    names = [f"h{i}" for i in range(audit.hospitals)]
    answers_of = _teacher_answers(audit, public, extreme, seeds, classes)
    state, charged, sigma, answers, hospital_epsilon = _hospitals_answer(audit, public, answers_of, names)
    setup = PateSetup(epsilon=float(audit.epsilon), delta=float(audit.delta), teachers=audit.teachers,
                      hospitals=audit.hospitals, queries=audit.queries, clip=float(public.clip),
                      compressor=public.compressor, state=state, sigma=float(sigma), sensitivity=true_sensitivity,
                      charged_sensitivity=float(charged), direction=direction, answers=answers,
                      expected_rows={h: audit.teachers // audit.hospitals for h in names},
                      hospital_epsilon=hospital_epsilon, audited_hospital=names[0], codec=audit.codec,
                      anchors=public.anchors, broken_factor=audit.broken_factor)
    setup.clean_means.update(_clean_means(setup))
    return setup


def _clean_means(setup: PateSetup) -> dict:
    """side (+1/-1) -> (N, l): the server's validated rows, averaged (what aggregate_query adds noise to)."""
    means = {}
    for side in (+1, -1):
        rows_per_query = []
        for n in range(setup.queries):
            rows = [validate_reply(h, r, setup.state, setup.latent_dim) for h, r in sorted(setup.replies(n, side).items())]
            rows_per_query.append(np.concatenate(rows, axis=0).mean(axis=0))
        means[side] = np.stack(rows_per_query)
    return means


def pate_product_run(setup: PateSetup, side: int, noise=None) -> tuple[np.ndarray, float]:
    """One full run of the query phase through ``aggregate_query`` as ``server.pate`` calls it (the codec
    state the server verified, the server declaring every hospital's teachers, ``expected_rows``; the
    release's noise stream named ``query-<n>``) on a fresh server ledger and guard; each release's noise
    from its own stream of ``noise`` (secure when None), opened after the charge. A broken setup runs
    under its bug.

    Returns the N releases (N, l) float32 and the ε the server's ledger says the audited hospital spent.
    """

    guard = make_guard(setup.epsilon, setup.delta)
    releases = []
    with understated_codec_sensitivity(setup.broken_factor):
        for n in range(setup.queries):
            release = QueryRelease(setup.release_id(n), setup.sigma, setup.compressor, state=setup.state,
                                   expected_rows=setup.expected_rows, stream=setup.stream(n), note={"query": n})
            noisy, teachers = aggregate_query(setup.replies(n, side), release, guard, noise)
            if noisy is None or teachers != setup.teachers:
                raise RuntimeError(f"query {n}: {teachers} teachers accepted, expected {setup.teachers}")
            releases.append(noisy)
    claimed = ledger_epsilon(guard.ledger, setup.audited_hospital, setup.delta)
    return np.stack(releases), float(claimed)


def pate_scores(setup: PateSetup, releases: np.ndarray) -> np.ndarray:
    """The adversary's statistic for releases (..., N, l): ``Σ_n <release_n - m_n, u> / (σ sqrt N)``,
    m_n = the midpoint of the two clean means (the others' rows / K). Larger = more like D."""
    middle = 0.5 * (setup.clean_means[+1] + setup.clean_means[-1])
    projected = (np.asarray(releases, dtype=np.float64) - middle) @ setup.direction
    return projected.sum(axis=-1) / (setup.sigma * math.sqrt(setup.queries))


def pate_vectorised_releases(setup: PateSetup, side: int, trials: int, rng: np.random.Generator) -> np.ndarray:
    """``trials`` runs of the N releases at once: clean mean + σ Z, rounded to float32 as the product does."""
    noise = rng.standard_normal((trials, setup.queries, setup.latent_dim))
    return (setup.clean_means[side][None] + setup.sigma * noise).astype(np.float32)


def pate_vectorised_scores(setup: PateSetup, side: int, trials: int, rng: np.random.Generator,
                           chunk: int = 20_000) -> np.ndarray:
    out = []
    for start in range(0, trials, chunk):
        out.append(pate_scores(setup, pate_vectorised_releases(setup, side, min(chunk, trials - start), rng)))
    return np.concatenate(out) if out else np.zeros(0)


# ============================================================================================== DP-SGD


def _canary_model(dim: int):

    class CanaryModel(torch.nn.Module):
        """Two parameter tensors; per-sample loss ``-(a·x + b·x)``, so every gradient is ``-x`` in each."""

        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(dim, 1, bias=False)
            self.b = torch.nn.Linear(dim, 1, bias=False)

        def forward(self, x):
            return -(self.a(x) + self.b(x)).squeeze(-1)     # the per-sample loss itself

    return CanaryModel()


@dataclass
class DPSGDSetup:
    """A DP-SGD audit under one neighbouring relation (``DPConfig.relation``).

    D = others + the canary (``with_canary=True``). D' (``with_canary=False``): under ``"replace-one"`` (the
    product's default) the canary replaced by a record whose gradient points the opposite way, so the two
    clipped gradients differ by 2C_total -- the pair dp_accounting's PLD analyses under ``REPLACE_ONE``
    (``q·N(C) + (1-q)·N(0)`` against ``q·N(-C) + (1-q)·N(0)`` per step); under ``"add-remove"`` the others
    alone (one record fewer).
    """

    epsilon: float
    delta: float
    others: int            # records besides the canary (or its replacement)
    batch_size: int
    epochs: int
    clip: float            # per-layer clip C (each of the two tensors)
    relation: str = Relation.REPLACE_ONE
    dim: int = 4
    scale: float = 100.0   # gradient norms before clipping (>> C: every record is clipped)
    sigma: float = 0.0     # the session's calibrated noise multiplier (filled by dpsgd_setup)
    sampling_rate: float = 0.0
    steps_per_epoch: int = 0
    noise_factor: float = 1.0   # broken control: the optimizer adds noise_factor x the charged noise
    unclipped: bool = False     # broken control: per-sample gradients are not clipped (noise still σ C_total)

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def broken(self) -> bool:
        return self.noise_factor != 1.0 or self.unclipped

    @property
    def signal(self) -> float:
        """The canary's contribution to x_t when it is in the batch (1 when clipped, as accounted)."""
        return self.scale / self.clip if self.unclipped else 1.0

    @property
    def replacement(self) -> float:
        """What D' contributes to x_t when its last record is in the batch: ``-signal`` under replace-one
        (the opposite gradient), 0 under add-remove (no such record)."""
        return -self.signal if self.relation == Relation.REPLACE_ONE else 0.0

    @property
    def bug(self) -> str:
        parts = ([f"noise x{self.noise_factor:g}"] if self.noise_factor != 1.0 else []) + (
            ["no clipping"] if self.unclipped else [])
        return ", ".join(parts)

    @property
    def total_clip(self) -> float:
        """L2 bound of one record's clipped gradient: per-layer clipping at C on the two tensors, C sqrt 2."""
        return self.clip * math.sqrt(2.0)

    def expected_batch_size(self, with_canary: bool) -> int:
        """What Opacus divides the noisy clipped sum by (``loss_reduction="mean"``): ``make_private`` sets it
        to ``int(len(dataset) * sample_rate)`` for the session's index loader (``DPSession.expected_batch_size``)."""
        return int(self.size(with_canary) * self.sampling_rate)

    def size(self, with_canary: bool) -> int:
        return self.others + (1 if with_canary or self.relation == Relation.REPLACE_ONE else 0)

    def data(self, with_canary: bool):

        x = torch.zeros(self.size(with_canary), self.dim)
        x[: self.others, 0] = self.scale        # everyone else: coordinate 0
        if with_canary:
            x[-1, 1] = self.scale               # the canary: coordinate 1, used by nobody else
        elif self.relation == Relation.REPLACE_ONE:
            x[-1, 1] = -self.scale              # its replacement: the same coordinate, the opposite gradient
        return x

    def config(self, release_prefix: str = "audit"):

        return DPConfig(mode="target", epsilon=self.epsilon, delta=self.delta, max_grad_norm=self.clip,
                        per_layer=True, sampling=Sampling.POISSON, relation=self.relation, grad_sample_mode="functorch",
                        release_prefix=release_prefix)

    def perfect_test_limit(self) -> float | None:
        """ε(δ) of the pair actually run (PLD under the relation, noise multiplier ``factor·σ/signal``): what
        a perfect test would approach. Equal to the claim for an honest setup; None without clipping (the
        unclipped pair's noise is 100x smaller than accounted: too costly for the PLD and off any scale)."""
        if self.unclipped:
            return None

        event = SampledGaussianEvent(self.sampling_rate, self.noise_factor * self.sigma / self.signal,
                                     steps=self.steps, relation=self.relation)
        return float(epsilon_spent([event], self.delta)[0])   # the accountant the ledger would choose


class _StepRecorder:
    """What the white-box adversary reads from a ``train_segmentation`` run, through the product's own hooks
    (``TrainConfig.loss_fn`` and ``optimizer_factory``): the parameter change of every optimizer step
    (Opacus' DP optimizer calls the inner optimizer's ``step`` once per step, noise-only steps included) and
    whether the step's batch held the record under audit (its index is the target, so the loss sees it)."""

    def __init__(self, model, watched: int | None) -> None:
        self.params = list(model.parameters())
        self.watched = watched            # the canary's (or its replacement's) index; None: no such record
        self.updates: list = []           # per step: flat parameters before minus after
        self.members: list[bool] = []
        self._member = False

    def _flat(self):

        return torch.cat([p.detach().flatten() for p in self.params]).clone()

    def loss(self, outputs, targets):
        """The canary model's output is the per-sample loss; ``targets`` are the records' indices."""
        self._member = self.watched is not None and bool((targets == self.watched).any())
        return outputs

    def optimizer(self, params):
        """SGD with learning rate 1 (so a step moves the parameters by the noisy clipped sum / the expected
        batch size), recording every step."""

        recorder = self

        class RecordingSGD(torch.optim.SGD):
            def step(self, closure=None):
                before = recorder._flat()
                out = super().step(closure)
                recorder.updates.append(before - recorder._flat())
                recorder.members.append(recorder._member)
                recorder._member = False
                return out

        return RecordingSGD(params, lr=1.0)


def _broken_session(noise_factor: float, unclipped: bool):
    """Broken controls: a DPSession that charges σ to the ledger, then runs the epoch with noise_factor x
    the noise, and/or without per-sample clipping (the per-layer clip bounds lifted to 1e12; the noise
    std stays σ C_total, as the ledger assumes)."""

    class BrokenSession(DPSession):
        def begin_epoch(self, epoch: int) -> bool:
            ok = super().begin_epoch(epoch)
            if ok:
                self.optimizer.noise_multiplier = self.sigmas[-1] * noise_factor
                if unclipped:  # Opacus clips per layer with max_grad_norms; its noise uses max_grad_norm
                    self.optimizer.max_grad_norms = [1e12] * len(self.optimizer.max_grad_norms)
            return ok

    return BrokenSession


@contextmanager
def broken_dpsgd_session(setup: "DPSGDSetup"):
    """While open, ``train_segmentation`` builds the setup's broken session (:func:`_broken_session`) instead
    of ``DPSession`` (patched in ``task.learning.training`` for the broken run only); a no-op for an honest setup."""
    if not setup.broken:
        yield
        return

    with mock.patch.object(training, "DPSession", _broken_session(setup.noise_factor, setup.unclipped)):
        yield


def dpsgd_train(setup: DPSGDSetup, with_canary: bool, noise=None, sigma: float | None = None):
    """One DP-SGD training through the product's ``task.learning.training.train_segmentation`` on D (``with_canary``)
    or D': the canary model from zero, SGD with learning rate 1, no augmentation, the setup's ``DPConfig``
    (Poisson sampling, per-layer clipping, its relation) in ``target`` mode -- the session calibrates σ
    itself -- or, given ``sigma``, in ``fixed`` mode at that σ (calibration is costly; the ledger still
    says what it costs); charged through a fresh memoised guard (:func:`make_guard`) to owner ``h0``.
    Returns (the step recorder, the ``TrainResult``, the guard)."""


    x = setup.data(with_canary)
    model = _canary_model(setup.dim)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    recorder = _StepRecorder(model, len(x) - 1 if with_canary or setup.relation == Relation.REPLACE_ONE else None)
    config = training.TrainConfig(epochs=setup.epochs, batch_size=setup.batch_size, learning_rate=1.0,
                                  augment=False, description="privacy audit",
                                  loss_fn=recorder.loss, optimizer_factory=recorder.optimizer,
                                  # the CPU on every machine: the canary model has a handful of weights, and the
                                  # observations are exact projections that a GPU's TF32 arithmetic would blur
                                  compute=Compute(device="cpu", progress=False))
    dp = setup.config()
    if sigma is not None:
        dp = replace(dp, mode="fixed", noise_multiplier=float(sigma))
    guard = make_guard(setup.epsilon, setup.delta)
    with memoised_accounting(), broken_dpsgd_session(setup):
        result = training.train_segmentation(model, x, np.arange(len(x)), config,
                                             private=PrivateTraining(dp, guard, owners=("h0",), noise=noise))
    return recorder, result, guard


@dataclass(frozen=True)
class DPSGDAudit:
    """What a DP-SGD audit audits (:func:`dpsgd_setup`; the fields of :class:`DPSGDSetup` it starts from).

    ``epsilon`` / ``delta``: the budget σ is calibrated to (``target`` mode); ``others``: records besides the canary
    (or its replacement); ``batch_size``: the expected (Poisson) batch size; ``epochs``; ``clip``: the per-layer clip
    C (each of the canary model's two tensors); ``relation``: ``replace-one`` (default) or ``add-remove``;
    ``noise_factor``: broken control -- the optimizer adds ``noise_factor`` x the charged noise (1 = honest);
    ``unclipped``: broken control -- per-sample gradients are not clipped (the noise is still σ C_total).
    """

    epsilon: float
    delta: float = 1e-3
    others: int = 15
    batch_size: int = 4
    epochs: int = 5
    clip: float = 1.0
    relation: str = Relation.REPLACE_ONE
    noise_factor: float = 1.0
    unclipped: bool = False

    def __post_init__(self) -> None:
        if min(self.others, self.batch_size, self.epochs) < 1:
            raise ValueError(f"others, batch_size and epochs must be positive, got {self.others}, "
                             f"{self.batch_size}, {self.epochs}")
        look_up_option(self.relation, Relation, "relation")


def dpsgd_setup(audit: DPSGDAudit, sigma: float | None = None) -> DPSGDSetup:
    """σ, q and the steps from a first product run (:func:`dpsgd_train` on D): in ``target`` mode under
    the audit's relation (``train_segmentation``'s session calibrates σ itself), or at the given ``sigma`` (the
    session's ``fixed`` mode; None = calibrated). Under add-remove, D and D' must have the same number of steps (so
    the same q): otherwise the step count, which results publish, tells them apart (docs/PRIVACY_AUDIT.md).
    """

    setup = DPSGDSetup(epsilon=float(audit.epsilon), delta=float(audit.delta), others=audit.others,
                       batch_size=audit.batch_size, epochs=audit.epochs, clip=float(audit.clip),
                       relation=audit.relation, noise_factor=float(audit.noise_factor),
                       unclipped=bool(audit.unclipped))
    steps = {steps_per_epoch(setup.size(c), audit.batch_size) for c in (False, True)}
    if len(steps) != 1:
        raise ValueError(f"D and D' give different numbers of steps per epoch {steps} (so different sampling "
                         "rates): choose sizes with the same number of steps")
    result = dpsgd_train(setup, True, NoiseSource(), sigma=sigma)[1]
    if len(set(result.sigmas)) != 1 or result.epochs_completed != audit.epochs:
        raise RuntimeError(f"the calibrating run trained {result.epochs_completed} of {audit.epochs} epochs at "
                           f"σ {sorted(set(result.sigmas))}")
    setup.sigma, setup.sampling_rate, setup.steps_per_epoch = result.sigmas[0], result.sampling_rate, result.steps_per_epoch
    return setup


@dataclass
class DPSGDRun:
    observations: np.ndarray    # (T,) projected, normalised per-step updates x_t
    members: np.ndarray         # (T,) bool: the last record (canary, or its replacement) in step t's batch
    claimed_epsilon: float      # what the run reports (TrainResult.epsilon: the ledger's)


def dpsgd_product_run(setup: DPSGDSetup, with_canary: bool, noise=None) -> DPSGDRun:
    """One DP-SGD training run through ``task.learning.training.train_segmentation`` (:func:`dpsgd_train`: the
    product's loop -- each epoch charged, then Poisson batches and noise from the stream the session opens
    after the charge, a noise-only step for an empty batch, the Opacus step), recording the parameters after
    every step. Each step's update, times the expected batch size Opacus divides by, projected on the
    canary's direction over C_total, is the observation x_t. Raises if the run was not the one planned or
    its ledger's events are not under the setup's relation."""

    recorder, result, guard = dpsgd_train(setup, with_canary, noise, sigma=setup.sigma)
    if result.epochs_completed != setup.epochs or len(recorder.updates) != setup.steps \
            or any(s != setup.sigma for s in result.sigmas):
        raise RuntimeError(f"the run trained {result.epochs_completed} epochs / {len(recorder.updates)} steps at "
                           f"σ {sorted(set(result.sigmas))}, planned {setup.epochs} / {setup.steps} at {setup.sigma}")
    # the canary's clipped gradient is -C e_1 in each tensor: unit direction over both, as one flat vector
    direction = torch.cat([torch.zeros_like(p).flatten().index_fill_(0, torch.tensor([1], device=p.device), -1.0)
                           for p in recorder.params]) / math.sqrt(len(recorder.params))
    scale = setup.expected_batch_size(with_canary) / setup.total_clip
    observations = [float(update @ direction) * scale for update in recorder.updates]
    relations = {leaf.relation for event in guard.ledger.events("h0") for leaf in event.leaves()}
    if relations != {setup.relation} or result.relation != setup.relation:
        raise RuntimeError(f"the ledger accounted {sorted(relations)}, the audit pairs {setup.relation}")
    claimed = ledger_epsilon(guard.ledger, "h0", setup.delta)
    if not math.isclose(result.epsilon, claimed, rel_tol=1e-12):
        raise RuntimeError(f"train_segmentation reports ε={result.epsilon!r}, its ledger {claimed!r}")
    return DPSGDRun(np.array(observations), np.array(recorder.members, dtype=bool), float(result.epsilon))


def dpsgd_scores(setup: DPSGDSetup, observations: np.ndarray) -> np.ndarray:
    """Exact log-likelihood ratio of D over D' for (..., T) per-step observations at the claimed σ:
    ``Σ_t log((1-q) + q e^{(2x-1)/(2σ²)})`` against the others alone (add-remove), minus the same with
    ``-x`` (replace-one: the replacement moves x_t by -1 when sampled)."""
    x = np.asarray(observations, dtype=np.float64)
    q, s2 = setup.sampling_rate, setup.sigma ** 2
    absent = math.log1p(-q) if q < 1.0 else -math.inf

    def mixture(shift):            # log of q N(x; shift, σ²) + (1-q) N(x; 0, σ²), over N(x; 0, σ²)
        return np.logaddexp(absent, math.log(q) + (2.0 * shift * x - 1.0) / (2.0 * s2))

    score = mixture(+1.0)
    if setup.relation == Relation.REPLACE_ONE:
        score = score - mixture(-1.0)
    return score.sum(axis=-1)


def dpsgd_vectorised_observations(setup: DPSGDSetup, with_canary: bool, trials: int,
                                  rng: np.random.Generator) -> np.ndarray:
    """Per-step observations of ``trials`` runs: ``c·b_t + factor·σ ξ_t``, b_t ~ Bernoulli(q), with
    c = ``signal`` on D and ``replacement`` on D' (-signal under replace-one, 0 under add-remove)."""
    member = rng.random((trials, setup.steps)) < setup.sampling_rate
    contribution = setup.signal if with_canary else setup.replacement
    return contribution * member + setup.noise_factor * setup.sigma * rng.standard_normal((trials, setup.steps))


def dpsgd_vectorised_scores(setup: DPSGDSetup, with_canary: bool, trials: int, rng: np.random.Generator,
                            chunk: int = 50_000) -> np.ndarray:
    out = []
    for start in range(0, trials, chunk):
        obs = dpsgd_vectorised_observations(setup, with_canary, min(chunk, trials - start), rng)
        out.append(dpsgd_scores(setup, obs))
    return np.concatenate(out) if out else np.zeros(0)


# ======================================================================================== secure sums


@dataclass(frozen=True)
class SecureAudit:
    """What a secure-sum audit audits (:func:`secure_pate_setup`, :func:`secure_fedavg_setup`): one release -- a
    secure PATE query, or one step of dp-fedavg-secure -- summed by ``hospitals`` hospitals, each adding its own
    share of discrete Gaussian noise.

    ``epsilon`` / ``delta``: the budget the release is calibrated to (the server's own plan); ``per_hospital``:
    teachers (PATE) or patients (dp-fedavg-secure) per hospital; ``seed``: the public data, the other rows and the
    direction u (not the noise); ``broken_factor``: broken control -- every hospital draws its noise share with
    standard deviation ``1/broken_factor`` of what it declared and charged (None = the honest product);
    ``intensity_bins``: PATE's anchored codec, as :class:`PateAudit`."""

    epsilon: float = 1.0
    delta: float = 1e-3
    hospitals: int = 3
    per_hospital: int = 2
    seed: int = 0
    broken_factor: float | None = None
    intensity_bins: int = 1


@dataclass
class SecureSetup:
    """Everything a product run of one secure sum needs (:func:`secure_pate_setup`, :func:`secure_fedavg_setup`).

    The release is ``secure_sum`` over the hospitals' real ``clients.secure.SecureHospital`` parties (masks,
    Shamir shares, unmasking), each contribution the product's: the hospital checks the declaration, charges
    its ledger the event of the shares it counts, then re-clips and conditionally rounds its rows onto the
    declared grid and adds ``sample_discrete_gaussian(local_variance)``. The adversary knows every row but the
    audited one, which is ``+C u`` in D and ``-C u`` in D'; it scores a release by its projection on u, less
    the others' rows, over the declared noise's standard deviation."""

    mechanism: str
    audit: SecureAudit
    parties: dict                 # hospital -> clients.secure.SecureHospital
    threshold: int
    bits: int
    length: int
    declaration: dict             # what every hospital checks (release ids added per run)
    inputs: dict                  # hospital -> what it is sent with the collect-masked stage
    config: dict                  # the run's settings beside each stage (the hospitals' request)
    direction: np.ndarray         # u, unit norm, in the release's integer coordinates
    middle: float                 # <the others' clipped rows / granularity, u>: the midpoint of D and D'
    noise_sd: float               # sqrt(participants x local variance): the declared noise of the sum
    set_side: Callable[[int], None]   # the audited row to +C u (D, +1) or -C u (D', -1)
    audited: str
    planned_epsilon: float        # ε of the plan's event (the server's calibration): what every ledger must say
    patches: Callable = field(default=lambda: _no_patch())

    @property
    def broken(self) -> bool:
        return self.audit.broken_factor is not None


@contextmanager
def _no_patch():
    yield


@contextmanager
def scaled_noise_shares(factor: float | None):
    """Broken control: while open, every hospital's ``privacy.distributed.sample_discrete_gaussian`` draws with
    variance ``v / factor²`` -- a noise share ``factor`` times too small while each hospital declared and
    charged ``v``. ``factor=None``: the unpatched product."""
    if factor is None:
        yield
        return
    from privacy import distributed

    true = distributed.sample_discrete_gaussian

    def scaled(variance, size, generator=None):
        return true(float(variance) / float(factor) ** 2, size, generator)

    with mock.patch.object(distributed, "sample_discrete_gaussian", scaled):
        yield


def _secure_parties(names, hospitals, config):
    from clients.secure import SecureHospital

    return {h: SecureHospital(hospitals[h]) for h in names}


def secure_pate_setup(audit: SecureAudit, workdir) -> SecureSetup:
    """One secure PATE query (``pate-anchored-secure``): the product's anchored compressor fitted on public maps
    as :func:`pate_setup` fits it, one public anchor, ``hospitals x per_hospital`` teachers answering random maps
    around it, the audited one (h0's first) the pair ``p ± t B^T u`` the codec clips to ``±C u``; the plan is
    ``server.pate_secure.plan_secure_queries`` for one query of one batch."""
    from server.pate_secure import SecureQueryShape, plan_secure_queries
    from task.codecs import make_encoder

    rng = np.random.default_rng(audit.seed)
    teachers, classes = audit.hospitals * audit.per_hospital, 4
    pate = PateAudit(audit.epsilon, audit.delta, teachers=teachers, hospitals=audit.hospitals, queries=1,
                     seed=audit.seed, intensity_bins=audit.intensity_bins)
    codec = AUDITED_CODECS["anchored"]
    public = codec.fit(rng, pate, classes)
    true_state = codecs.verify_codec(public.compressor.state())
    direction = rng.normal(size=int(public.compressor.latent_dim))
    direction /= np.linalg.norm(direction)
    extreme = codec.extreme_pair(public, direction, true_state, classes)
    seeds = rng.integers(0, 2 ** 63, size=audit.hospitals)
    names = [f"h{i}" for i in range(audit.hospitals)]
    answers_of = _teacher_answers(pate, public, extreme, seeds, classes)
    side = {"now": +1}
    hospitals = {h: audit_hospital(h, lambda k, i=i: answers_of(i, side["now"])(k), Path(workdir) / h, math.inf,
                                   audit.delta, teachers=audit.per_hospital, max_teachers=teachers)
                 for i, h in enumerate(names)}
    shipped = public.compressor.batch_state(public.compressor.state(), public.anchors, public.scans)
    verified = codecs.verify_codec(shipped, SERVER_POLICY)
    latent = int(public.compressor.latent_dim)
    shape = SecureQueryShape(teachers, audit.hospitals, latent, 1)
    plan = plan_secure_queries("pate-anchored-secure", verified, shape,
                               {"colluders": 0, "dropouts": 0}, audit.epsilon, audit.delta, 1)
    encode = make_encoder(verified, "cpu")
    others = sum(float(encode(answers_of(i, +1)(k))[0] @ direction) for i in range(audit.hospitals)
                 for k in range(audit.per_hospital) if (i, k) != (0, 0))
    label = (f"secure PATE anchored query K={teachers} H={audit.hospitals}"
             + (f" [broken: noise shares sd/{audit.broken_factor:g}]" if audit.broken_factor else ""))
    return SecureSetup(label, audit, _secure_parties(names, hospitals, {}), plan.threshold, plan.bits, latent,
                       dict(plan.declaration),
                       {h: {"scans": public.scans, "codec": shipped, "stream": "audit-query"} for h in names},
                       {"delta": float(audit.delta), "device": "cpu"}, direction,
                       others / plan.grid.granularity, math.sqrt(audit.hospitals * plan.variance),
                       lambda value: side.update(now=int(value)), names[0],
                       float(epsilon_spent([plan.per_query], audit.delta)[0]))


def secure_fedavg_setup(audit: SecureAudit, workdir) -> SecureSetup:
    """One step of ``dp-fedavg-secure``: ``hospitals`` hospitals of ``per_hospital`` patients each join with the
    tiny preset's start model (``server.dpfedavg_secure.head_model``: public weights) and the step is planned
    by ``plan_steps`` (pooled DP-SGD's clip, one step at the audit's budget). The patients' head gradients are
    the audit's rows -- every other patient a random direction well beyond the clip, the audited patient (h0's
    first) ``±100 C u`` -- held where the contributor caches a start model's features, and
    ``task.learning.headgrad.per_sample_head_gradients``, patched for the audit's runs only, returns them (as PATE's
    audit hospitals answer fixed maps): everything after -- per-patient rows, the finite check, the clip, the
    conditional rounding, the charge and the noise share -- is the product's."""
    import torch

    from clients.secure_gradients import contributor_for
    from server.dpfedavg_secure import DpFedAvgSecureConfig, head_model, plan_steps, pooled_dpsgd_setting
    from task.learning import headgrad
    from task.learning.headgrad import clip_rows, head_state
    from task.wire.secagg import CONTRIBUTION_KIND, RELATION

    rng = np.random.default_rng(audit.seed)
    preset = get_preset("tiny")
    names = [f"h{i}" for i in range(audit.hospitals)]
    head = head_model(preset, audit.seed, None)
    setting = pooled_dpsgd_setting(preset)
    plan = plan_steps(DpFedAvgSecureConfig(audit.epsilon, audit.delta, steps=1,
                                           compute=Compute(device="cpu", progress=False)),
                      setting, {h: audit.per_hospital for h in names}, head.dimension)
    clip, scale = plan.grid.clip, 100.0 * plan.grid.clip
    direction = rng.normal(size=head.dimension)
    direction /= np.linalg.norm(direction)
    rows = {h: rng.normal(size=(audit.per_hospital, head.dimension)) for h in names}
    for h in names:
        rows[h] *= scale / np.linalg.norm(rows[h], axis=1, keepdims=True)
    config = {"delta": float(audit.delta), "device": "cpu"}
    hospitals = {h: audit_hospital(h, lambda k: None, Path(workdir) / h, math.inf, audit.delta,
                                   teachers=audit.per_hospital) for h in names}
    parties = _secure_parties(names, hospitals, config)
    contributors, digests = {}, {}
    for h in names:
        joined = parties[h].handle("join", {"kind": CONTRIBUTION_KIND, "relation": RELATION,
                                            "start_weights": head.start}, config)
        contributors[h], digests[h] = contributor_for(hospitals[h]), joined["start_digest"]
    labels = np.zeros(audit.per_hospital, np.int64)

    def set_side(side: int) -> None:
        for h in names:
            held = rows[h].copy()
            if h == names[0]:
                held[0] = side * scale * direction
            contributors[h]._features[digests[h]] = (torch.from_numpy(held), labels)

    set_side(+1)
    others = sum(float(clip_rows(rows[h], clip)[k] @ direction) for h in names
                 for k in range(audit.per_hospital) if (h, k) != (names[0], 0))

    @contextmanager
    def gradients_are_the_rows():
        with mock.patch.object(headgrad, "per_sample_head_gradients",
                               lambda model, features, labels, **_: features.double().cpu().numpy()):
            yield

    weights = head_state(head.model)
    label = (f"dp-fedavg-secure step H={audit.hospitals} n={audit.hospitals * audit.per_hospital} "
             f"d={head.dimension}" + (f" [broken: noise shares sd/{audit.broken_factor:g}]"
                                      if audit.broken_factor else ""))
    return SecureSetup(label, audit, parties, plan.threshold, plan.bits, head.dimension, dict(plan.declaration),
                       {h: {"head": weights, "start_digest": digests[h], "stream": "audit-step"} for h in names},
                       config, direction, others / plan.grid.granularity, math.sqrt(audit.hospitals * plan.per_step
                                                                                      .local_variance),
                       set_side, names[0], float(epsilon_spent([plan.per_step], audit.delta)[0]),
                       gradients_are_the_rows)


def secure_product_run(setup: SecureSetup, side: int, run: int, noise_seed: int | None = None
                       ) -> tuple[float, float]:
    """One release through ``server.secure.secure_sum`` over the hospitals' real parties, the audited row on
    ``side``; each hospital charged to a fresh in-memory ledger (:func:`make_guard`, its lifetime budget's
    place) before it draws. ``noise_seed``: the simulation's reproducible noise (``secure_noise_seed``: every
    hospital's rounding and share seeded from it; None = the OS CSPRNG). Returns (the adversary's score, the ε
    the audited hospital's ledger claims)."""
    from privacy.distributed import centered
    from server.secure import secure_sum

    setup.set_side(side)
    guards = {}
    for name, party in setup.parties.items():
        guards[name] = make_guard(setup.audit.epsilon, setup.audit.delta)
        party.hospital.lifetime_guard = lambda config=None, guard=guards[name]: guard

    config = {**setup.config, **({"secure_noise_seed": int(noise_seed)} if noise_seed is not None else {})}

    def exchange(stage, messages):
        return {h: setup.parties[h].handle(stage, m, config) for h, m in messages.items()}

    with setup.patches(), scaled_noise_shares(setup.audit.broken_factor):
        result = secure_sum(exchange, sorted(setup.parties), setup.threshold, setup.bits, setup.length,
                            {**setup.declaration, "release_ids": [f"audit-{side:+d}-{run}"]}, setup.inputs)
    if result.survivors != sorted(setup.parties):
        raise RuntimeError(f"run {run}: only {result.survivors} in the sum")
    total = centered(result.total, setup.bits).astype(np.float64)
    claimed = ledger_epsilon(guards[setup.audited].ledger, setup.audited, setup.audit.delta)
    return float((total @ setup.direction - setup.middle) / setup.noise_sd), float(claimed)


def secure_product_scores(setup: SecureSetup, trials: int, noise_seed: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray, float]:
    """Scores of ``trials`` product-path releases on D and on D', and the claimed ε -- the audited hospital's
    ledger, which must be the same in every run and equal to the plan's (else RuntimeError). ``noise_seed``:
    reproducible noise, a seed per run drawn from it (None = the OS CSPRNG)."""
    scores, claimed = {+1: [], -1: []}, set()
    for side in (+1, -1):
        for t in range(trials):
            run_seed = (None if noise_seed is None
                        else int(np.random.SeedSequence([int(noise_seed), side + 1, t]).generate_state(1)[0]))
            score, eps = secure_product_run(setup, side, t, run_seed)
            scores[side].append(score)
            claimed.add(eps)
    if len(claimed) != 1 or not math.isclose(next(iter(claimed)), setup.planned_epsilon, rel_tol=1e-9):
        raise RuntimeError(f"the hospitals' ledgers claimed {sorted(claimed)}, the plan {setup.planned_epsilon!r}")
    return np.array(scores[+1]), np.array(scores[-1]), claimed.pop()


def audit_secure(setup: SecureSetup, trials: int, *, seed: int = 0, confidence: float = 0.95,
                 noise_seed: int | None = None) -> list[AuditRow]:
    """Product-path audit of one secure-sum release: ``trials`` releases per side
    (:func:`secure_product_scores`; no vectorised path: the rounding and the exact discrete Gaussian are the
    product's own code, run by run). ``seed``: the bound's held-out split; ``noise_seed``: reproducible noise
    (None = secure)."""
    started = time.perf_counter()
    positive, negative, claimed = secure_product_scores(setup, trials, noise_seed)
    bound = epsilon_lower_bound(positive, negative, setup.audit.delta, confidence, seed=seed)
    return [AuditRow(setup.mechanism, claimed, setup.audit.delta, "product", trials, bound,
                     time.perf_counter() - started, setup.broken, None)]


# ============================================================================================ the audit


@dataclass
class AuditRow:
    mechanism: str
    claimed_epsilon: float
    delta: float
    path: str              # "product" (the product's code, run by run) or "vectorised"
    trials: int            # runs per side (D and D')
    bound: AuditBound
    seconds: float
    broken: bool = False
    limit: float | None = None   # ε a perfect test of this pair would approach (the μ-GDP curve), if known

    @property
    def violated(self) -> bool:
        return self.bound.epsilon_lower > self.claimed_epsilon

    @property
    def resolvable(self) -> float:
        """The largest bound these runs could give (an error-free test): the audit's ceiling."""

        return largest_resolvable(self.bound.runs_positive, self.bound.runs_negative, self.delta,
                                  self.bound.confidence)


def pate_product_scores(setup: PateSetup, trials: int, noise=None) -> tuple[np.ndarray, np.ndarray, float]:
    """Scores of ``trials`` product-path runs on D and on D', and the ledger's claimed ε (the same for all
    runs: the accounting does not depend on the noise). ``noise``: a NoiseSource whose child streams the
    runs use (reproducible in tests), or None for the secure source."""
    scores, claimed = {}, set()
    for side in (+1, -1):
        values = []
        for t in range(trials):
            source = noise.child("audit", side, t) if noise is not None else None
            releases, eps = pate_product_run(setup, side, source)
            values.append(float(pate_scores(setup, releases)))
            claimed.add(eps)
        scores[side] = np.array(values)
    if len(claimed) != 1:
        raise RuntimeError(f"the ledger claimed different ε in different runs: {sorted(claimed)}")
    return scores[+1], scores[-1], claimed.pop()


def dpsgd_product_runs(setup: DPSGDSetup, trials: int, noise=None) -> tuple[list, list, float]:
    """``trials`` product-path runs on D (with the canary) and on D', and the ledger's claimed ε."""
    runs, claimed = {}, set()
    for with_canary in (True, False):
        runs[with_canary] = []
        for t in range(trials):
            source = noise.child("audit", int(with_canary), t) if noise is not None else None
            run = dpsgd_product_run(setup, with_canary, source)
            runs[with_canary].append(run)
            claimed.add(run.claimed_epsilon)
    if len(claimed) != 1:
        raise RuntimeError(f"the ledger claimed different ε in different runs: {sorted(claimed)}")
    return runs[True], runs[False], claimed.pop()


def audit_pate(setup: PateSetup, trials: int, *, vectorised_trials: int = 0, noise=None, seed: int = 0,
               confidence: float = 0.95, label: str | None = None) -> list[AuditRow]:
    """Product-path audit (``trials`` full query phases per side), plus an optional vectorised one.

    The claimed ε is the server ledger's; it must equal what every hospital's own ledger recorded (both
    come from ``codec_sensitivity``), else this raises.

    Args:
        setup: the audited codec, calibration and answers (:func:`pate_setup`).
        trials: product-path runs per side (0 = none; the claimed ε then comes from one run).
        vectorised_trials: vectorised runs per side (0 = none).
        noise: a NoiseSource whose child streams the product runs use (reproducible in tests; None = secure).
        seed: the bound's held-out split (:func:`privacy.audit.epsilon_lower_bound`) and the vectorised draws.
        confidence: the lower bound's confidence level.
        label: the rows' mechanism name (None = codec, K, N and the broken factor).
    """

    label = label or f"PATE {setup.codec} K={setup.teachers} N={setup.queries}" + (
        f" [broken: codec_sensitivity S/{setup.broken_factor:g}]" if setup.broken else "")
    limit = float(gdp_epsilon(setup.mu_true, setup.delta))
    rows = []
    claimed = None
    if trials:
        started = time.perf_counter()
        pos, neg, claimed = pate_product_scores(setup, trials, noise)
        bound = epsilon_lower_bound(pos, neg, setup.delta, confidence, seed=seed)
        rows.append(AuditRow(label, claimed, setup.delta, "product", trials, bound,
                             time.perf_counter() - started, setup.broken, limit))
    if claimed is None:
        claimed = pate_product_run(setup, +1, noise)[1]
    for hospital, own in setup.hospital_epsilon.items():
        if not math.isclose(own, claimed, rel_tol=1e-9):
            raise RuntimeError(f"the server's ledger claims ε={claimed!r}, hospital {hospital}'s own ledger "
                               f"ε={own!r}: the two charges disagree")
    if vectorised_trials:
        started = time.perf_counter()
        rng = np.random.default_rng(seed + 1)
        pos = pate_vectorised_scores(setup, +1, vectorised_trials, rng)
        neg = pate_vectorised_scores(setup, -1, vectorised_trials, rng)
        bound = epsilon_lower_bound(pos, neg, setup.delta, confidence, seed=seed)
        rows.append(AuditRow(label, claimed, setup.delta, "vectorised", vectorised_trials, bound,
                             time.perf_counter() - started, setup.broken, limit))
    return rows


def audit_dpsgd(setup: DPSGDSetup, trials: int, *, vectorised_trials: int = 0, noise=None, seed: int = 0,
                confidence: float = 0.95, label: str | None = None, limit: bool = False) -> list[AuditRow]:
    """Product-path audit (``trials`` DPSession trainings per side), plus an optional vectorised one.

    Args:
        setup: the audited DP-SGD run (:func:`dpsgd_setup`).
        trials: product-path trainings per side (0 = none).
        vectorised_trials: vectorised runs per side (0 = none).
        noise: a NoiseSource whose child streams the product runs use (reproducible in tests; None = secure).
        seed: the bound's held-out split (:func:`privacy.audit.epsilon_lower_bound`) and the vectorised draws.
        confidence: the lower bound's confidence level.
        label: the rows' mechanism name (None = relation, q, T and the bug).
        limit: also compute the pair's perfect-test limit (a PLD composition, seconds).
    """
    label = label or (f"DP-SGD {setup.relation} q={setup.sampling_rate:.3g} T={setup.steps}"
                      + (f" [broken: {setup.bug}]" if setup.broken else ""))
    limit = setup.perfect_test_limit() if limit else None
    rows = []
    claimed = None
    if trials:
        started = time.perf_counter()
        with_runs, without_runs, claimed = dpsgd_product_runs(setup, trials, noise)
        pos = dpsgd_scores(setup, np.stack([r.observations for r in with_runs]))
        neg = dpsgd_scores(setup, np.stack([r.observations for r in without_runs]))
        bound = epsilon_lower_bound(pos, neg, setup.delta, confidence, seed=seed)
        rows.append(AuditRow(label, claimed, setup.delta, "product", trials, bound,
                             time.perf_counter() - started, setup.broken, limit))
    if vectorised_trials:
        started = time.perf_counter()
        if claimed is None:
            claimed = dpsgd_product_run(setup, True, noise).claimed_epsilon
        rng = np.random.default_rng(seed + 2)
        pos = dpsgd_vectorised_scores(setup, True, vectorised_trials, rng)
        neg = dpsgd_vectorised_scores(setup, False, vectorised_trials, rng)
        bound = epsilon_lower_bound(pos, neg, setup.delta, confidence, seed=seed)
        rows.append(AuditRow(label, claimed, setup.delta, "vectorised", vectorised_trials, bound,
                             time.perf_counter() - started, setup.broken, limit))
    return rows


def format_table(rows: list[AuditRow]) -> str:
    """Markdown table: claim, lower bound, its ceiling at this many runs, the perfect-test limit, verdict."""
    header = ("| mechanism | path | runs per side | δ | claimed ε (ledger) | ε lower bound (95%) | "
              "ceiling at these runs | perfect-test limit | verdict | seconds |")
    lines = [header, "|" + "---|" * 10]
    caught = {(r.mechanism, r.claimed_epsilon) for r in rows if r.broken and r.violated}
    for r in rows:
        limit = "—" if r.limit is None else f"{r.limit:.3g}"
        if not r.broken:
            verdict = "VIOLATION (lb > claim)" if r.violated else "ok (lb ≤ claim)"
        elif r.violated:
            verdict = "caught (lb > claim)"
        elif r.resolvable <= r.claimed_epsilon:
            verdict = "not caught (ceiling below claim)"
        else:
            verdict = ("not caught by this row (too few runs)" if (r.mechanism, r.claimed_epsilon) in caught
                       else "NOT caught")
        lines.append(f"| {r.mechanism} | {r.path} | {r.trials:,} | {r.delta:g} | {r.claimed_epsilon:.4g} | "
                     f"{r.bound.epsilon_lower:.3f} | {r.resolvable:.2f} | {limit} | {verdict} | {r.seconds:.0f} |")
    return "\n".join(lines)


def audit_failures(rows: list[AuditRow]) -> list[str]:
    """What would make the audit fail: a real mechanism whose bound exceeds its claim, or a broken
    control that no path caught."""
    problems = [f"{r.mechanism} ({r.path}): lower bound {r.bound.epsilon_lower:.3f} > claimed "
                f"{r.claimed_epsilon:.4g}" for r in rows if not r.broken and r.violated]
    for name in dict.fromkeys(r.mechanism for r in rows if r.broken):
        if not any(r.violated for r in rows if r.mechanism == name):
            problems.append(f"{name}: broken control not caught by any path")
    return problems


__all__ = ["AUDITED_CODECS", "AuditRow", "AuditedCodec", "AuditedPublicSide", "DPSGDAudit", "DPSGDRun", "DPSGDSetup",
           "PATE_CODECS", "PateAudit", "PateSetup", "SecureAudit", "SecureSetup", "anchored_lift", "audit_dpsgd",
           "audit_secure", "scaled_noise_shares", "secure_fedavg_setup", "secure_pate_setup", "secure_product_run",
           "secure_product_scores",
           "audit_failures", "audit_hospital", "audit_pate", "broken_dpsgd_session", "dpsgd_product_run",
           "dpsgd_product_runs", "dpsgd_scores", "dpsgd_setup", "dpsgd_train", "dpsgd_vectorised_observations",
           "dpsgd_vectorised_scores", "format_table", "make_guard", "memoised_accounting", "misreporting_compressor",
           "pate_calibration", "pate_product_run", "pate_product_scores", "pate_scores", "pate_setup",
           "pate_vectorised_releases", "pate_vectorised_scores", "public_lesion_maps", "understated_codec_sensitivity"]
