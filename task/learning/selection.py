"""Private selection of the DP-SGD baseline's setting (Papernot & Steinke 2022, arXiv 2110.03620).

Two ways the pooled DP-SGD baseline (``sim.runners.central``) may choose among its settings grid:

* ``"public"`` (default): train every grid entry, all with one noise multiplier calibrated so that the G
  trainings together spend the budget, keep the best on the *public* validation set (post-processing).
* ``"private"`` (this module): Papernot & Steinke, "Hyperparameter tuning with Renyi differential privacy"
  (ICLR 2022, arXiv 2110.03620), scored on the hospitals' own held-out patients:

  1. before anything is trained or noised, the whole mechanism is charged to the ledger as one
     :class:`privacy.events.RepeatAndSelectEvent` (T is random and unknown in advance, so the event covers
     every T); a guard whose budget would not allow it refuses, and nothing happens;
  2. T is drawn from a truncated negative binomial (``shape`` η; η = 1 geometric, η = 0 logarithmic) or a
     Poisson (``shape=None``) with mean ``mean`` (default: the number of candidates);
  3. each repetition draws a candidate uniformly from the grid ∪ {"the public model, unchanged"}, trains it
     with DP-SGD (the public-model candidate trains nothing) and scores it on the held-out patients:
     ``mean Dice over the n held-out patients + N(0, score_noise²)``;
  4. only the candidate with the best noisy score is released (its model, its setting and its noisy score).
     The realised T and every other repetition's candidate and score are *not* released: the theorem
     covers the best output only (``RepeatAndSelectEvent``). With Poisson T = 0 the public model is
     released (the mechanism output nothing; the fallback is post-processing).

Decisions, stated before any result was seen:

* **Held-out patients**: a fixed fraction (``heldout_fraction``, default 0.2, at least one patient) of the
  pooled private training patients, chosen by a seeded permutation of their positions (the run's seed; the
  split is public, data-independent and fixed for every neighbouring dataset), excluded from every
  candidate's training. Their privacy is covered by the same ledger event (the score is part of each
  repetition's base mechanism).
* **Relation: replace-one only** (the product's default for DP-SGD and the only one that holds when
  dataset sizes are published; docs/PRIVACY.md, "Neighbouring relations"). The held-out count n is then public.
* **Score sensitivity (replace-one) is 1/n.** Let H be the held-out patients (|H| = n, fixed by position)
  and m the model being scored. The score is ``s(m, H) = (1/n) Σ_{i∈H} d(m, i)`` with ``d(m, i)`` the mean
  Dice of m's prediction on patient i, set to 0 when undefined, so ``d ∈ [0, 1]``. Take neighbouring D, D'
  that differ in the record at one position p. (a) p ∈ H: the training part is identical, so m has the
  same distribution; for any fixed m, s(m, H) and s(m, H') share n − 1 terms and the differing terms lie in
  [0, 1], so ``|s(m, H) − s(m, H')| = |d(m, p) − d'(m, p)|/n ≤ 1/n``. (b) p ∉ H: H = H', and s is a fixed
  function of m, i.e. post-processing of the DP-SGD release, already covered by its event. So the Gaussian
  score with std ``score_noise`` is charged as ``GaussianEvent(sensitivity=1/n, sigma=score_noise)``,
  composed *sequentially* with the DP-SGD event (safe; since each patient is in exactly one part, a
  per-order maximum instead of a sum would also be valid and is left as a tightening).
* **One repetition's event dominates every candidate**: all grid entries must share one expected batch
  (hence one sampling rate q); the event charges ``steps_per_epoch × max epochs`` steps at (q, z). A
  candidate with fewer epochs, or the public model (no steps), spends less; a data-independent uniform
  choice of candidate is a mixture, whose Rényi divergence is at most the largest of its components'
  (joint quasi-convexity; van Erven & Harremoës 2014, Thm. 13), so the charged curve covers the draw.
  Each repetition's steps go through :class:`privacy.guard.CoveredGuard`, which records nothing but
  refuses a step outside the charged event.
* **Noise**: DP-SGD's multiplier z is calibrated so that the RDP accountant's ε of the charged event is
  the budget (``privacy.calibration.private_selection_noise_multiplier``); ``score_noise`` is fixed in
  advance (default 0.05 on the Dice scale: the size of the sampling error of a mean Dice over ~30 patients
  whose Dice spreads by ~0.25, so the noise does not dominate the score's own uncertainty).
* **Randomness**: T, the candidate draws, the DP-SGD batches and noise and the score noise all come from
  the run's :class:`privacy.mechanisms.NoiseSource` (secure unless reproducible noise was asked for), each
  from its own named stream, opened only after the charge.

**Nothing observable depends on T or on which candidates ran.** The theorem covers the best output only; a
console, a file or a time that tells how many repetitions ran (or which candidates) publishes T:

* the console shows one progress bar for the whole selection, with no count, no rate and no elapsed time;
  inside the repetitions every other output (the candidates' own bars, warnings, log records, prints) is
  dropped, since whether it appears depends on which candidates were drawn;
* only the released candidate's record is written (its setting, model, noisy score); the realised T stays in
  memory (:attr:`Selected.repetitions`, and only under reproducible noise, i.e. in a simulation);
* **no times, rather than padding.** Padding the running time to a constant would need an upper bound on
  the repetitions' running time, and T is unbounded (a truncated negative binomial or a Poisson): any pad
  is exceeded with positive probability, and then the overrun tells that T was large; a pad long enough to
  make that rare costs many times the expected work. So the run writes no time instead: the selection's
  ledger record carries no time (``privacy.ledger.Ledger(timestamps=False)``), results.json no wall time,
  and :func:`stamp_one_time` gives every file and folder of the run one and the same modification time
  when the run ends, so no two times in the folder span the repetitions.

What this does not hide: **the process's own duration.** Whoever watches the run (its start and end, the
machine's logs, the file system's inode-change, birth and access times on the machine that ran it) can
time it, and the duration grows with T. The operator therefore publishes the run folder's files and not
when the run started or how long it took (no job-scheduler times, no console recording with timestamps).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from privacy import calibration
from privacy.accountants import epsilon_spent
from privacy.errors import PrivacyError
from privacy.guard import CoveredGuard
from task.errors import UserError
from task.options import Relation, look_up_option

#: the one progress bar of a private selection: a description only (no count, rate or elapsed time)
PROGRESS_LABEL = "private selection (how many candidates run is secret: no progress count)"
PUBLIC_CANDIDATE = "the public model, unchanged"


@dataclass(frozen=True)
class SelectionConfig:
    """Private selection's parameters, all fixed before any result is seen (module docstring)."""

    heldout_fraction: float = 0.2
    score_noise: float = 0.05          # std of the noisy mean held-out Dice
    mean: float | None = None          # E[T]; None = number of candidates (grid entries + the public model)
    shape: float | None = 1.0          # truncated negative binomial η (1 = geometric); None = Poisson

    def validate(self) -> "SelectionConfig":
        """Refuse a setting the mechanism cannot run, naming the command-line flag that sets it; called before
        anything is built, trained or charged."""
        if isinstance(self.heldout_fraction, bool) or not 0 < float(self.heldout_fraction) < 1:
            raise UserError(f"--selection-heldout: expected a fraction strictly between 0 and 1, "
                            f"got {self.heldout_fraction}")
        if not (math.isfinite(float(self.score_noise)) and float(self.score_noise) > 0):
            raise UserError(f"--selection-score-noise: expected a positive finite number, got {self.score_noise}")
        if self.shape is not None and not (math.isfinite(float(self.shape)) and float(self.shape) >= 0):
            raise UserError(f"--selection-shape: expected a number >= 0 or 'poisson', got {self.shape}")
        if self.mean is not None:
            mean = float(self.mean)
            if not (math.isfinite(mean) and mean >= 1):
                raise UserError(f"--selection-mean: expected a finite number >= 1, got {self.mean}")
            if self.shape is not None and mean <= 1:
                # Papernot & Steinke's truncated negative binomial has mean > 1 for every γ in (0, 1): mean 1
                # would be "T = 1 always", one run, which that distribution (and its privacy bound) cannot be
                raise UserError(f"--selection-mean: a truncated negative binomial (--selection-shape {self.shape:g}) "
                                f"needs a mean above 1, got {self.mean:g} (mean 1 is a single run; use "
                                "--selection-shape poisson for mean 1)")
        return self


def heldout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training positions, held-out positions) of n pooled patients: a seeded permutation's first
    ``max(1, round(fraction·n))`` positions are held out (public and data-independent)."""
    if n < 2:
        raise UserError(f"private selection: needs at least 2 private patients (one held out), got {n}")
    k = min(n - 1, max(1, int(round(fraction * n))))
    order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), 0x5E1EC7]))).permutation(n)
    return np.sort(order[k:]), np.sort(order[:k])


def truncated_negative_binomial_gamma(mean: float, shape: float) -> float:
    """γ of the truncated negative binomial with this mean, chosen so that the sampled distribution's mean is
    at most ``mean`` (what the event is charged with) and γ at least dp_accounting's (whose constant term uses
    its own, more conservative, γ)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    gamma = rdp._gamma_truncated_negative_binomial(shape, mean)
    while rdp._truncated_negative_binomial_mean(gamma, shape) > mean and gamma < 1:
        gamma = min(1.0, gamma * (1 + 1e-9))
    return gamma


def repetition_pmf(k: int, mean: float, shape: float | None, gamma: float | None = None) -> float:
    """P[T = k]: Papernot & Steinke Definition 1 (truncated negative binomial, η = ``shape``; η = 0 is the
    logarithmic distribution) or Poisson(mean) when ``shape`` is None. ``gamma``: the truncated negative
    binomial's γ when the caller already has it (None = :func:`truncated_negative_binomial_gamma`)."""
    if shape is None:
        return math.exp(-mean + k * math.log(mean) - math.lgamma(k + 1)) if k >= 0 else 0.0
    if k < 1:
        return 0.0
    gamma = truncated_negative_binomial_gamma(mean, shape) if gamma is None else gamma
    if shape == 0:
        return (1 - gamma) ** k / (k * math.log(1 / gamma))
    log_prod = math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1)
    return math.exp(k * math.log1p(-gamma) + log_prod) / (gamma ** -shape - 1)


def sample_repetitions(mean: float, shape: float | None, generator, limit: int = 100_000) -> int:
    """T by inversion of one uniform from ``generator`` (a privacy.mechanisms stream)."""
    u = float(generator.uniform((1,))[0])
    k = 0 if shape is None else 1
    gamma = None if shape is None else truncated_negative_binomial_gamma(mean, shape)   # once, not per k
    cumulative = 0.0
    while k < limit:
        cumulative += repetition_pmf(k, mean, shape, gamma)
        if u < cumulative:
            return k
        k += 1
    return k


def noisy_mean_score(per_case: Sequence[float | None], noise_std: float, generator) -> float:
    """Mean of per-patient Dice in [0, 1] (undefined → 0) plus ``N(0, noise_std²)`` from ``generator``
    (sensitivity 1/n under replace-one: module docstring)."""
    values = np.clip(np.array([0.0 if v is None or not np.isfinite(v) else float(v) for v in per_case]), 0.0, 1.0)
    if not len(values):
        raise PrivacyError("noisy_mean_score: no held-out patients")
    return float(values.mean() + noise_std * generator.standard_normal((1,))[0])


@dataclass
class Selected:
    """What private selection releases: the chosen candidate (a grid entry's setting, or None for the public
    model), its trained model and TrainResult (None for the public model), and the record for results.json."""

    setting: dict | None
    result: Any
    model: Any
    info: dict = field(default_factory=dict)
    #: the realised T, only under reproducible noise (a simulation); never written anywhere (module docstring)
    repetitions: int | None = None


def stamp_one_time(folder) -> float:
    """Give every file and folder under ``folder`` (and ``folder`` itself) one modification and access time,
    now, and return it: no two times in the folder then span the private selection's repetitions (module
    docstring). Now, not an earlier instant: setting a time changes the inode-change time to now, so an
    earlier stamp would leave the duration readable as the gap between the two."""
    now = time.time()
    for root, dirs, files in os.walk(folder):
        for name in (*files, *dirs):
            os.utime(os.path.join(root, name), (now, now), follow_symlinks=False)
    os.utime(folder, (now, now))
    return now


@contextlib.contextmanager
def _one_bar_and_silence(progress: bool):
    """One progress bar for the whole selection (a description only), and every other console output of the
    repetitions dropped: their bars, warnings, log records and prints depend on which candidates ran."""
    from tqdm import tqdm

    bar = tqdm(desc=PROGRESS_LABEL, bar_format="{desc}", disable=not progress, leave=False)
    logging_was = logging.root.manager.disable
    try:
        with open(os.devnull, "w") as sink, warnings.catch_warnings(), \
                contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            logging.disable(logging.CRITICAL)
            yield
    finally:
        logging.disable(logging_was)
        bar.close()


def plan(settings: Sequence[dict], n_train: int, epsilon: float, delta: float, relation: str, n_heldout: int,
         config: SelectionConfig, steps_per_epoch) -> dict:
    """The mechanism's parameters (no data touched): q, steps, z, the score's σ and the event to charge.

    Args:
        settings: the grid entries (all with one expected batch).
        n_train: the training part's size (after the held-out patients are set aside).
        epsilon / delta: the budget.
        relation: the neighbouring relation (replace-one only).
        n_heldout: the number of held-out patients (the score's sensitivity is 1/n).
        config: the selection's settings (:class:`SelectionConfig`).
        steps_per_epoch: DP-SGD's steps per epoch, ``(n, batch) -> steps``.
    """
    if relation != Relation.REPLACE_ONE:
        raise UserError("--selection private: replace-one only (the score is a mean over a published number of "
                        "held-out patients; task/learning/selection.py)")
    batches = {int(s["batch_size"]) for s in settings}
    if len(batches) != 1:
        raise UserError(f"--selection private: every grid entry must share one expected batch (one sampling rate), "
                        f"got {sorted(batches)}")
    steps_epoch = steps_per_epoch(n_train, batches.pop())
    steps = steps_epoch * max(int(s["epochs"]) for s in settings)
    mean = float(config.mean if config.mean is not None else len(settings) + 1)
    q = 1.0 / steps_epoch
    sensitivity = 1.0 / n_heldout
    try:
        selection = calibration.PrivateSelection(q, steps, sensitivity, config.score_noise, mean, config.shape,
                                                 relation)
        z = calibration.private_selection_noise_multiplier(epsilon, delta, selection)
    except PrivacyError as exc:
        raise UserError(f"--selection private: {exc}") from None
    event = calibration.selection_event(q, z, steps, sensitivity, config.score_noise, mean, config.shape, relation)
    return {"sampling_rate": q, "steps_per_epoch": steps_epoch, "steps": steps, "noise_multiplier": z,
            "score_sensitivity": sensitivity, "mean": mean, "event": event}


def split_and_plan(settings: Sequence[dict], n: int, epsilon: float, delta: float, relation: str, seed: int,
                   config: SelectionConfig, steps_per_epoch) -> tuple[np.ndarray, np.ndarray, dict]:
    """(training positions, held-out positions, :func:`plan`) for ``n`` pooled patients. Reads only public
    sizes and settings, so a caller runs it before any work to refuse a selection that cannot be planned
    (e.g. a score noise too small for the budget) before anything is trained or charged.

    Args:
        settings: the grid entries (:func:`plan`).
        n: the number of pooled private patients (held-out and training parts are cut from them).
        epsilon / delta: the budget.
        relation: the neighbouring relation (replace-one only).
        seed: positions of the held-out patients (:func:`heldout_split`).
        config: the selection's settings (validated here).
        steps_per_epoch: DP-SGD's steps per epoch, ``(n, batch) -> steps``.
    """
    config = config.validate()
    train_idx, held_idx = heldout_split(n, config.heldout_fraction, seed)
    return train_idx, held_idx, plan(settings, len(train_idx), epsilon, delta, relation, len(held_idx), config,
                                     steps_per_epoch)


@dataclass(frozen=True)
class SelectionBudget:
    """What private selection is charged to, under which budget, and where its randomness comes from.

    Args:
        guard: charged once with the whole event before anything is drawn or trained.
        owners: the patients' owners (the pooled hospitals).
        release_prefix: the run's release-id prefix (the event is ``<prefix>:private-selection``).
        noise: the run's noise source; T, candidates, batches and score noise come from its named streams.
        epsilon / delta: the budget the event is calibrated to.
        relation: the neighbouring relation (replace-one only: :func:`plan` refuses the others).
    """

    guard: Any
    owners: tuple[str, ...]
    release_prefix: str
    noise: Any
    epsilon: float
    delta: float
    relation: Relation = Relation.REPLACE_ONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "owners", tuple(self.owners))
        if not self.owners:
            raise PrivacyError("private selection: no owners to charge")
        look_up_option(self.relation, Relation, "relation")


@dataclass(frozen=True)
class SelectionCallbacks:
    """The torch-side work of private selection, as callbacks (so the mechanism stays testable without torch).

    Args:
        public_model: ``() -> model``: the public model (a fresh copy), a candidate itself.
        train_candidate: ``(setting, index, repetition, images, labels, noise_multiplier, guard, noise) ->
            TrainResult``: DP-SGD at multiplier z with ``guard`` (the :class:`CoveredGuard`), on the training part
            only.
        evaluate_per_case: ``(model, images, labels) -> per-patient mean Dice``.
        steps_per_epoch: ``(n, batch) -> steps``: DP-SGD's steps per epoch (``task.learning.dpsgd.steps_per_epoch``).
    """

    public_model: Callable[[], Any]
    train_candidate: Callable[..., Any]
    evaluate_per_case: Callable[[Any, Any, Any], Sequence[float | None]]
    steps_per_epoch: Callable[[int, int], int]

    def __post_init__(self) -> None:
        for name in ("public_model", "train_candidate", "evaluate_per_case", "steps_per_epoch"):
            if not callable(getattr(self, name)):
                raise TypeError(f"SelectionCallbacks.{name}: expected a callable, got {getattr(self, name)!r}")


def run_private_selection(settings: Sequence[dict], train_images, train_labels, *, budget: SelectionBudget,
                          seed: int, config: SelectionConfig, callbacks: SelectionCallbacks,
                          progress: bool = False) -> Selected:
    """Private selection (module docstring). The torch-side work comes in as ``callbacks``.

    Args:
        settings: the grid entries (candidates besides the public model unchanged).
        train_images / train_labels: the pooled private patients (held-out and training parts are cut from them).
        budget: the guard, owners, release id, noise source, budget and relation (:class:`SelectionBudget`).
        seed: positions of the held-out patients (a public, data-independent permutation).
        config: the selection's settings (:class:`SelectionConfig`).
        callbacks: the public model, a candidate's training, per-patient scoring and DP-SGD's steps per epoch
            (:class:`SelectionCallbacks`).
        progress: show the selection's one progress bar (``train_candidate`` shows none of its own; whatever
            the callbacks print during the repetitions is dropped: module docstring).
    """
    config = config.validate()
    train_idx, held_idx, p = split_and_plan(settings, len(train_images), budget.epsilon, budget.delta,
                                            budget.relation, seed, config, callbacks.steps_per_epoch)
    event = p["event"]
    release_id = f"{budget.release_prefix}:private-selection"
    # charged before any data is touched: T, candidates, training and score noise all come after
    budget.guard.charge(budget.owners, event, release_id=release_id,
                        note={"mechanism": "private selection (Papernot & Steinke 2022)",
                              "candidates": len(settings) + 1, "heldout_patients": int(len(held_idx)),
                              "noise_multiplier": p["noise_multiplier"], "score_noise": config.score_noise})
    covered = CoveredGuard(budget.guard, release_id, event, budget.owners)
    streams = budget.noise.child("private-selection")
    repetitions = sample_repetitions(p["mean"], config.shape, streams.generator("repetitions"))
    x_train, y_train = train_images[train_idx], train_labels[train_idx]
    x_held, y_held = train_images[held_idx], train_labels[held_idx]
    candidates = [dict(s) for s in settings] + [PUBLIC_CANDIDATE]
    best = None   # (noisy score, candidate index, result, model)
    with _one_bar_and_silence(progress):
        for rep in range(repetitions):
            covered.next_repetition()
            index = min(int(streams.generator("candidate", rep).uniform((1,))[0] * len(candidates)),
                        len(candidates) - 1)
            if candidates[index] == PUBLIC_CANDIDATE:
                result, model = None, callbacks.public_model()
            else:
                result = callbacks.train_candidate(candidates[index], index, rep, x_train, y_train,
                                                   p["noise_multiplier"], covered, streams.child(f"repetition-{rep}"))
                model = result.model
            score = noisy_mean_score(callbacks.evaluate_per_case(model, x_held, y_held), config.score_noise,
                                     streams.generator("score", rep))
            if best is None or score > best[0]:
                best = (score, index, result, model)
            else:
                del model, result
        if best is None:   # Poisson T = 0: the mechanism released nothing; the public model is the fallback
            best = (None, len(candidates) - 1, None, callbacks.public_model())
    score, index, result, model = best
    spent = epsilon_spent([event], budget.delta, accountant="rdp")[0]
    info = {
        "mechanism": "private selection: repeat a random number of times, release the best noisy held-out score "
                     "(Papernot & Steinke 2022, arXiv 2110.03620; dp_accounting RepeatAndSelectDpEvent under RDP)",
        "candidates": [c if isinstance(c, str) else dict(c) for c in candidates],
        "chosen": index, "chosen_candidate": candidates[index] if isinstance(candidates[index], str) else "grid entry",
        "chosen_noisy_score": score,
        # the realised T is not covered by the theorem (it would tell best-of-k for a known k): never written,
        # not even under reproducible noise (the record's shape would then depend on T)
        "repetitions": {"distribution": "poisson" if config.shape is None else "truncated negative binomial",
                        "mean": p["mean"], "shape": config.shape},
        "score": {"statistic": "mean Dice over held-out private patients (undefined -> 0), plus Gaussian noise",
                  "heldout_patients": int(len(held_idx)), "heldout_fraction": config.heldout_fraction,
                  "sensitivity": p["score_sensitivity"], "noise_std": config.score_noise},
        "training_patients": int(len(train_idx)),
        "dpsgd_noise_multiplier": p["noise_multiplier"], "sampling_rate": p["sampling_rate"],
        "steps_per_repetition": p["steps"],
        "event": event.to_dict(), "release_id": release_id,
        "epsilon": spent, "delta": budget.delta, "accountant": "rdp", "relation": budget.relation,
    }
    return Selected(setting=None if isinstance(candidates[index], str) else candidates[index], result=result,
                    model=model, info=info, repetitions=repetitions if budget.noise.is_reproducible else None)
