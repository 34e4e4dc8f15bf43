"""One PATE aggregation: validate the hospitals' encodings, charge the ledger, add Gaussian noise.

Fay et al., Algorithms 1-2: ``z_bar_n = (1/K) sum_k z_nk + N(0, sigma^2 I_l)``. The privacy flow is the
one of docs/ARCHITECTURE.md: ``guard.charge(...)`` (ledger written) **then** noise **then** release.

Validation of every hospital's reply (never trust what arrives):

* wrong shape (not ``(T_h, l)``, or no rows) or non-finite values -> the whole reply is rejected: that
  hospital did not answer this query (its teachers do not count in K, and it is not charged: nothing
  computed from its patients enters the release);
* ``ae`` / ``pca`` clip mode: rows longer than the bound (1, resp. C) are clipped again on the server
  (the 2C/K bound holds for any rows of norm <= C, whatever produced them);
* ``pca`` paper/public modes: the bound R/K needs the rows to be images of probabilities, which the
  hospital's codec verifies (task.codecs.encode). The server can only check the necessary condition
  ``||z|| <= R``; a longer row proves the reply was not produced by the codec -> rejected (clipping it
  to R would only give 2R/K, twice the sensitivity the noise was calibrated for);
* ``identity``: every row must be exact one-hot votes (checked exactly) -> otherwise rejected.

K = the number of teacher rows accepted; the replace-one sensitivity S is the codec state's at that K
(``task.codecs.codec_sensitivity``, the same function the hospitals charge with),
so a dropout (smaller K) is recorded with its larger S and the accountant composes what was actually
released. If the charge would exceed any answering hospital's budget, ``BudgetExceeded`` propagates
*before* any noise is drawn or anything is released (the protocol then stops querying).
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from privacy.events import GaussianEvent
from privacy.mechanisms import GaussianMechanism, NoiseSource
from task import codecs

log = logging.getLogger("fedpate.pate")

ROW_TOLERANCE = 1e-5


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
    kind = str(codecs.scalar(state, "kind"))
    bound = codecs.row_bound(state)
    norms = np.linalg.norm(rows, axis=1)
    if kind == "identity":
        classes = int(codecs.scalar(state, "classes"))
        votes = rows.reshape(len(rows), classes, -1)
        if not (np.all((votes == 0) | (votes == 1)) and np.all(votes.sum(axis=1) == 1)):
            raise ReplyRejected(f"hospital {hospital}: identity codec expects one-hot votes")
        return rows
    if kind == "pca" and str(codecs.scalar(state, "mode")) in ("paper", "public"):
        if np.any(norms > bound * (1 + ROW_TOLERANCE)):
            raise ReplyRejected(f"hospital {hospital}: encoding norm {norms.max():.4g} exceeds {bound:.4g}, "
                                "so it was not produced from probabilities by the public codec")
        return codecs.clip_rows(rows, bound).astype(np.float64)
    if np.any(norms > bound * (1 + ROW_TOLERANCE)):
        log.warning("hospital %s: %d encodings longer than %.4g clipped on the server", hospital,
                    int(np.sum(norms > bound * (1 + ROW_TOLERANCE))), bound)
    return codecs.clip_rows(rows, bound).astype(np.float64)


def aggregate_query(encodings: Mapping[str, np.ndarray], sigma: float, compressor, guard, release_id: str,
                    mechanism=None, note: Mapping | None = None, rejected: dict | None = None,
                    state: Mapping[str, np.ndarray] | None = None, noise=None,
                    expected_rows: Mapping[str, int] | None = None,
                    stream: str | None = None) -> tuple[np.ndarray | None, int]:
    """Noisy mean of the teachers' encodings for one query (Fay et al., Alg. 1-2, "aggregate and perturb").

    Returns ``(noisy mean (l,) float32, K)``; ``(None, 0)`` when no valid row arrived (nothing released,
    nothing charged). One ledger event per query, charged to every hospital whose rows were used,
    recorded by ``guard.charge`` before the noise is drawn.

    Args:
        encodings: hospital -> (T_h, l) rows for this query (absent hospitals did not answer).
        sigma: the planned noise standard deviation; a given ``mechanism`` must have the same.
        compressor: the release's compressor (its ``latent_dim`` and name; its ``state()`` when ``state`` is None).
        guard: the budget guard (``privacy.guard``) whose ``charge`` records the event before any noise is drawn;
            ``BudgetExceeded`` propagates from it.
        release_id: the ledger's release id of this query (also names the noise stream when ``stream`` is None).
        mechanism: a ready ``GaussianMechanism`` (for tests); None = a Gaussian mechanism on this release's own
            stream of ``noise``, opened only after the charge.
        note: extra fields stored with the ledger event (None = none).
        rejected: when given, collects hospital -> list of reasons for replies that failed validation (server
            log only: reasons can carry numbers computed from private data).
        state: the codec state the hospitals used (None = ``compressor.state()``).
        noise: the ``privacy.mechanisms.NoiseSource`` of the noise (None = secure).
        expected_rows: hospital -> its number of teachers: the hospitals the server asked, each of which
            charged its own ledger for K = the sum of these; a reply with another number of rows is rejected,
            and if not every asked teacher answered, nothing is released (``(None, 0)``, nothing charged),
            because a smaller K would mean a larger sensitivity than the hospitals were charged for.
            None = no such check.
        stream: the name of the noise stream (None = the release id): a caller whose release ids carry a
            per-run nonce passes the name without it, so that reproducible noise repeats.
    """

    if mechanism is not None and getattr(mechanism, "sigma", sigma) != sigma:
        raise ValueError(f"{release_id}: the mechanism's sigma {mechanism.sigma} differs from the planned {sigma}")
    state = compressor.state() if state is None else state
    latent = int(compressor.latent_dim)
    accepted: dict[str, np.ndarray] = {}
    for hospital in sorted(encodings):
        try:
            rows = validate_reply(hospital, encodings[hospital], state, latent)
            if expected_rows is not None and len(rows) != int(expected_rows.get(hospital, -1)):
                raise ReplyRejected(f"hospital {hospital}: {len(rows)} encodings, but it was asked for "
                                    f"{expected_rows.get(hospital, 0)} teachers")
            accepted[hospital] = rows
        except ReplyRejected as exc:
            log.warning("%s: %s", release_id, exc)
            if rejected is not None:
                rejected.setdefault(hospital, []).append(str(exc))
    teachers = int(sum(len(rows) for rows in accepted.values()))
    if teachers == 0:
        return None, 0
    if expected_rows is not None and teachers < sum(int(v) for v in expected_rows.values()):
        log.warning("%s: %d of %d asked teachers answered; not released", release_id, teachers,
                    sum(int(v) for v in expected_rows.values()))
        return None, 0
    sensitivity = float(codecs.codec_sensitivity(state, teachers))
    event = GaussianEvent(sensitivity=sensitivity, sigma=float(sigma))
    owners = sorted(accepted)
    guard.charge(owners, event, release_id=release_id,
                 note={"teachers": teachers, "hospitals": len(owners), "compressor": compressor.name,
                       "latent_dim": latent, "sensitivity": sensitivity, "sigma": float(sigma), **dict(note or {})})
    clean_mean = np.concatenate(list(accepted.values()), axis=0).mean(axis=0)
    if mechanism is None:
        mechanism = GaussianMechanism(sigma, (noise or NoiseSource()).generator(stream or release_id))
    noisy = mechanism(clean_mean)
    return np.asarray(noisy, dtype=np.float32), teachers
