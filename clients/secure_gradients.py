"""A hospital's contribution to ``dp-fedavg-secure``: its patients' clipped head gradients, rounded, summed,
plus its share of discrete Gaussian noise, for one secure sum (``server/dpfedavg_secure.py``).

Two requests reach it through the secure-sum channel (``clients.secure.SecureHospital``):

* **join** (once per run, before any secure sum): the server sends the frozen start model (public: the
  public model every method starts from) and the run's neighbouring relation. The hospital refuses any
  relation but replace-one, builds the network (``task.learning.networks.VoxelHeadUNet`` on that U-Net), remembers it
  under its digest and answers with its number of patients. Under replace-one the number of patients is the
  same in every neighbouring dataset, so it is public by the relation itself (the server needs it to plan
  the steps and to divide the sum); under add/remove it would not be, hence the refusal.
* **contribution** (the collect-masked stage of one secure sum, ``clients.secure.SecureSumParty``): the
  current head weights and the start model's digest. After every check -- the declared grid's dimension is
  the head's, one release id, a start model it holds, finite head weights of the right shapes, no seeded
  noise on a deployed hospital -- it charges its own lifetime ledger one distributed discrete Gaussian
  release (``privacy.distributed.ddg_event``, the shares it counts on) and only then touches its patients:
  the frozen features (cached per start model, ``task.learning.headgrad``), one gradient row per patient, clipped to
  the declared ``clip``, conditionally rounded onto the grid, summed, plus ``N_Z(0, local_variance)`` per
  coordinate (Kairouz, Liu & Steinke 2021, arXiv 2102.06387, Algorithm 1, client side). A patient whose gradient
  is not finite (head weights that overflow on its scans) contributes a zero row instead, so nothing after the
  charge can fail because of one patient's data.

Noise and rounding randomness: the operating system's CSPRNG unless the simulation sends
``secure_noise_seed`` (``--reproducible-noise``), which a deployed hospital refuses before it charges.
"""

from __future__ import annotations

import io
import logging
import re
import weakref
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from clients.secure_checks import SecureRequestRefused, declared_grid
from task.errors import UserError
from task.wire.requests import SecureStageRequest
from task.wire.secagg import CONTRIBUTION_KIND as KIND, RELATION

log = logging.getLogger("fedpate.hospital")

#: one contributor per hospital object, kept as long as the hospital is: the Flower ClientApp builds a new
#: ``SecureHospital`` for every message, while its ``Hospital`` is cached (``clients.node.hospital_for``)
_CONTRIBUTORS: "weakref.WeakKeyDictionary[Any, HeadGradientContributor]" = weakref.WeakKeyDictionary()


def contributor_for(hospital) -> "HeadGradientContributor":
    """The :class:`HeadGradientContributor` of ``hospital`` (made on first use)."""
    contributor = _CONTRIBUTORS.get(hospital)
    if contributor is None:
        contributor = _CONTRIBUTORS[hospital] = HeadGradientContributor(hospital)
    return contributor


class HeadGradientContributor:
    """One hospital's side of ``dp-fedavg-secure``: the start models it joined with (in memory, and on its own
    disk under ``workdir/secure-fedavg/`` by digest, so another process of the same node finds them) and their
    frozen features (in memory)."""

    def __init__(self, hospital) -> None:
        self.hospital = hospital
        self._models: dict[str, Any] = {}      # start digest -> VoxelHeadUNet (the frozen U-Net + a head)
        self._features: dict[str, Any] = {}    # start digest -> cached [u(x), x] and labels of every scan

    def _start_path(self, digest: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise UserError(f"hospital {self.hospital.hospital_id}: {digest[:80]!r} is not a start-model digest")
        return Path(self.hospital.workdir) / "secure-fedavg" / f"start-{digest}.npz"

    def _build(self, state: Mapping[str, np.ndarray]):
        """The voxel-head network on the start model ``state`` (frozen), and its digest."""
        import torch

        from task.learning.headgrad import check_frozen_deterministic, state_digest
        from task.learning.networks import VOXEL_HEAD, build_unet, load_start_weights

        state = {k: np.asarray(v) for k, v in state.items() if not k.startswith("voxel_head.")}
        model = build_unet(self.hospital.preset.unet, trainable=VOXEL_HEAD)
        try:
            load_start_weights(model, {k: torch.as_tensor(v) for k, v in state.items()})
        except (RuntimeError, ValueError) as exc:
            raise UserError(f"hospital {self.hospital.hospital_id}: the start model does not fit its U-Net "
                            f"({exc})") from None
        check_frozen_deterministic(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        return model, state_digest(state), state

    def _model(self, digest: str):
        """The network of a start model this hospital joined with, or None."""
        if digest not in self._models:
            path = self._start_path(digest)
            if not path.exists():
                return None
            with np.load(path, allow_pickle=False) as saved:
                model, found, _ = self._build({k: saved[k] for k in saved.files})
            if found != digest:
                raise UserError(f"hospital {self.hospital.hospital_id}: {path.name} does not hold the start model "
                                "its name says")
            self._models[digest] = model
        return self._models[digest]

    # ------------------------------------------------------------------------------------------ who
    def _cases(self) -> tuple[list[str], list[str]]:
        """(case ids, the patient of each) of this hospital's private data."""
        from task.data.msd import patient_id

        cases = [case for partition in self.hospital.partitions for case in partition]
        prepared = self.hospital.prepared
        of = getattr(prepared, "patient", None)
        return cases, [str(of(case)) if callable(of) else patient_id(case) for case in cases]

    def patient_count(self) -> int:
        return len(set(self._cases()[1]))

    # ------------------------------------------------------------------------------------------ join
    def join(self, message: Mapping[str, Any], config: SecureStageRequest | Mapping[str, Any] | None = None) -> dict:
        """Take the run's frozen start model; answer with the patient count, the digest and the head's size
        (nothing is charged: the start model is public, and so is the count under replace-one)."""
        from task.learning.headgrad import head_dimension
        from task.io import atomic_write_bytes

        who = self.hospital.hospital_id
        if str(message.get("kind")) != KIND:
            raise UserError(f"hospital {who}: unknown secure contribution kind {message.get('kind')!r}")
        if str(message.get("relation", RELATION)) != RELATION:
            raise UserError(f"hospital {who}: dp-fedavg-secure publishes patient counts, which only replace-one "
                            f"makes public; refuses relation {message.get('relation')!r}")
        state = dict(message.get("start_weights") or {})
        if not state:
            raise UserError(f"hospital {who}: the join request carries no start model")
        model, digest, state = self._build(state)
        self._models[digest] = model
        path = self._start_path(digest)
        if not path.exists():   # public weights: kept so that another process of this node finds them
            buffer = io.BytesIO()
            np.savez(buffer, **state)
            atomic_write_bytes(path, buffer.getvalue())
        return {"patients": self.patient_count(), "start_digest": digest, "dimension": head_dimension(model)}

    # ------------------------------------------------------------------------------------------ contribute
    def contribution(self, session, message: Mapping[str, Any], config: SecureStageRequest | Mapping[str, Any],
                     policy) -> np.ndarray:
        """Checks, then the charge, then the noised integer sum of this hospital's rounded patient rows."""
        from clients.replay import mint_nonce
        from privacy.distributed import ddg_event, sample_discrete_gaussian
        from privacy.mechanisms import NoiseSource
        from task.learning.headgrad import (clip_rows, frozen_features, head_dimension, load_head_state,
                                            per_patient_rows, per_sample_head_gradients)

        hospital, noise = self.hospital, session.noise
        request = hospital.read_request(SecureStageRequest, config)
        who = hospital.hospital_id
        grid = declared_grid(who, noise)
        release_ids = [str(r) for r in noise["release_ids"]]
        digest = str(message.get("start_digest"))
        model = self._model(digest)
        if model is None:
            raise SecureRequestRefused(f"hospital {who}: no start model {digest[:12]!r} joined (send join first)")
        dimension = head_dimension(model)
        if len(release_ids) != 1 or grid.dimension != dimension or session.length != dimension:
            raise SecureRequestRefused(f"hospital {who}: one step is one release of the head's {dimension} "
                                       f"coordinates; the request declares {len(release_ids)} release(s) of "
                                       f"{grid.dimension} in a sum of length {session.length}")
        if str(noise.get("relation", RELATION)) != RELATION:
            raise SecureRequestRefused(f"hospital {who}: refuses relation {noise.get('relation')!r} (replace-one only)")
        try:
            load_head_state(model, dict(message.get("head") or {}))
        except UserError as exc:
            raise SecureRequestRefused(f"hospital {who}: {exc}") from None
        seed = request.secure_noise_seed
        if seed is not None and getattr(hospital, "deployed", False):
            raise SecureRequestRefused(f"hospital {who}: refuses seeded noise (simulation only)")
        local_variance = float(noise["local_variance"])
        # the charge: one release, the noise shares it counts on, before any patient's data is read
        event = ddg_event(grid, local_variance, session.counted, 1, RELATION)
        nonce = mint_nonce()
        hospital.lifetime_guard(request).charge_all(
            [who], event, [f"{release_ids[0]}@{nonce}"],
            {"secure_sum": True, "participants": len(session.participants), "counted_shares": session.counted,
             "colluders": policy.colluders, "dropouts": policy.dropouts, "threshold": session.threshold,
             "local_variance": local_variance, "kind": KIND, "dimension": dimension})
        source = NoiseSource() if seed is None else NoiseSource.reproducible(seed)
        generator = source.generator(who, str(message.get("stream") or release_ids[0]))
        cases, patients = self._cases()
        if digest not in self._features:   # the frozen U-Net runs once per scan and start model
            device = hospital.compute(request)[0]
            self._features[digest] = (frozen_features(model, hospital.prepared.images(cases), device=device),
                                      np.asarray(hospital.prepared.labels(cases), np.int64))
        features, labels = self._features[digest]
        model.to(features.device)
        per_scan = per_sample_head_gradients(model, features, labels)
        rows, _ = per_patient_rows(per_scan, patients)
        # a patient whose gradient is not finite (head weights that overflow on its scans) contributes a fixed
        # zero row, as secure PATE's teachers answer a fixed fallback: the step is released whatever the data,
        # never aborted after the charge by one patient, and a zero row is inside the clip the charge assumes
        finite = np.all(np.isfinite(rows), axis=1)
        if not np.all(finite):
            log.warning("hospital %s: %d patient gradient(s) were not finite; a zero row stands in for each",
                        who, int(np.sum(~finite)))
        rows = np.where(finite[:, None], rows, 0.0)
        integers = grid.to_integers(clip_rows(rows, grid.clip), generator)
        total = integers.sum(axis=0).astype(np.int64)
        return total + sample_discrete_gaussian(local_variance, dimension, generator)
