"""Empirical lower bounds on ε from a distinguishing test (the statistics of a privacy audit).

An (ε, δ)-DP mechanism M limits *every* test that tries to tell two neighbouring inputs D, D' apart from
M's output: for any set S of outputs, ``P[M(D) ∈ S] ≤ e^ε P[M(D') ∈ S] + δ`` and the same with D and D'
swapped. A threshold test "say D when the score is ≥ t" with false-positive rate FPR = P[score ≥ t | D']
and false-negative rate FNR = P[score < t | D] therefore forces (Kairouz, Oh & Viswanath 2015)

    ε ≥ log((1 − δ − FNR) / FPR)   and   ε ≥ log((1 − δ − FPR) / FNR).

Running the mechanism many times on D and on D' and replacing FPR and FNR by Clopper-Pearson *upper*
confidence bounds turns this into a statistical lower bound on the ε the mechanism really has: this is
the auditing method of Jagielski, Ullman & Oprea, *Auditing Differentially Private Machine Learning: How
Private is Private SGD?* (NeurIPS 2020) and Nasr, Song, Thakurta, Papernot & Carlini, *Adversary
Instantiation: Lower Bounds for Differentially Private Machine Learning* (IEEE S&P 2021). Steinke, Nasr &
Jagielski, *Privacy Auditing with One (1) Training Run* (NeurIPS 2023) obtain such bounds from one run
with many canaries; fedpate's audit uses the many-runs form, which needs no assumption on how canaries
interact and gives the tighter bound for few-parameter mechanisms like PATE's aggregator.

Statistical care (what :func:`epsilon_lower_bound` does):

* the threshold and the direction are chosen on a *selection* half of the runs and the bound is computed
  on the other, *held-out* half, so the search over thresholds does not inflate the confidence level;
* the two rates are bounded one-sidedly at level ``1 − α/2`` each (Bonferroni), so the pair of bounds,
  and hence the ε lower bound, holds with probability at least ``1 − α`` (``confidence``, default 95 %).

A bound above the claimed ε means the claim is wrong (with that confidence). A bound below it says only
that this test, with this many runs, found no violation: lower bounds are loose when ε is large, because
resolving ``FPR ≈ e^{-ε}`` needs about ``e^ε`` runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from privacy.errors import PrivacyError


def clopper_pearson_upper(successes, trials, alpha: float) -> np.ndarray:
    """One-sided upper ``1 − alpha`` Clopper-Pearson bound on a binomial rate (exact, conservative).

    ``Beta(1 − alpha; k + 1, n − k)`` for k < n, and 1 for k = n (Clopper & Pearson 1934).
    """
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if not 0 < alpha < 1:
        raise PrivacyError(f"alpha must be in (0, 1), got {alpha!r}")
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise PrivacyError("clopper_pearson_upper: need 0 <= successes <= trials and trials >= 1")
    full = k >= n
    upper = stats.beta.ppf(1.0 - alpha, k + 1.0, np.where(full, 1.0, n - k))
    return np.where(full, 1.0, upper)


def epsilon_from_rates(fpr, fnr, delta: float) -> np.ndarray:
    """``max(log((1-δ-FNR)/FPR), log((1-δ-FPR)/FNR))`` (0 where neither is positive); arrays broadcast."""
    fpr = np.asarray(fpr, dtype=np.float64)
    fnr = np.asarray(fnr, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.maximum(1.0 - delta - fnr, 0.0)) - np.log(fpr)
        two = np.log(np.maximum(1.0 - delta - fpr, 0.0)) - np.log(fnr)
    best = np.fmax(np.nan_to_num(one, nan=-np.inf, posinf=np.inf), np.nan_to_num(two, nan=-np.inf, posinf=np.inf))
    return np.maximum(best, 0.0)


def _bounds_at(positive: np.ndarray, negative: np.ndarray, thresholds: np.ndarray, delta: float, alpha: float):
    """ε lower bounds (both directions) for "say D if score ≥ t", at every t; rates bounded at α/2 each."""
    pos, neg = np.sort(positive), np.sort(negative)
    false_neg = np.searchsorted(pos, thresholds, side="left")          # positives below t
    false_pos = len(neg) - np.searchsorted(neg, thresholds, side="left")  # negatives at or above t
    fnr_up = clopper_pearson_upper(false_neg, len(pos), alpha / 2)
    fpr_up = clopper_pearson_upper(false_pos, len(neg), alpha / 2)
    with np.errstate(divide="ignore"):
        forward = np.log(np.maximum(1.0 - delta - fnr_up, 0.0)) - np.log(fpr_up)
        backward = np.log(np.maximum(1.0 - delta - fpr_up, 0.0)) - np.log(fnr_up)
    return forward, backward, false_pos, false_neg


def _candidates(positive: np.ndarray, negative: np.ndarray, limit: int = 4096) -> np.ndarray:
    scores = np.unique(np.concatenate([positive, negative]))
    if len(scores) > limit:
        scores = np.unique(np.quantile(scores, np.linspace(0.0, 1.0, limit)))
    return np.concatenate([scores, [np.inf]])


@dataclass
class AuditBound:
    """Result of :func:`epsilon_lower_bound`."""

    epsilon_lower: float       # the held-out (1 - alpha) lower bound on ε (0 when the test found nothing)
    epsilon_point: float       # the same test's plain estimate on the held-out half (no confidence margin)
    threshold: float
    direction: str             # "forward": log((1-δ-FNR)/FPR); "backward": log((1-δ-FPR)/FNR)
    false_positives: int
    false_negatives: int
    runs_positive: int         # held-out runs on D
    runs_negative: int         # held-out runs on D'
    confidence: float
    delta: float

    def to_dict(self) -> dict:
        return asdict(self)


def epsilon_lower_bound(positive, negative, delta: float, confidence: float = 0.95, *,
                        split: bool = True, seed: int = 0) -> AuditBound:
    """Lower bound on ε at ``delta`` from scores of runs on D (``positive``) and on D' (``negative``).

    Args:
        positive: one score per run on D (at least two, finite); higher scores must mean "more like D"
            (e.g. a log-likelihood ratio).
        negative: one score per run on D' (at least two, finite), on the same scale.
        delta: the δ at which ε is bounded (0 < δ < 1).
        confidence: the bound's confidence level (0 < confidence < 1; default 0.95).
        split: with ``split`` (default) the runs are shuffled (``seed``) and halved: the threshold and
            direction maximising the bound on the first half are applied to the second, whose Clopper-Pearson
            bounds (each at ``1 - (1-confidence)/2``) give the reported bound, valid at ``confidence``.
            ``split=False`` maximises over thresholds on all runs (the usual optimistic practice; its
            confidence is then only nominal).
        seed: the shuffle before the halving (unused without ``split``).
    """
    positive = np.asarray(positive, dtype=np.float64).ravel()
    negative = np.asarray(negative, dtype=np.float64).ravel()
    if len(positive) < 2 or len(negative) < 2:
        raise PrivacyError("epsilon_lower_bound: need at least two runs on each side")
    if not (np.all(np.isfinite(positive)) and np.all(np.isfinite(negative))):
        raise PrivacyError("epsilon_lower_bound: scores must be finite")
    if not 0 < delta < 1 or not 0 < confidence < 1:
        raise PrivacyError(f"need 0 < delta < 1 and 0 < confidence < 1, got {delta!r}, {confidence!r}")
    alpha = 1.0 - confidence
    if split:
        rng = np.random.default_rng(seed)
        positive, negative = rng.permutation(positive), rng.permutation(negative)
        sel_pos, eval_pos = positive[: len(positive) // 2], positive[len(positive) // 2:]
        sel_neg, eval_neg = negative[: len(negative) // 2], negative[len(negative) // 2:]
    else:
        sel_pos = eval_pos = positive
        sel_neg = eval_neg = negative
    thresholds = _candidates(sel_pos, sel_neg)
    forward, backward, _, _ = _bounds_at(sel_pos, sel_neg, thresholds, delta, alpha)
    i_f, i_b = int(np.argmax(forward)), int(np.argmax(backward))
    if forward[i_f] >= backward[i_b]:
        threshold, direction = float(thresholds[i_f]), "forward"
    else:
        threshold, direction = float(thresholds[i_b]), "backward"
    fwd, bwd, fp, fn = _bounds_at(eval_pos, eval_neg, np.array([threshold]), delta, alpha)
    value = float((fwd if direction == "forward" else bwd)[0])
    fpr, fnr = fp[0] / len(eval_neg), fn[0] / len(eval_pos)
    with np.errstate(divide="ignore"):
        if direction == "forward":
            point = math.log(max(1.0 - delta - fnr, 1e-300)) - (math.log(fpr) if fpr > 0 else -math.inf)
        else:
            point = math.log(max(1.0 - delta - fpr, 1e-300)) - (math.log(fnr) if fnr > 0 else -math.inf)
    return AuditBound(epsilon_lower=max(0.0, value), epsilon_point=max(0.0, point), threshold=threshold,
                      direction=direction, false_positives=int(fp[0]), false_negatives=int(fn[0]),
                      runs_positive=len(eval_pos), runs_negative=len(eval_neg), confidence=float(confidence),
                      delta=float(delta))


def largest_resolvable(runs_positive: int, runs_negative: int, delta: float, confidence: float = 0.95) -> float:
    """The largest bound :func:`epsilon_lower_bound` can report with these held-out run counts: a test
    that makes no error at all. A claim above it cannot be refuted with this many runs."""
    alpha = 1.0 - confidence
    fnr = float(clopper_pearson_upper(0, runs_positive, alpha / 2))
    fpr = float(clopper_pearson_upper(0, runs_negative, alpha / 2))
    return max(0.0, math.log(max(1.0 - delta - fnr, 1e-300)) - math.log(fpr))


def gaussian_lr_bound_limit(mu: float, delta: float) -> float:
    """ε(δ) of μ-GDP: what a perfect audit of a Gaussian mechanism with this μ would converge to."""
    from privacy.accountants import gdp_epsilon

    return float(gdp_epsilon(mu, delta))


__all__ = ["AuditBound", "clopper_pearson_upper", "epsilon_from_rates", "epsilon_lower_bound",
           "gaussian_lr_bound_limit", "largest_resolvable"]
