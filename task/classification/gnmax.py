"""Classic PATE with GNMax (Papernot, Song, Mironov, Raghunathan, Talwar & Erlingsson 2018, "Scalable
Private Learning with PATE"), teachers at the hospitals.

* Teachers: each hospital splits its privacy units (records, or patients on the slice task) into
  ``teachers_per_hospital`` disjoint partitions and trains one non-private classifier per partition;
  K = total teachers. A unit influences one teacher.
* GNMax (their Sec. 4.1): for a public query x, the vote histogram ``n_c(x) = |{k : teacher_k(x) = c}|``;
  the answer is ``argmax_c n_c(x) + N(0, σ²)``. Under replace-one (one unit changes one teacher's vote)
  the histogram moves by −1 in one class and +1 in another: L2 sensitivity √2, so each answer is a
  ``GaussianEvent(sensitivity=√2, sigma=σ)`` (data-independent RDP: ε(λ) = λ/σ², their Prop. 8; here composed
  exactly through privacy/'s accountants — the Gaussian events are μ-GDP with μ = √2/σ).
* Confident-GNMax (their Alg. 1): answer only when ``max_c n_c + N(0, σ1²) ≥ T``; the check has
  sensitivity 1 (the max vote moves by at most 1) → ``GaussianEvent(1, σ1)`` charged for *every* query,
  the answer ``GaussianEvent(√2, σ2)`` only for answered ones (data-independent accounting, no
  smooth-sensitivity analysis).
* σ is calibrated so that the worst case (all N queries answered) spends exactly the budget.
* How many teachers and queries (stated rules, never tuned on the test set; both are defaults that a
  configuration may override):
  - **K**: GNMax's noise is fixed by ε and the number of queries, not by K, while the vote margin it must
    survive grows with K; so take as many teachers as still learn something: each hospital gets one teacher
    per ``RECORDS_PER_TEACHER`` = 10 privacy units (:func:`teachers_per_hospital_for`), K ≈ n / 10 — on
    mnist5k 340 teachers of 10 digits, whose noise-free ensemble stays useful (Papernot et al. 2018 use
    250 teachers on MNIST, a data set 18× larger than mnist5k's private part).
  - **N, the queries**: each answer's σ grows as √N at a fixed ε (the Gaussian answers compose as μ-GDP,
    μ = √(2N)/σ). Ask as many queries as keep a lead of ``MARGIN_FRACTION`` = ¼ of the teachers safe at two
    standard deviations of the difference of two noisy counts, 2·σ·√2 ≤ K/4 (:func:`queries_for`), at least
    one per class and at most the public pool. More queries would give the student more labels, each
    noisier; fewer, fewer labels, each cleaner.
* Confident-GNMax is an option (``GNMaxConfig.confident``), off by default: under this data-independent
  accounting the threshold check is charged for every query, so it only adds noise; its gain in the paper
  comes from data-dependent (smooth-sensitivity) accounting, which this module does not do.
* Student: trained non-privately on the public query records with their noisy labels (answered ones only).
* Randomness (docs/PRIVACY.md, "Noise"): every noisy threshold check and every noisy answer draws from its own stream
  of a ``privacy.mechanisms.NoiseSource`` (secure unless a simulation asks for reproducible noise), named by its
  release id (``<prefix>/q<i>/threshold``, ``<prefix>/q<i>/answer``) and opened after the release is charged. The seed
  only drives the non-private parts (teacher partition and training, student training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privacy.calibration import calibrate
from privacy.events import ComposedEvent, GaussianEvent
from privacy.mechanisms import GaussianMechanism, NoiseSource
from task.classification import PlainTraining, SeedResult, SeedRun, accuracy, predict, train_nonprivate
from task.errors import UserError
from task.options import Relation

VOTE_SENSITIVITY = math.sqrt(2.0)      # replace-one on a vote histogram
THRESHOLD_SENSITIVITY = 1.0            # replace-one on the maximum vote count
#: privacy units per teacher of the default K (module note): K ≈ n / RECORDS_PER_TEACHER
RECORDS_PER_TEACHER = 10
#: the default number of queries keeps a lead of this fraction of the K teachers at two noise std (module note)
MARGIN_FRACTION = 0.25
MARGIN_STDS = 2.0


@dataclass(frozen=True)
class GNMaxConfig:
    teachers_per_hospital: int | None = None   # None = one per RECORDS_PER_TEACHER units (teachers_per_hospital_for)
    queries: int | None = None                 # None = the vote-margin rule (queries_for)
    teacher_hidden: tuple[int, ...] = (64,)
    teacher_epochs: int = 40
    student_hidden: tuple[int, ...] = (128,)
    student_epochs: int = 40
    confident: bool = False
    threshold_fraction: float = 0.6     # T = fraction · K
    threshold_sigma_ratio: float = 2.0  # σ1 = ratio · σ2 (Papernot et al. use σ1 > σ2)
    accountant: str | None = None       # None = the ledger's tightest exact accountant (gdp-exact)

    def __post_init__(self) -> None:
        for name in ("teachers_per_hospital", "queries"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"pate-gnmax: {name} must be at least 1 (or None: the stated rule), got {value}")
        if not (self.threshold_fraction > 0 and self.threshold_sigma_ratio > 0):
            raise UserError(f"pate-gnmax: expected a positive threshold fraction and σ ratio, got "
                            f"{self.threshold_fraction}, {self.threshold_sigma_ratio}")


def teacher_partitions(task, teachers_per_hospital: int, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """Disjoint partitions of each hospital's privacy units (``task.unit_records()``; deterministic): on the
    slice task whole patients are partitioned, so a patient influences exactly one teacher and GNMax's
    replace-one guarantee is per patient. Returns ``(hospital, record indices)`` per teacher."""
    rng = np.random.default_rng(seed + 31)
    units = task.unit_records()
    unit_hospital = task.unit_hospital(units)
    parts = []
    for index, hospital in enumerate(task.hospitals):
        mine = rng.permutation(np.flatnonzero(unit_hospital == index))
        for chosen in np.array_split(mine, teachers_per_hospital):
            if len(chosen):
                parts.append((hospital, np.sort(np.concatenate([units[u] for u in chosen]))))
    return parts


def teachers_per_hospital_for(task, records_per_teacher: int = RECORDS_PER_TEACHER) -> int:
    """The default teachers per hospital: one per ``records_per_teacher`` privacy units of the smallest hospital
    (at least 1), so every teacher holds about ``records_per_teacher`` units and K ≈ n / records_per_teacher.
    A function of the published hospital sizes only."""
    units = task.unit_records()
    per_hospital = np.bincount(task.unit_hospital(units), minlength=len(task.hospitals))
    return max(1, int(per_hospital.min()) // records_per_teacher)


def queries_for(epsilon: float, delta: float, teachers: int, pool: int, classes: int,
                margin_fraction: float = MARGIN_FRACTION, accountant: str = "gdp-exact") -> int:
    """The default number of plain-GNMax queries N (module note): the largest N whose calibrated answer noise σ
    keeps ``MARGIN_STDS`` · σ · √2 ≤ ``margin_fraction`` · K — a lead of that fraction of the teachers then
    survives the noise of the top two counts at two standard deviations — clamped to ``[classes, pool]``.
    Data-independent: a function of (ε, δ, K) and the public pool size only.

    Under μ-GDP composition σ(N) = σ(1)·√N exactly, so N = ⌊(σ_target / σ(1))²⌋.

    Args:
        epsilon / delta: the budget the N answers are calibrated to.
        teachers: K, the number of teachers whose votes are counted.
        pool: the public unlabelled pool's size (the most queries there are).
        classes: the number of classes (the fewest queries asked).
        margin_fraction: the fraction of K whose lead must survive the noise.
        accountant: the accountant the calibration uses.
    """
    sigma_one, _ = calibrate_gnmax(epsilon, delta, 1, False, 1.0, accountant)
    target = margin_fraction * teachers / (MARGIN_STDS * math.sqrt(2.0))
    wanted = int(math.floor((target / sigma_one) ** 2))
    return int(min(pool, max(classes, wanted)))


def vote_histograms(predictions: np.ndarray, classes: int) -> np.ndarray:
    """(K, n) teacher predictions → (n, classes) vote counts."""
    n = predictions.shape[1]
    hist = np.zeros((n, classes), np.float64)
    for row in predictions:
        hist[np.arange(n), row] += 1
    return hist


def calibrate_gnmax(epsilon: float, delta: float, queries: int, confident: bool, ratio: float,
                    accountant: str = "gdp-exact") -> tuple[float, float | None]:
    """σ2 (answer) and σ1 (threshold, or None) so that N queries, all answered, spend ``epsilon``.

    Args:
        epsilon / delta: the budget (ε, δ) of all N queries.
        queries: the number of queries N.
        confident: Confident-GNMax (every query also has a noisy threshold check) or plain GNMax.
        ratio: σ1 / σ2 for Confident-GNMax (ignored otherwise).
        accountant: the accountant of the calibration (default ``gdp-exact``).
    """

    if not confident:
        sigma = calibrate(lambda s: GaussianEvent(VOTE_SENSITIVITY, s, count=queries), epsilon, delta, accountant,
                          1e-3, 1e6)
        return sigma, None
    sigma = calibrate(lambda s: ComposedEvent((GaussianEvent(THRESHOLD_SENSITIVITY, ratio * s, count=queries),
                                               GaussianEvent(VOTE_SENSITIVITY, s, count=queries))),
                      epsilon, delta, accountant, 1e-3, 1e6)
    return sigma, ratio * sigma


def gnmax_answer(histograms: np.ndarray, sigma: float, guard, owners, release_prefix: str, noise,
                 threshold: float | None = None, sigma_threshold: float | None = None) -> np.ndarray:
    """Noisy-argmax labels for each query row (−1 = not answered by Confident-GNMax).

    Every noisy quantity is charged to the ledger (``guard.charge``) before its stream of ``noise`` is opened.

    Args:
        histograms: (n, classes) vote counts, one row per query (:func:`vote_histograms`).
        sigma: σ2, the answer's noise standard deviation.
        guard: the budget guard every noisy quantity is charged through.
        owners: the ledger owners charged for every query.
        release_prefix: the prefix of the release ids (``<prefix>/q<i>/threshold``, ``<prefix>/q<i>/answer``),
            which also name the noise streams.
        noise: the ``privacy.mechanisms.NoiseSource`` of the noise.
        threshold: Confident-GNMax's threshold T on the noisy maximum vote (None = plain GNMax: every query is
            answered).
        sigma_threshold: σ1, the threshold check's noise standard deviation (used only with ``threshold``).
    """

    labels = np.full(len(histograms), -1, np.int64)
    for i, hist in enumerate(histograms):
        if threshold is not None:
            release = f"{release_prefix}/q{i}/threshold"
            guard.charge(owners, GaussianEvent(THRESHOLD_SENSITIVITY, sigma_threshold), release_id=release)
            noisy_max = float(GaussianMechanism(sigma_threshold, noise.generator(release))(np.array([hist.max()]))[0])
            if noisy_max < threshold:
                continue
        release = f"{release_prefix}/q{i}/answer"
        guard.charge(owners, GaussianEvent(VOTE_SENSITIVITY, sigma), release_id=release)
        labels[i] = int(np.argmax(GaussianMechanism(sigma, noise.generator(release))(hist)))
    return labels


#: the teachers' votes of recent runs, keyed by (task, partition, training settings, seed): a grid of budgets
#: on one task trains the same teachers for every ε (they see no noise and are never released), so their votes
#: are computed once per process. Bounded: a few entries.
_VOTES: dict = {}


def teacher_votes(task, parts, cfg: GNMaxConfig, seed: int):
    """Train one non-private teacher per partition and return ``(pool votes (n_query, classes), test votes
    (n_test, classes), per-teacher test accuracies)``. Noise-free and never released (only GNMax's noisy
    argmax of the pool votes is); memoised per process for the same task object and settings."""
    key = (id(task), tuple(len(i) for _, i in parts), tuple(int(i[0]) for _, i in parts if len(i)),
           cfg.teacher_hidden, cfg.teacher_epochs, seed)
    if key in _VOTES and _VOTES[key][0] is task:
        return _VOTES[key][1]
    training = PlainTraining(hidden=cfg.teacher_hidden, epochs=cfg.teacher_epochs, batch_size=32)
    teachers = [train_nonprivate(task.x_private[idx], task.y_private[idx], task.n_classes, training, seed=seed + k)
                for k, (_, idx) in enumerate(parts)]
    pool = vote_histograms(np.stack([predict(t, task.x_query) for t in teachers]), task.n_classes)
    test = vote_histograms(np.stack([predict(t, task.x_test) for t in teachers]), task.n_classes)
    acc = [accuracy(t, task.x_test, task.y_test) for t in teachers]
    if len(_VOTES) >= 4:
        _VOTES.pop(next(iter(_VOTES)))
    _VOTES[key] = (task, (pool, test, acc))
    return pool, test, acc


def train_pate_gnmax(run: SeedRun, cfg: GNMaxConfig | None = None) -> SeedResult:
    """Teachers at the hospitals, GNMax answers to the public queries, a student on the answered ones.

    Args:
        run: the task (the hospitals' records for the teachers, the public query records for the student), the
            budget (ε, δ) the worst case (every query answered) spends, the guard and owners every noisy quantity
            is charged to, ``run.seed`` (the non-private parts only: teacher partition and training, student
            training), the prefix of the release ids (:func:`gnmax_answer`; default ``pate-gnmax``) and
            ``run.progress`` (a summary line: K, σ, answered queries, accuracies). ``run.noise`` draws the answers
            (secure when None).
        cfg: teachers, queries, networks and Confident-GNMax settings (None = :class:`GNMaxConfig`'s defaults).
    """

    cfg = cfg or GNMaxConfig()
    noise = run.noise if run.noise is not None else NoiseSource()
    task, epsilon, delta, seed = run.task, run.epsilon, run.delta, run.seed
    per_hospital = cfg.teachers_per_hospital or teachers_per_hospital_for(task)
    parts = teacher_partitions(task, per_hospital, seed)
    pool_votes, test_votes, teacher_acc = teacher_votes(task, parts, cfg, seed)
    K = len(parts)
    accountant = cfg.accountant or "gdp-exact"
    nq = min(cfg.queries or queries_for(epsilon, delta, K, len(task.x_query), task.n_classes,
                                        accountant=accountant), len(task.x_query))
    xq = task.x_query[:nq]
    hist = pool_votes[:nq]
    ensemble_acc = float((test_votes.argmax(1) == task.y_test).mean())
    sigma, sigma1 = calibrate_gnmax(epsilon, delta, nq, cfg.confident, cfg.threshold_sigma_ratio, accountant)
    threshold = cfg.threshold_fraction * K if cfg.confident else None
    labels = gnmax_answer(hist, sigma, run.guard, run.owners, run.prefix("pate-gnmax"), noise, threshold, sigma1)
    answered = labels >= 0
    label_acc = None
    if task.y_query_true is not None and answered.any():
        label_acc = float((labels[answered] == task.y_query_true[:nq][answered]).mean())
    if answered.sum() >= 2:
        student = train_nonprivate(xq[answered], labels[answered], task.n_classes,
                                   PlainTraining(hidden=cfg.student_hidden, epochs=cfg.student_epochs, batch_size=32),
                                   seed=seed)
        acc = accuracy(student, task.x_test, task.y_test)
    else:
        student, acc = None, float(np.bincount(task.y_test).max() / len(task.y_test))   # majority-class fallback
    if run.progress:
        print(f"  pate-gnmax: K={K} σ={sigma:.2f} answered {int(answered.sum())}/{nq}, label acc {label_acc}, "
              f"student acc {acc:.3f}", flush=True)
    return SeedResult(
        method="pate-gnmax", accuracy=acc, epsilon_budget=epsilon, delta=delta, relation=Relation.REPLACE_ONE,
        sigma=sigma,
        teachers=K, queries=nq, bytes_up_per_query_per_teacher=4,   # one int32 vote
        details={"teacher_accuracy_mean": float(np.mean(teacher_acc)), "ensemble_accuracy": ensemble_acc,
                 "answered": int(answered.sum()), "label_accuracy": label_acc, "confident": cfg.confident,
                 "sigma_threshold": sigma1, "threshold": threshold,
                 "records_per_teacher": float(np.mean([len(i) for _, i in parts])),
                 "teachers_per_hospital": per_hospital,
                 "privacy_unit": task.privacy_unit},
        model=student,
    )
