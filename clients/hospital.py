"""A hospital in high-dimensional PATE (framework-free; the Flower ClientApp wraps it).

It trains ``T = len(partitions)`` teachers, one per disjoint partition of its own patients (SPEC
section 2: a patient influences exactly one teacher), each fine-tuned from the public model the server
sends; keeps the weights on its own disk (``workdir/teachers``); answers queries by running every
teacher on the public scans and encoding the softmax output **locally** with the public codec
(:func:`sim.codecs.encode`: Fay et al., Algorithms 1-2, "compress the prediction"), so that only
``T x n x l`` bounded numbers leave the hospital. It never returns scans, labels, weights or
full-resolution outputs.

Optional local DP-SGD (``config["local_dp"]`` = DPConfig fields): the teacher weights then carry their
own add-remove guarantee, recorded in the hospital's own ledger ``workdir/ledger.jsonl``. Owners are
``"<hospital>/teacher-<k>"``: teachers see disjoint patients, so a patient's local guarantee is its own
teacher's (parallel composition); the reported local epsilon is the max over the hospital's teachers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np


class Hospital:
    def __init__(self, hospital_id: str, prepared, partitions, preset, workdir, seed: int = 0,
                 validation: list | None = None, deployed: bool = False):
        self.hospital_id = str(hospital_id)
        self.prepared = prepared
        self.partitions = [list(p) for p in partitions]
        self.preset = preset
        self.workdir = Path(workdir)
        self.seed = int(seed)
        self.validation = list(validation or [])
        #: a hospital on its own machine with its own patients (not a simulated node): refuses everything
        #: meant for simulations only (seeded noise, un-noised diagnostics)
        self.deployed = bool(deployed)
        self._models: dict[int, Any] = {}

    @property
    def num_teachers(self) -> int:
        return len(self.partitions)

    def _teacher_path(self, k: int) -> Path:
        return self.workdir / "teachers" / f"teacher-{k:03d}.pt"

    def _new_model(self):
        from sim.networks import build_unet

        return build_unet(self.preset.unet)

    def _teacher(self, k: int):
        import torch

        if k not in self._models:
            path = self._teacher_path(k)
            if not path.exists():
                from sim.errors import UserError

                raise UserError(f"hospital {self.hospital_id}: teacher {k} has not been trained ({path} missing)")
            model = self._new_model()
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            self._models[k] = model.eval()
        return self._models[k]

    # ----------------------------------------------------------------------------------------------
    def train_teachers(self, config: Mapping[str, Any] | None = None) -> dict:
        """Train (fine-tune) every teacher on its own partition; return metrics only."""
        import torch

        from sim.io import atomic_save_torch
        from sim.training import TrainConfig, evaluate_segmentation, train_segmentation

        config = dict(config or {})
        init = config.get("init_weights")
        init_state = {k: torch.as_tensor(np.asarray(v)) for k, v in init.items()} if init else None
        epochs = int(config.get("teacher_epochs", self.preset.teacher_epochs))
        seed = int(config.get("seed", self.seed))
        local_dp = config.get("local_dp")
        guard, ledger = None, None
        if local_dp:
            from privacy.guard import BudgetGuard
            from privacy.ledger import Ledger

            ledger = Ledger(self.workdir / "ledger.jsonl")
            guard = BudgetGuard(ledger, float(local_dp["epsilon"]), float(local_dp.get("delta", self.preset.delta)))
        fingerprint = self._training_fingerprint(init, epochs, seed, local_dp)
        cached = self._cached_training(fingerprint)
        if cached is not None:  # teachers do not depend on epsilon: reuse them across a comparison's cells
            return cached
        self._models.clear()
        validation_dice = []
        for k, case_ids in enumerate(self.partitions):
            model = self._new_model()
            dp = None
            if local_dp:
                from sim.dpsgd import DPConfig

                dp = DPConfig(**{**dict(local_dp), "release_prefix": f"{self.hospital_id}/teacher-{k}:dpsgd"})
            train = TrainConfig(epochs=epochs, batch_size=self.preset.batch_size,
                                learning_rate=self.preset.learning_rate, seed=seed * 1009 + k,
                                progress=False, init_from=init_state,
                                description=f"{self.hospital_id} teacher {k}")
            if case_ids and epochs > 0:
                result = train_segmentation(model, self.prepared.images(case_ids), self.prepared.labels(case_ids),
                                            train, dp=dp, guard=guard, owners=(f"{self.hospital_id}/teacher-{k}",))
                model = result.model
            elif init_state is not None:
                model.load_state_dict(init_state)
            atomic_save_torch(self._teacher_path(k), {n: t.detach().cpu() for n, t in model.state_dict().items()})
            self._models[k] = model.eval()
            if self.validation:
                dice = evaluate_segmentation(model, self.prepared.images(self.validation),
                                             self.prepared.labels(self.validation))
                validation_dice.append(dice.get("mean"))
        local_epsilon = None
        if ledger is not None and len(ledger):
            delta = float(local_dp.get("delta", self.preset.delta))
            local_epsilon = max(ledger.spent(owner, delta).epsilon for owner in ledger.owners())
        valid = [d for d in validation_dice if d is not None]
        metrics = {"hospital_id": self.hospital_id, "teachers": self.num_teachers,
                "patients": int(sum(len(p) for p in self.partitions)),
                "teacher_dice_validation": float(np.mean(valid)) if valid else None,
                "local_epsilon": local_epsilon,
                "local_delta": float(local_dp.get("delta", self.preset.delta)) if local_dp else None,
                "local_relation": "add-remove" if local_dp else None}
        from sim.io import atomic_write_json

        atomic_write_json(self.workdir / "teachers" / "training.json", {"fingerprint": fingerprint, "metrics": metrics})
        return metrics

    def _training_fingerprint(self, init, epochs: int, seed: int, local_dp) -> str:
        """Everything the trained teachers depend on (not epsilon: PATE's budget is spent at query time)."""
        import hashlib
        import json

        digest = hashlib.sha256()
        for name in sorted(init or {}):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(np.asarray(init[name])).tobytes())
        digest.update(json.dumps({"epochs": epochs, "seed": seed, "partitions": self.partitions,
                                  "unet": self.preset.unet, "lr": self.preset.learning_rate,
                                  "batch": self.preset.batch_size, "local_dp": local_dp,
                                  "grid": list(getattr(self.prepared, "grid", ()))},
                                 sort_keys=True, default=str).encode())
        return digest.hexdigest()

    def _cached_training(self, fingerprint: str) -> dict | None:
        import json

        record = self.workdir / "teachers" / "training.json"
        if not record.exists() or not all(self._teacher_path(k).exists() for k in range(self.num_teachers)):
            return None
        saved = json.loads(record.read_text())
        if saved.get("fingerprint") != fingerprint:
            return None
        self._models.clear()
        return {**saved["metrics"], "reused": True}

    def teacher_probs(self, k: int, scans: np.ndarray) -> np.ndarray:
        from sim.training import predict_probs

        return predict_probs(self._teacher(k), np.asarray(scans, np.float32), batch_size=2)

    def answer_query(self, scans: np.ndarray, codec: Mapping[str, np.ndarray], config: Mapping | None = None
                     ) -> np.ndarray:
        """(T, n, l) float32: every teacher's softmax output on the public ``scans``, encoded locally."""
        from sim.codecs import make_encoder

        scans = np.asarray(scans, np.float32)
        encode = make_encoder(codec)  # one autoencoder for all of this hospital's teachers
        rows = [encode(self.teacher_probs(k, scans)) for k in range(self.num_teachers)]
        return np.stack(rows).astype(np.float32)

    def ensemble_probability_sum(self, scans: np.ndarray) -> np.ndarray:
        """Sum of the teachers' probabilities (C, ...): a SIMULATION-ONLY diagnostic (the noise-free
        probability ensemble of SPEC section 11). Full-resolution: never exposed by the Flower app."""
        return sum(self.teacher_probs(k, scans) for k in range(self.num_teachers))

    def evaluate(self, config: Mapping[str, Any] | None = None) -> dict:
        """Per-teacher Dice (scalars only) on the public test scans + labels the server sends
        (``config["images"]``, ``config["labels"]``), else on this hospital's validation cases."""
        from sim.training import evaluate_segmentation

        config = dict(config or {})
        if config.get("images") is not None and config.get("labels") is not None:
            images, labels, on = np.asarray(config["images"], np.float32), np.asarray(config["labels"]), "public-test"
        elif self.validation:
            images, labels, on = self.prepared.images(self.validation), self.prepared.labels(self.validation), \
                "own-validation"
        else:
            return {"hospital_id": self.hospital_id, "teacher_dice": [], "teacher_dice_mean": None, "on": None}
        # Teachers do not change across a comparison's cells: evaluate each (teachers, test set) pair once.
        cache = self._evaluation_cache(images, labels)
        if cache is not None and cache.exists():
            import json

            return json.loads(cache.read_text())
        scores = [evaluate_segmentation(self._teacher(k), images, labels) for k in range(self.num_teachers)]
        means = [s.get("mean") for s in scores]
        valid = [m for m in means if m is not None]
        result = {"hospital_id": self.hospital_id, "teacher_dice": means,
                  "teacher_dice_mean": float(np.mean(valid)) if valid else None, "on": on}
        if cache is not None:
            from sim.io import atomic_write_json

            atomic_write_json(cache, result)
        return result

    def _evaluation_cache(self, images: np.ndarray, labels: np.ndarray):
        import hashlib
        import json

        record = self.workdir / "teachers" / "training.json"
        if not record.exists():
            return None
        fingerprint = json.loads(record.read_text()).get("fingerprint", "")
        digest = hashlib.sha256(fingerprint.encode())
        digest.update(np.ascontiguousarray(images).tobytes())
        digest.update(np.ascontiguousarray(labels).tobytes())
        return self.workdir / "teachers" / f"evaluation-{digest.hexdigest()[:16]}.json"
