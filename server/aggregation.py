"""One PATE aggregation: validate the hospitals' encodings, charge the ledger, add Gaussian noise.

Fay et al., Algorithms 1-2: ``z_bar_n = (1/K) sum_k z_nk + N(0, sigma^2 I_l)``. The privacy flow is the
one of docs/ARCHITECTURE.md: ``guard.charge(...)`` (ledger written) **then** noise **then** release.

Validation of every hospital's reply (never trust what arrives):

* wrong shape (not ``(T_h, l)``, or no rows) or non-finite values -> the whole reply is rejected: that
  hospital did not answer this query (its teachers do not count in K, and it is not charged: nothing
  computed from its patients enters the release);
* rows the codec kind calls implausible (its ``CodecKind.implausible_rows`` hook) -> rejected: PCA in
  paper/public mode refuses rows longer than R (its bound R/K needs images of probabilities; clipping to R
  would only give 2R/K), the identity codec anything but exact one-hot votes;
* every other row longer than the state's row bound (autoencoder: 1; clip modes and anchored: C) is clipped
  again on the server (the 2C/K bound holds for any rows of norm <= C, whatever produced them), except for
  a kind whose rows are exact values (``CodecKind.exact_rows``: the identity codec's votes).

K = the number of teacher rows accepted; the replace-one sensitivity S is the codec state's at that K
(``task.codecs.codec_sensitivity``, the same function the hospitals charge with),
so a dropout (smaller K) is recorded with its larger S and the accountant composes what was actually
released. If the charge would exceed any answering hospital's budget, ``BudgetExceeded`` propagates
*before* any noise is drawn or anything is released (the protocol then stops querying).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from privacy.events import GaussianEvent
from privacy.mechanisms import GaussianMechanism, NoiseSource
from privacy.validation import positive_number
from task import codecs
from task.learning.phases import timed

log = logging.getLogger("fedpate.pate")

ROW_TOLERANCE = codecs.ROW_TOLERANCE


class ReplyRejected(ValueError):
    """A hospital's reply failed validation (the message says why)."""


def validate_reply(hospital: str, rows, state: Mapping[str, np.ndarray], latent_dim: int) -> np.ndarray:
    """Return the hospital's (T_h, l) rows, validated and re-clipped; raise :class:`ReplyRejected`."""
    try:
        rows = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ReplyRejected(f"hospital {hospital}: reply is not numeric ({exc})") from None
    if rows.ndim != 2 or rows.shape[1] != latent_dim or rows.shape[0] < 1:
        raise ReplyRejected(f"hospital {hospital}: expected encodings of shape (T, {latent_dim}), got {rows.shape}")
    if not np.all(np.isfinite(rows)):
        raise ReplyRejected(f"hospital {hospital}: encodings contain NaN or infinite values")
    kind = codecs.kind_of(state)
    reason = kind.implausible_rows(state, rows) if kind.implausible_rows is not None else None
    if reason is not None:
        raise ReplyRejected(f"hospital {hospital}: {reason}")
    if kind.exact_rows:
        return rows
    bound = codecs.row_bound(state)
    norms = np.linalg.norm(rows, axis=1)
    if np.any(norms > bound * (1 + ROW_TOLERANCE)):
        log.warning("hospital %s: %d encodings longer than %.4g clipped on the server", hospital,
                    int(np.sum(norms > bound * (1 + ROW_TOLERANCE))), bound)
    return codecs.clip_rows(rows, bound).astype(np.float64)


@dataclass(frozen=True)
class QueryRelease:
    """One query's release as the server planned it: what is charged for it and where its noise comes from.

    ``release_id``: the ledger's release id (also names the noise stream when ``stream`` is None); ``sigma``: the
    planned noise standard deviation; ``compressor``: the release's compressor (its ``latent_dim`` and name; its
    ``state()`` when ``state`` is None); ``state``: the codec state the hospitals used; ``expected_rows``: hospital
    -> its number of teachers, the hospitals the server asked, each of which charged its own ledger for K = the sum
    of these (None = no such check); ``stream``: the name of the noise stream (None = the release id): a caller whose
    release ids carry a per-run nonce passes the name without it, so that reproducible noise repeats; ``note``:
    extra fields stored with the ledger event.
    """

    release_id: str
    sigma: float
    compressor: object
    state: Mapping[str, np.ndarray] | None = None
    expected_rows: Mapping[str, int] | None = None
    stream: str | None = None
    note: Mapping | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.release_id, str) or not self.release_id:
            raise ValueError(f"release_id: expected a non-empty string, got {self.release_id!r}")
        positive_number("sigma", self.sigma)

    @property
    def codec_state(self) -> Mapping[str, np.ndarray]:
        return self.compressor.state() if self.state is None else self.state


def accepted_rows(encodings: Mapping[str, np.ndarray], release: QueryRelease, state: Mapping[str, np.ndarray],
                  rejected: dict | None = None) -> dict[str, np.ndarray]:
    """hospital -> its validated rows (:func:`validate_reply`; with ``expected_rows``, exactly its asked teachers);
    replies that fail are logged and, when ``rejected`` is given, collected there (hospital -> list of reasons:
    server log only, reasons can carry numbers computed from private data)."""
    latent = int(release.compressor.latent_dim)
    expected_rows = release.expected_rows
    accepted: dict[str, np.ndarray] = {}
    for hospital in sorted(encodings):
        try:
            rows = validate_reply(hospital, encodings[hospital], state, latent)
            if expected_rows is not None and len(rows) != int(expected_rows.get(hospital, -1)):
                raise ReplyRejected(f"hospital {hospital}: {len(rows)} encodings, but it was asked for "
                                    f"{expected_rows.get(hospital, 0)} teachers")
            accepted[hospital] = rows
        except ReplyRejected as exc:
            log.warning("%s: %s", release.release_id, exc)
            if rejected is not None:
                rejected.setdefault(hospital, []).append(str(exc))
    return accepted


@timed("queries")
def aggregate_query(encodings: Mapping[str, np.ndarray], release: QueryRelease, guard, noise=None, *,
                    mechanism=None, rejected: dict | None = None) -> tuple[np.ndarray | None, int]:
    """Noisy mean of the teachers' encodings for one query (Fay et al., Alg. 1-2, "aggregate and perturb").

    Returns ``(noisy mean (l,) float32, K)``; ``(None, 0)`` when no valid row arrived (nothing released,
    nothing charged). One ledger event per query, charged to every hospital whose rows were used,
    recorded by ``guard.charge`` before the noise is drawn.

    Args:
        encodings: hospital -> (T_h, l) rows for this query (absent hospitals did not answer).
        release: what is released and charged (:class:`QueryRelease`). With ``expected_rows``, a reply with
            another number of rows is rejected, and if not every asked teacher answered, nothing is released
            (``(None, 0)``, nothing charged), because a smaller K would mean a larger sensitivity than the
            hospitals were charged for.
        guard: the budget guard (``privacy.guard``) whose ``charge`` records the event before any noise is drawn;
            ``BudgetExceeded`` propagates from it.
        noise: the ``privacy.mechanisms.NoiseSource`` of the noise (None = secure).
        mechanism: a ready ``GaussianMechanism`` (for tests) with the release's sigma; None = a Gaussian mechanism
            on this release's own stream of ``noise``, opened only after the charge.
        rejected: when given, collects hospital -> list of reasons for replies that failed validation (server
            log only: reasons can carry numbers computed from private data).
    """

    sigma, release_id = release.sigma, release.release_id
    if mechanism is not None and getattr(mechanism, "sigma", sigma) != sigma:
        raise ValueError(f"{release_id}: the mechanism's sigma {mechanism.sigma} differs from the planned {sigma}")
    state = release.codec_state
    accepted = accepted_rows(encodings, release, state, rejected)
    teachers = int(sum(len(rows) for rows in accepted.values()))
    if teachers == 0:
        return None, 0
    expected_rows = release.expected_rows
    if expected_rows is not None and teachers < sum(int(v) for v in expected_rows.values()):
        log.warning("%s: %d of %d asked teachers answered; not released", release_id, teachers,
                    sum(int(v) for v in expected_rows.values()))
        return None, 0
    sensitivity = float(codecs.codec_sensitivity(state, teachers))
    event = GaussianEvent(sensitivity=sensitivity, sigma=float(sigma))
    owners = sorted(accepted)
    guard.charge(owners, event, release_id=release_id,
                 note={"teachers": teachers, "hospitals": len(owners), "compressor": release.compressor.name,
                       "latent_dim": int(release.compressor.latent_dim), "sensitivity": sensitivity,
                       "sigma": float(sigma), **dict(release.note or {})})
    clean_mean = np.concatenate(list(accepted.values()), axis=0).mean(axis=0)
    if mechanism is None:
        mechanism = GaussianMechanism(sigma, (noise or NoiseSource()).generator(release.stream or release_id))
    noisy = mechanism(clean_mean)
    return np.asarray(noisy, dtype=np.float32), teachers
