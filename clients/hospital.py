"""A hospital in high-dimensional PATE (framework-free; the Flower ClientApp wraps it).

It trains ``T = len(partitions)`` teachers, one per disjoint partition of its own patients (a patient influences
exactly one teacher; docs/PRIVACY.md, "The unit of privacy"), each fine-tuned from the public model the server sends;
keeps the weights on its own disk (``workdir/teachers``); answers queries by running every teacher on the public scans
and encoding the softmax output **locally** with the public codec (:func:`task.codecs.encode`: Fay et al., Algorithms
1-2, "compress the prediction"), so that only ``T x n x l`` bounded numbers leave the hospital. It never returns
scans, labels, weights or full-resolution outputs.

Requests arrive as the frozen records of ``task.wire.requests`` (each handler reads its kind's ``from_config`` once,
first). Optional local DP-SGD (``TeacherTrainingRequest.local_dp`` = DPConfig fields): the teacher weights then carry their
own add-remove guarantee, recorded in the hospital's own ledger ``workdir/ledger.jsonl``. Owners are
``"<hospital>/teacher-<k>"``: teachers see disjoint patients, so a patient's local guarantee is its own
teacher's (parallel composition); the reported local epsilon is the max over the hospital's teachers.

The hospital owns its patients' budget (docs/PRIVACY.md, "Who is trusted"). Threat model: the aggregator is
trusted with the teachers' un-noised encodings; differential privacy protects the patients against
everyone who sees what the aggregator releases. The hospital still does not take the aggregator's word for
the accounting: before it answers a query batch it checks the codec it was sent
(:func:`task.codecs.verify_codec`), computes the replace-one sensitivity itself from that codec and the
number of teachers the server declares it will average (the server releases nothing when fewer answer),
and charges its **own** privacy ledger (``privacy_ledger``) through a guard with its lifetime budget,
refusing the batch if the budget would be exceeded. A deployed hospital (its own machine and patients)
also refuses everything meant for simulations only: un-noised diagnostic queries, per-teacher test Dice,
seeded noise.

Device and precision (``task.learning.device``): a simulated hospital trains, answers and evaluates on the
device and precision the run's messages name (``HospitalRequest.device`` / ``.precision``; default auto);
a deployed hospital on its own node config's (``device``, ``precision``), whatever the server says -- its GPU
is its own machine's. Teachers are kept on disk on the host and loaded onto that device; the codec's
autoencoder encodes there too (``task.codecs.make_encoder``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from privacy.events import GaussianEvent
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from clients.replay import AnswerBook, legacy_request_key, mint_nonce, request_key
from task.learning.compute import Compute
from task import codecs  # codec_sensitivity through the module: the one function server and hospitals share
from task.codecs import CodecPolicy, fallback_encoding, make_encoder, verify_codec
from task.learning.device import check_device_spec, check_precision, resolve_device
from task.learning.dpsgd import DPConfig, private_training
from task.errors import UserError
from task.names import check_name_part
from task.io import atomic_save_torch, atomic_write_json
from task.learning.networks import StackedVoxelHeads, VoxelHeadUNet, build_unet, load_start_weights
from task.options import Trainable
from task.wire.requests import (EvaluationRequest, HospitalRequest, QueryRequest, TeacherTrainingRequest,
                                read_request_as)
from task.learning.training import (TrainConfig, dice_of_labels, dice_of_probabilities, evaluate_segmentation,
                                    predict_probs, stacked_head_probabilities, stacked_training_applies,
                                    train_segmentation, train_stacked_voxel_heads)


#: how ``teachers/training.json`` records where the teachers are: one file of stacked voxel heads, or one per teacher
STACKED_STORAGE, TEACHER_FILES_STORAGE = "voxel-heads", "teacher-files"


@dataclass(frozen=True)
class HospitalSettings:
    """A hospital's own settings (a deployed hospital's node config, ``clients.node``; a simulated one's
    defaults), validated when built.

    ``seed``: its teachers' training seed when a request names none. ``deployed``: a hospital on its own
    machine with its own patients (not a simulated node), which refuses everything meant for simulations only
    (seeded noise, un-noised diagnostics) and ignores the privacy settings a simulation's messages carry.
    ``privacy_ledger``: its own ledger of everything released from its patients (None:
    ``workdir/privacy-ledger.jsonl``), enforcing ``lifetime_epsilon`` at ``delta`` (None: the preset's δ).
    ``codec_policy``: the codecs it answers through (None: ``task.codecs.CodecPolicy()``). ``max_teachers``:
    the most teachers the consortium has (node config ``max-teachers``), the largest K a server may declare --
    a query's sensitivity is 2C/K for the declared K, so without this bound a server declaring K = 1e9 would
    make it charge almost nothing. ``device`` / ``precision``: its own compute (None: the run's, else auto)."""

    seed: int = 0
    deployed: bool = False
    privacy_ledger: str | Path | None = None
    lifetime_epsilon: float | None = None
    delta: float | None = None
    codec_policy: CodecPolicy | None = None
    max_teachers: int | None = None
    device: str | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "deployed", bool(self.deployed))
        if self.lifetime_epsilon is not None:
            object.__setattr__(self, "lifetime_epsilon", float(self.lifetime_epsilon))
            if not self.lifetime_epsilon > 0:
                raise UserError(f"epsilon-budget: expected a positive number, got {self.lifetime_epsilon}")
        if self.delta is not None and not 0 < float(self.delta) < 1:
            raise UserError(f"delta: expected a number in (0, 1), got {self.delta}")
        if self.max_teachers is not None:
            object.__setattr__(self, "max_teachers", int(self.max_teachers))
            if self.max_teachers < 1:
                raise UserError(f"max-teachers: expected a positive integer, got {self.max_teachers}")
        if self.device is not None:
            object.__setattr__(self, "device", check_device_spec(self.device, "node-config device"))
        if self.precision is not None:
            object.__setattr__(self, "precision", check_precision(self.precision, "node-config precision"))


class Hospital:
    def __init__(self, hospital_id: str, prepared, partitions, preset, workdir,
                 settings: HospitalSettings | None = None, validation: list | None = None):
        own = settings or HospitalSettings()
        #: names files (``<ledger_dir>/<id>.jsonl``) and the ledger's owner: a plain name part, never a path
        self.hospital_id = check_name_part(str(hospital_id), "hospital id")
        self._lifetime_ledgers: dict[Path, Ledger] = {}   # lifetime_guard's ledgers, kept and refreshed
        self.prepared = prepared
        self.partitions = [list(p) for p in partitions]
        self.preset = preset
        self.workdir = Path(workdir)
        self.settings = own
        self.seed = own.seed
        self.validation = list(validation or [])
        self.deployed = own.deployed
        self.privacy_ledger = Path(own.privacy_ledger) if own.privacy_ledger else self.workdir / "privacy-ledger.jsonl"
        self.lifetime_epsilon = own.lifetime_epsilon
        self.delta = float(own.delta if own.delta is not None else preset.delta)
        self.codec_policy = own.codec_policy or CodecPolicy()
        self.max_teachers = own.max_teachers
        self.device, self.precision = own.device, own.precision
        self._models: dict[int, Any] = {}
        #: (the U-Net every teacher shares, their StackedVoxelHeads) once loaded or checked; False: checked, they
        #: do not share one (see _stacked_teachers)
        self._stack: tuple | bool | None = None
        self._saved_heads: dict | None = None   # the stacked heads' file as read (see _load_stacked_file)
        #: simulation-only diagnostics already computed for the current teachers (see _diagnostic_pass)
        self._diagnostics: dict[str, Any] = {}

    @property
    def num_teachers(self) -> int:
        return len(self.partitions)

    def has_trained_teachers(self) -> bool:
        """Whether every teacher's weights are on this hospital's disk (one file per teacher, or every voxel head in
        one file)."""
        if self._kept_stacked():
            return self._heads_path().exists()
        return all(self._teacher_path(k).exists() for k in range(self.num_teachers))

    def _teacher_path(self, k: int) -> Path:
        return self.workdir / "teachers" / f"teacher-{k:03d}.pt"

    def _heads_path(self) -> Path:
        """Where voxel-head teachers trained together keep their heads, stacked, beside the U-Net they share."""
        return self.workdir / "teachers" / "voxel-heads.pt"

    def _kept_stacked(self) -> bool:
        """Whether the current teachers are kept as one file of stacked heads. ``teachers/training.json`` says how the
        training that wrote it kept them (a record without ``storage``: one file per teacher, as every training did
        before stacked heads); without a record (teachers put there by hand), whether the heads' file exists."""
        record = self.workdir / "teachers" / "training.json"
        if record.exists():
            return json.loads(record.read_text()).get("storage") == STACKED_STORAGE
        return self._heads_path().exists()

    def _drop_loaded(self) -> None:
        """Forget the teachers held in memory (read from disk again when next needed)."""
        self._models.clear()
        self._stack = None
        self._saved_heads = None

    def _forget_teachers(self) -> None:
        """Before a training: nothing of the previous teachers is kept in memory or counts as trained on disk (a
        training that stops half-way leaves no record that could pass it off as the earlier teachers)."""
        self._drop_loaded()
        self._diagnostics.clear()
        for path in [self.workdir / "teachers" / "training.json", self._heads_path(),
                     *(self._teacher_path(k) for k in range(self.num_teachers))]:
            path.unlink(missing_ok=True)

    def _new_model(self, trainable: Trainable = Trainable.ALL):
        """A teacher's network: the preset's U-Net, with a voxel head when the teachers train one."""
        return build_unet(self.preset.unet, trainable=trainable)

    def read_request(self, kind: type[HospitalRequest], config) -> Any:
        """``config`` as a request of ``kind`` (``kind.from_config``); a malformed one is refused naming this
        hospital and the key."""
        return read_request_as(self.hospital_id, kind, config)

    def compute(self, config: HospitalRequest | Mapping[str, Any] | None = None) -> tuple[Any, str]:
        """(torch.device, precision) for one request: a deployed hospital's own node config; a simulated one
        the run's (the request's ``device`` / ``precision``), else its own settings', else auto / 32."""
        request = self.read_request(HospitalRequest, config)
        if self.deployed:
            device, precision = self.device, self.precision
        else:
            device = request.device or self.device
            precision = request.precision or self.precision
        return resolve_device(device or "auto"), check_precision(precision or "32")

    def _teacher(self, k: int, device=None):
        if k not in self._models:
            stacked = self._kept_stacked()
            path = self._heads_path() if stacked else self._teacher_path(k)
            if not path.exists():
                raise UserError(f"hospital {self.hospital_id}: teacher {k} has not been trained ({path} missing)")
            try:
                if stacked:   # one voxel-head teacher of several trained together
                    saved = self._load_stacked_file()
                    state = {**saved["unet"], **{name: value[k] for name, value in saved["heads"].items()}}
                else:
                    state = torch.load(path, map_location="cpu", weights_only=True)
                # a saved teacher says what it is: its weights hold a voxel head or not
                model = self._new_model(Trainable.VOXEL_HEAD if any(name.startswith("voxel_head.") for name in state)
                                        else Trainable.ALL)
                model.load_state_dict(state)
            except UserError:
                raise
            except Exception as exc:   # a torn or foreign file: this hospital cannot answer with it
                raise self._unreadable(k, path, exc) from None
            self._models[k] = model.eval()
        model = self._models[k]
        return model if device is None else model.to(device)

    def _unreadable(self, k: int, path: Path, exc: Exception) -> UserError:
        return UserError(f"hospital {self.hospital_id}: cannot load teacher {k} from {path} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")

    def _load_stacked_file(self) -> dict:
        """The stacked heads' file: ``{"unet": U-Net state, "heads": voxel_head.* entries with a leading axis of
        K}``; UserError when it is torn, foreign or holds another number of teachers."""
        if self._saved_heads is not None:
            return self._saved_heads
        path = self._heads_path()
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            counts = {len(value) for value in saved["heads"].values()}
            if not isinstance(saved.get("unet"), dict) or counts != {self.num_teachers}:
                raise ValueError(f"heads for {sorted(counts)} teachers, this hospital has {self.num_teachers}")
        except Exception as exc:
            raise self._unreadable(0, path, exc) from None
        self._saved_heads = saved
        return saved

    def _stacked_teachers(self, device) -> tuple | None:
        """(the U-Net every teacher shares, their :class:`task.learning.networks.StackedVoxelHeads`) on ``device``, or None
        when the teachers do not share one U-Net bit for bit, or when a subclass answers with teachers of its own.

        Teachers trained together (one heads file) share it by construction; teachers trained one by one (each its
        own file, e.g. under local DP-SGD) are compared weight by weight once, when loaded -- not at every query."""
        if type(self).teacher_probs is not Hospital.teacher_probs or self.num_teachers == 0:
            return None
        if self._stack is None:
            if self._kept_stacked():
                saved = self._load_stacked_file()
                with torch.random.fork_rng(devices=[]):   # building the modules draws nothing from the run's generator
                    unet = self._new_model(Trainable.VOXEL_HEAD)
                    unet.load_state_dict({**saved["unet"], **{n: v[0] for n, v in saved["heads"].items()}})
                    heads = StackedVoxelHeads.from_heads([unet.voxel_head] * self.num_teachers)
                heads.load_head_states([{n: v[k] for n, v in saved["heads"].items()}
                                        for k in range(self.num_teachers)])
                self._stack = (unet.model.eval(), heads.eval())
            else:
                self._stack = self._shared_unet_of_files()
        if self._stack is False:
            return None
        unet, heads = self._stack
        return unet.to(device), heads.to(device)

    def _shared_unet_of_files(self) -> tuple | bool:
        """Teachers in files of their own: (their shared U-Net, their heads stacked) when every one is a voxel-head
        teacher on the same U-Net weights, else False."""
        models = [self._teacher(k) for k in range(self.num_teachers)]
        if not all(isinstance(model, VoxelHeadUNet) for model in models):
            return False
        reference = models[0].model.state_dict()
        for model in models[1:]:
            state = model.model.state_dict()
            if state.keys() != reference.keys() or not all(torch.equal(state[n], reference[n]) for n in reference):
                return False
        return models[0].model, StackedVoxelHeads.from_heads([model.voxel_head for model in models]).eval()

    def load_teachers(self, config: HospitalRequest | Mapping[str, Any] | None = None) -> None:
        """Load every teacher onto this request's device; UserError when one is missing or unreadable.

        A query batch calls it before it charges the ledger: a hospital that cannot answer (never trained, or a
        teacher's file lost or torn) refuses and spends nothing. A hospital whose teachers are not files (a test
        or an audit's fixed answers, which override :meth:`teacher_probs`) overrides this too."""
        device = self.compute(config)[0]
        if self._kept_stacked() and self._stacked_teachers(device) is not None:
            return
        for k in range(self.num_teachers):
            self._teacher(k, device)

    # ----------------------------------------------------------------------------------------------
    def train_teachers(self, config: TeacherTrainingRequest | Mapping[str, Any] | None = None) -> dict:
        """Train (fine-tune) every teacher on its own partition; return metrics only."""

        request = self.read_request(TeacherTrainingRequest, config)
        init = request.init_weights
        init_state = {k: torch.as_tensor(np.asarray(v)) for k, v in init.items()} if init else None
        # the server's recipe, whole (the request refuses a missing field): what a teacher trains
        # (docs/decisions/teachers.md) -- every weight, or a voxel head on the frozen public model
        # (task.learning.networks.VoxelHeadUNet) -- for how many epochs, at which learning rate and batch size, with or without
        # augmentation
        epochs, trainable = request.teacher_epochs, request.teacher_trainable
        learning_rate, augment = float(request.teacher_learning_rate), bool(request.teacher_augment)
        batch_size = request.teacher_batch_size
        seed = self.seed if request.seed is None else request.seed
        local_dp = request.local_dp
        device, precision = self.compute(request)
        guard, ledger, local_dpsgd = None, None, None
        if local_dp:
            local_dpsgd = self._local_dpsgd(local_dp)   # refused here, before anything is forgotten or trained
            ledger = Ledger(self.workdir / "ledger.jsonl")
            guard = BudgetGuard(ledger, float(local_dp["epsilon"]), float(local_dp["delta"]))
        fingerprint = self._training_fingerprint(init, epochs, seed, local_dp,
                                                 {"trainable": trainable, "lr": learning_rate, "augment": augment,
                                                  "batch": batch_size, "precision": precision})
        cached = self._cached_training(fingerprint)
        if cached is not None:  # teachers do not depend on epsilon: reuse them across a comparison's cells
            return cached       # (an identical request gets the identical teachers: no new noise is drawn)
        self._forget_teachers()
        # every training that runs is a new release of the patients: its local-DP release ids
        # carry a nonce this hospital mints, so retraining -- another seed, a cleared cache -- is charged again
        nonce = mint_nonce()
        validation = ((self.prepared.images(self.validation), self.prepared.labels(self.validation))
                      if self.validation else None)   # read once, not once per teacher
        train = TrainConfig(epochs=epochs, batch_size=batch_size, learning_rate=learning_rate,
                            seed=seed * 1009, trainable=trainable, augment=augment, init_from=init_state,
                            description=f"{self.hospital_id} teachers",
                            compute=Compute(device=device, precision=precision, progress=False))
        first = self._new_model(trainable)   # teacher 0's network, drawn first by either way of training
        if (not local_dp and init_state is not None and self.num_teachers > 0
                and stacked_training_applies(first, train, None)):
            validation_dice = self._train_stacked_teachers(first, train, seed, validation)
        else:
            validation_dice = self._train_each_teacher(first, train, seed, local_dpsgd, guard, nonce, validation)
        local_epsilon = None
        if ledger is not None and len(ledger):
            delta = float(local_dp["delta"])
            local_epsilon = max(ledger.spent(owner, delta).epsilon for owner in ledger.owners())
        valid = [d for d in validation_dice if d is not None]
        metrics = {"hospital_id": self.hospital_id, "teachers": self.num_teachers,
                "patients": int(sum(len(p) for p in self.partitions)),
                # un-noised: only simulated hospitals report it
                "teacher_dice_validation": float(np.mean(valid)) if valid and not self.deployed else None,
                "local_epsilon": local_epsilon,
                "local_delta": float(local_dp["delta"]) if local_dp else None,
                # the relation the teachers' epochs were charged under (DPConfig's: replace-one unless local_dp
                # names another)
                "local_relation": local_dpsgd.relation.value if local_dpsgd else None,
                "device": str(device), "precision": precision}

        atomic_write_json(self.workdir / "teachers" / "training.json",
                          {"fingerprint": fingerprint, "metrics": metrics,
                           "storage": STACKED_STORAGE if self._heads_path().exists() else TEACHER_FILES_STORAGE})
        return metrics

    def _train_each_teacher(self, first, train: TrainConfig, seed: int, local_dpsgd: DPConfig | None, guard,
                            nonce: str, validation) -> list:
        """One :func:`task.learning.training.train_segmentation` per teacher (every teacher of a hospital whose teachers cannot
        be trained as stacked heads: full fine-tuning, augmentation, local DP-SGD -- each teacher its own Opacus
        session, Poisson sampling, noise stream and ledger owner); each saved to its own file. Returns each
        teacher's validation Dice (empty without validation cases). ``local_dpsgd``: the teachers' local DP-SGD
        (:meth:`_local_dpsgd`), each teacher's release ids and noise streams its own; None: no local DP-SGD."""
        validation_dice = []
        epochs, init_state = train.epochs, train.init_from
        for k, case_ids in enumerate(self.partitions):
            model = first if k == 0 else self._new_model(train.trainable)
            dp = None
            if local_dpsgd is not None:
                dp = replace(local_dpsgd, release_prefix=f"{self.hospital_id}/teacher-{k}:dpsgd@{nonce}",
                             stream_prefix=f"{self.hospital_id}/teacher-{k}:dpsgd")
            config = replace(train, seed=seed * 1009 + k, description=f"{self.hospital_id} teacher {k}")
            if case_ids and epochs > 0:
                result = train_segmentation(model, self.prepared.images(case_ids), self.prepared.labels(case_ids),
                                            config, private_training(dp, guard, owners=(f"{self.hospital_id}/teacher-{k}",)))
                model = result.model
            elif init_state is not None:
                load_start_weights(model, init_state)
            model.to(resolve_device(config.compute.device))
            atomic_save_torch(self._teacher_path(k), {n: t.detach().cpu() for n, t in model.state_dict().items()},
                              private=True)   # a teacher has no privacy guarantee: it stays with its hospital
            self._models[k] = model.eval()
            if validation is not None:
                dice = evaluate_segmentation(model, validation[0], validation[1], precision=config.compute.precision)
                validation_dice.append(dice.get("mean"))
        return validation_dice

    def _local_dpsgd(self, local_dp: Mapping[str, Any]) -> DPConfig:
        """The teachers' local DP-SGD as the request states it (``local_dp``: DPConfig fields), validated once before
        anything trains; a field DPConfig does not have, or a value it refuses, is refused in one line."""
        try:
            return DPConfig(**dict(local_dp))
        except TypeError as exc:   # a key that is not a DPConfig field
            raise UserError(f"hospital {self.hospital_id}: local_dp: {exc}") from None
        except UserError as exc:
            raise UserError(f"hospital {self.hospital_id}: local_dp: {exc}") from None

    def _train_stacked_teachers(self, first, train: TrainConfig, seed: int, validation) -> list:
        """Every voxel-head teacher of this hospital at once (:func:`task.learning.training.train_stacked_voxel_heads`): the
        frozen public U-Net's output computed once per patient, the K heads as stacked parameters with one loss per
        teacher and one optimiser; the heads saved as one file beside the U-Net they share. The same training as
        :meth:`_train_each_teacher`'s, up to float summation order (tests/test_voxel_head.py). Returns each teacher's
        validation Dice (empty without validation cases)."""
        heads = []
        for k, case_ids in enumerate(self.partitions):
            # teacher k starts where the per-teacher loop has always started it: a new network drawn from the global
            # generator as teacher k - 1's training left it (seeded with that teacher's seed), then the start weights
            # loaded into it -- so both ways train the same heads from the same start
            model = first if k == 0 else self._new_model(train.trainable)
            load_start_weights(model, train.init_from)
            heads.append(model.voxel_head)
            if case_ids and train.epochs > 0:
                torch.manual_seed(seed * 1009 + k)   # what train_segmentation seeds before teacher k trains
        stacked = StackedVoxelHeads.from_heads(heads)
        cases = [case for case_ids in self.partitions for case in case_ids]
        starts = np.cumsum([0] + [len(case_ids) for case_ids in self.partitions])
        if cases:
            train_stacked_voxel_heads(first.model, stacked, self.prepared.images(cases), self.prepared.labels(cases),
                                      [range(starts[k], starts[k + 1]) for k in range(self.num_teachers)],
                                      [seed * 1009 + k for k in range(self.num_teachers)], train)
        unet_state = {n: t.detach().cpu() for n, t in first.state_dict().items() if not n.startswith("voxel_head.")}
        # a teacher has no privacy guarantee: its head stays with its hospital
        atomic_save_torch(self._heads_path(), {"unet": unet_state, "heads": stacked.stacked_state()}, private=True)
        device, precision = resolve_device(train.compute.device), train.compute.precision
        self._stack = (first.model.to(device).eval(), stacked.to(device).eval())
        if validation is None:
            return []
        return [dice_of_probabilities(probs.cpu().numpy(), validation[1]).get("mean")
                for _, group in stacked_head_probabilities(*self._stack, validation[0], device=device,
                                                            precision=precision)
                for probs in group]

    def _training_fingerprint(self, init, epochs: int, seed: int, local_dp, how: Mapping[str, Any]) -> str:
        """Everything the trained teachers depend on (not epsilon: PATE's budget is spent at query time);
        ``how``: what they train, at which learning rate and batch size, with or without augmentation, at which
        precision (bf16 teachers are other teachers than float32 ones). Not the device or the thread count: they
        change the last bits of the float arithmetic, not what was asked for."""

        digest = hashlib.sha256()
        for name in sorted(init or {}):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(np.asarray(init[name])).tobytes())
        digest.update(json.dumps({"epochs": epochs, "seed": seed, "partitions": self.partitions,
                                  "unet": self.preset.unet, **dict(how), "local_dp": local_dp,
                                  "grid": list(getattr(self.prepared, "grid", ()))},
                                 sort_keys=True, default=str).encode())
        return digest.hexdigest()

    def _cached_training(self, fingerprint: str) -> dict | None:
        record = self.workdir / "teachers" / "training.json"
        if not record.exists() or not self.has_trained_teachers():
            return None
        saved = json.loads(record.read_text())
        if saved.get("fingerprint") != fingerprint:
            return None
        self._drop_loaded()
        return {**saved["metrics"], "reused": True}

    def teacher_probs(self, k: int, scans: np.ndarray, config: HospitalRequest | Mapping[str, Any] | None = None
                      ) -> np.ndarray:
        device, precision = self.compute(config)
        return predict_probs(self._teacher(k, device), np.asarray(scans, np.float32), batch_size=2, device=device,
                             precision=precision)

    def each_teacher_probs(self, scans: np.ndarray, config: HospitalRequest | Mapping[str, Any] | None = None
                           ) -> Iterator[np.ndarray]:
        """:meth:`teacher_probs` of teacher 0, 1, ..., K-1 on ``scans``, in that order, as host arrays (the same
        arrays up to float summation order for voxel-head teachers, :meth:`teacher_probability_groups`)."""
        for _, probs in self.teacher_probability_groups(scans, config):
            for one in probs:
                yield one.cpu().numpy() if isinstance(one, torch.Tensor) else one

    def teacher_probability_groups(self, scans: np.ndarray, config: HospitalRequest | Mapping[str, Any] | None = None
                                   ) -> Iterator[tuple[range, Any]]:
        """Every teacher's softmax output on ``scans`` as ``(teachers k, probabilities (len(k), n, C, *g))`` for
        consecutive groups of teachers, in teacher order.

        Voxel-head teachers (docs/decisions/teachers.md) are the public model's frozen U-Net plus a head each, so
        when they share the U-Net bit for bit it runs once per scan for all of them and the heads of a group run as
        one batched product on the device, their outputs left there as one tensor
        (:func:`task.learning.training.stacked_head_probabilities`: what :meth:`teacher_probs` gives, up to float summation
        order). Teachers that differ anywhere in the U-Net, and hospitals that answer with other teachers (a
        subclass's :meth:`teacher_probs`), are run one by one, each group one teacher's host array."""
        scans = np.asarray(scans, np.float32)
        device, precision = self.compute(config)
        stacked = self._stacked_teachers(device)
        if stacked is None:
            for k in range(self.num_teachers):
                yield range(k, k + 1), self.teacher_probs(k, scans, config)[None]
            return
        yield from stacked_head_probabilities(*stacked, scans, batch_size=2, device=device, precision=precision)

    def encoded_answers(self, scans: np.ndarray, request: HospitalRequest, codec, encode, probability_sum: bool = False
                         ) -> tuple[np.ndarray | None, int, np.ndarray | None]:
        """(every teacher's encoded rows (K, n, l) float32 or None without ``encode``, how many teachers answered
        the fixed fallback row, the teachers' probability sum (C, ...) float64 when asked).

        A group of teachers is encoded where its outputs lie (``encode.many``: one transfer of rows per group, not
        one of probabilities per teacher); a teacher whose output is not finite answers the codec's fallback row,
        and only their count leaves the hospital."""
        rows: list = [None] * self.num_teachers
        fallbacks, total = 0, None
        for teachers, probs in self.teacher_probability_groups(scans, request):
            if probability_sum:   # float64, including unusable teachers, as the diagnostic has always summed
                part = (probs.double().sum(0) if isinstance(probs, torch.Tensor)
                        else probs.astype(np.float64).sum(0))
                total = part if total is None else total + part
            if encode is None:
                continue
            finite = (torch.isfinite(probs).flatten(1).all(1).tolist() if isinstance(probs, torch.Tensor)
                      else np.isfinite(probs).reshape(len(probs), -1).all(1).tolist())
            usable = [i for i, ok in enumerate(finite) if ok]
            if usable:
                chosen = probs if len(usable) == len(probs) else probs[usable]
                for i, row in zip(usable, encode.many(chosen)):
                    rows[teachers[i]] = row
            for i in (i for i, ok in enumerate(finite) if not ok):
                rows[teachers[i]] = fallback_encoding(codec, len(scans))
                fallbacks += 1
        if isinstance(total, torch.Tensor):
            total = total.cpu().numpy()
        return (np.stack(rows).astype(np.float32) if encode is not None else None), fallbacks, total

    # ----------------------------------------------------------------------------------------------
    def lifetime_guard(self, config: HospitalRequest | Mapping[str, Any] | None = None):
        """A guard over this hospital's own ledger with its lifetime budget, re-read from disk (other runs
        or processes may have appended). A deployed hospital uses its node config only; a simulated one
        keeps its ledger where the simulation says (``ledger_dir``, e.g. one comparison's folder) with the
        simulation's ``lifetime_epsilon`` and ``delta``."""

        request = HospitalRequest() if self.deployed else self.read_request(HospitalRequest, config)
        path = (Path(request.ledger_dir) / f"{self.hospital_id}.jsonl" if request.ledger_dir
                else self.privacy_ledger)
        budget = self.lifetime_epsilon if request.lifetime_epsilon is None else request.lifetime_epsilon
        if budget is None:
            raise UserError(f"hospital {self.hospital_id}: no lifetime privacy budget configured "
                            "(node-config epsilon-budget, or the simulation's lifetime epsilon)")
        # one Ledger per file for this hospital's lifetime, refreshed from disk at every use: its accountant
        # cache then composes only what was appended (re-reading and re-composing a comparison's few hundred
        # releases cost seconds per round)
        ledger = self._lifetime_ledgers.get(path)
        if ledger is None:
            ledger = self._lifetime_ledgers[path] = Ledger(path)
        else:
            ledger.refresh()
        return BudgetGuard(ledger, {self.hospital_id: float(budget)},
                           float(self.delta if request.delta is None else request.delta))

    def answer_query(self, scans: np.ndarray, codec: Mapping[str, np.ndarray],
                     config: QueryRequest | Mapping[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """(T, n, l) float32 encodings of every teacher's softmax output on the public ``scans``, plus what
        the hospital may say about them (``{"fallback_teachers": count}``).

        A normal query batch (:class:`task.wire.requests.QueryRequest`) must declare ``release_ids`` (one per scan),
        ``sigma`` and ``teachers`` (the K the server will average, or release nothing): the hospital verifies
        the codec, loads its teachers
        (refusing, uncharged, when it has none to answer with), charges ``GaussianEvent(S, sigma)`` per release to its own ledger with ``S`` computed from the verified codec
        and K, and only then runs its teachers. A ``diagnostic`` request (an un-noised query, simulation
        only) is refused by a deployed hospital and charged nothing (it is reported as not private).
        """

        request = self.read_request(QueryRequest, config)
        scans = np.asarray(scans, np.float32)
        # everything is validated before anything is charged: a request that cannot be answered costs nothing
        codec = verify_codec(codec, self._codec_policy(request), scans_shape=scans.shape)
        # one encoder for all of this hospital's teachers (verify_codec already refused a state that cannot build one)
        encode = make_encoder(codec, self.compute(request)[0])
        if request.diagnostic:
            if self.deployed:
                raise UserError(f"hospital {self.hospital_id}: refuses un-noised diagnostic queries "
                                "(simulation only)")
            return self._diagnostic_pass(scans, request, codec, encode)
        release_ids, sigma, teachers = self._query_declaration(request, len(scans))
        # a genuine retry (the identical request to the same teachers) gets the identical earlier answer
        inputs = {"scans": scans, **{f"codec.{n}": v for n, v in codec.items()}}
        fingerprint = self._teachers_fingerprint()
        asked = (inputs, {"release_ids": release_ids, "sigma": sigma, "teachers": teachers,
                          "teachers_trained": fingerprint or ""})
        key = request_key("query", *asked)
        answered = self.answers.lookup(key, legacy_request_key("query", *asked))
        if answered is not None:
            return answered[0]["rows"], answered[1]
        self.load_teachers(request)   # a hospital that cannot answer refuses before it is charged
        self._charge_query(codec, request, release_ids, sigma, teachers)
        rows, notes = self._encoded_rows_once(inputs, fingerprint, request, codec, encode)
        self.answers.store(key, {"rows": rows}, notes)
        return rows, notes

    def _encoded_rows_once(self, inputs: Mapping[str, np.ndarray], fingerprint: str | None, request: HospitalRequest,
                           codec, encode) -> tuple[np.ndarray, dict]:
        """The teachers' encoded rows for ``inputs`` (the query's scans and codec arrays, as its request key holds
        them) and the notes that go with them, computed once for the teachers trained as ``fingerprint`` says and kept
        in the answer book; called only after the batch has been charged.

        Why: a comparison's PATE cells (one per budget) ask the same teachers about the same public query scans with
        the same public codec; only the release ids and σ differ, and σ only scales the noise the aggregator adds to
        the mean, so the rows are the same (52-54 s of each budget's cell at the quick preset). What is kept is what
        the answer book keeps of every answered batch already, under a key without the release ids and σ: nothing
        new reaches the disk. Keyed on the teachers' training fingerprint (retrained teachers run again) and the
        compute settings; teachers with no training record (put in place by hand) always run."""
        key = (None if not fingerprint
               else request_key("encoded-rows", inputs, self._outputs_depend_on(fingerprint, request)))
        kept = None if key is None else self.answers.lookup(key)
        if kept is not None:
            return kept[0]["rows"], kept[1]
        rows, fallbacks, _ = self.encoded_answers(inputs["scans"], request, codec, encode)
        notes = {"fallback_teachers": fallbacks}
        if key is not None:
            self.answers.store(key, {"rows": rows}, notes)
        return rows, notes

    def _diagnostic_pass(self, scans: np.ndarray, request: HospitalRequest, codec=None, encode=None
                         ) -> tuple[np.ndarray, dict]:
        """SIMULATION ONLY: every teacher run once over ``scans`` for the un-noised diagnostics -- the encoded
        rows of a diagnostic query (when ``codec`` is given) and the teachers' probability sum
        (:meth:`ensemble_probability_sum`) -- remembered for these teachers, these scans and this codec.

        Why: a comparison's PATE cells (one per epsilon) ask both diagnostics of the same trained teachers on
        the same test scans with the same public codec; each pass ran all K teachers over the test set (36 s
        and 68 s of a 320 s cell, measured with cProfile). Nothing here is released or charged: the memo only
        spares recomputing what is already known, and is keyed on the teachers' training fingerprint, so
        retrained teachers are run again. The memo is also kept on the hospital's disk (:meth:`_diagnostics_kept`,
        owner-only), so a comparison's later cells, run in other processes, read it instead of running every
        teacher again (18 s of each quick PATE cell); teachers without a training record are not kept there."""
        recorded = self._teachers_fingerprint()
        scans_key = request_key("diagnostic", {"scans": scans}, self._outputs_depend_on(recorded, request))
        codec_key = None if codec is None else request_key(
            "diagnostic-codec", {f"codec.{n}": v for n, v in codec.items()}, {"scans": scans_key})
        memo = self._diagnostics
        if memo.get("scans") != scans_key:
            memo.clear()
            memo["scans"] = scans_key
        kept = self._diagnostics_kept() if recorded else None
        if "probability_sum" not in memo and kept is not None:
            found = kept.lookup(scans_key)
            if found is not None:
                memo["probability_sum"] = found[0]["probability_sum"]
        if codec_key is not None and codec_key not in memo and kept is not None and "probability_sum" in memo:
            found = kept.lookup(codec_key)
            if found is not None:
                memo[codec_key] = (found[0]["rows"], dict(found[1]))
        if codec_key is not None and codec_key in memo:
            return memo[codec_key]
        if codec_key is None and "probability_sum" in memo:
            return memo["probability_sum"], {}
        rows, fallbacks, total = self.encoded_answers(scans, request, codec, encode, probability_sum=True)
        memo["probability_sum"] = total
        if kept is not None:
            kept.store(scans_key, {"probability_sum": total}, {})
        if codec_key is None:
            return total, {}
        memo[codec_key] = (rows, {"fallback_teachers": fallbacks})
        if kept is not None:
            kept.store(codec_key, {"rows": rows}, {"fallback_teachers": fallbacks})
        return memo[codec_key]

    def _outputs_depend_on(self, fingerprint: str | None, request: HospitalRequest) -> dict:
        """What the teachers' outputs on given inputs depend on besides them, for the keys under which they are kept:
        the teachers' training fingerprint ("" without a record) and the compute settings (device and precision)."""
        return {"teachers_trained": fingerprint or "", "compute": list(map(str, self.compute(request)))}

    def _diagnostics_kept(self) -> AnswerBook:
        """Where :meth:`_diagnostic_pass` keeps what it computed (``workdir/diagnostics``, owner-only): un-noised
        outputs of the teachers, which stay with their hospital as the teachers do."""
        return AnswerBook(self.workdir / "diagnostics")

    @property
    def answers(self) -> AnswerBook:
        """What this hospital has answered (``workdir/answers``): repeats get the same answer."""
        return AnswerBook(self.workdir / "answers")

    def _teachers_fingerprint(self) -> str | None:
        """What the trained teachers depend on (``teachers/training.json``), None before any training."""
        record = self.workdir / "teachers" / "training.json"
        return json.loads(record.read_text()).get("fingerprint", "") if record.exists() else None

    def _codec_policy(self, request: HospitalRequest):
        """A deployed hospital's own policy (node config); a simulated one takes the simulation's (when its
        messages set ``allow_identity``)."""

        if self.deployed or request.allow_identity is None:
            return self.codec_policy
        return CodecPolicy(max_latent_dim=(self.codec_policy.max_latent_dim if request.max_latent_dim is None
                                           else request.max_latent_dim),
                           allow_identity=request.allow_identity)

    def _query_declaration(self, request: QueryRequest, scans: int) -> tuple[list[str], float, int]:
        """(release ids, sigma, K) a query batch declares (``sigma`` > 0 already checked by the request),
        checked against what this hospital knows."""

        release_ids, sigma, teachers = list(request.release_ids), request.sigma, request.teachers
        if len(release_ids) != scans or len(set(release_ids)) != scans:
            raise UserError(f"hospital {self.hospital_id}: {scans} scans need {scans} distinct release ids, "
                            f"got {len(release_ids)}")
        if teachers < self.num_teachers:
            raise UserError(f"hospital {self.hospital_id}: the server declares K={teachers} teachers, fewer "
                            f"than this hospital's own {self.num_teachers}")
        if self.max_teachers is not None and teachers > self.max_teachers:
            # the sensitivity 2C/K shrinks with the K the server declares: a hospital bounds K itself
            raise UserError(f"hospital {self.hospital_id}: the server declares K={teachers} teachers, more than "
                            f"the consortium's {self.max_teachers} (node-config max-teachers)")
        return release_ids, sigma, teachers

    def _charge_query(self, codec: Mapping[str, np.ndarray], request: QueryRequest, release_ids: list[str],
                      sigma: float, teachers: int) -> None:
        """Charge this batch to the hospital's own ledger before any teacher sees a scan: all or nothing,
        under ids with a nonce this hospital mints (the server's ids alone could be sent again)."""

        guard = self.lifetime_guard(request)
        event = GaussianEvent(sensitivity=codecs.codec_sensitivity(codec, teachers), sigma=sigma)
        note = {"teachers": teachers, "sigma": sigma, "codec": str(np.asarray(codec["kind"]).item()),
                "latent_dim": int(np.asarray(codec["latent_dim"]).item())}
        nonce = mint_nonce()
        guard.charge_all([self.hospital_id], event, [f"{r}@{nonce}" for r in release_ids], note)

    def ensemble_probability_sum(self, scans: np.ndarray, config: HospitalRequest | Mapping[str, Any] | None = None
                                 ) -> np.ndarray:
        """Sum of the teachers' probabilities (C, ...): a SIMULATION-ONLY diagnostic (the noise-free
        probability ensemble, the ceiling PATE can reach). Full-resolution: never exposed by the Flower app. Computed
        in the same pass as a diagnostic query of the same scans (:meth:`_diagnostic_pass`)."""
        if self.deployed:
            raise UserError(f"hospital {self.hospital_id}: refuses un-noised diagnostics (simulation only)")
        return self._diagnostic_pass(np.asarray(scans, np.float32), self.read_request(HospitalRequest, config))[0].copy()

    def evaluate(self, config: EvaluationRequest | Mapping[str, Any] | None = None) -> dict:
        """Per-teacher Dice (scalars only) on the public test scans + labels the server sends
        (:class:`task.wire.requests.EvaluationRequest` ``images``, ``labels``), else on this hospital's validation cases.

        Un-noised statistics of models trained on private patients: a simulation-only diagnostic, refused
        by a deployed hospital."""

        request = self.read_request(EvaluationRequest, config)
        if self.deployed:
            raise UserError(f"hospital {self.hospital_id}: refuses to report per-teacher Dice (an un-noised "
                            "statistic of its patients; simulation only)")
        if request.images is not None and request.labels is not None:
            images, labels, on = np.asarray(request.images, np.float32), np.asarray(request.labels), "public-test"
        elif self.validation:
            images, labels, on = self.prepared.images(self.validation), self.prepared.labels(self.validation), \
                "own-validation"
        else:
            return {"hospital_id": self.hospital_id, "teacher_dice": [], "teacher_dice_mean": None, "on": None}
        # Teachers do not change across a comparison's cells: evaluate each (teachers, test set) pair once.
        cache = self._evaluation_cache(images, labels)
        if cache is not None and cache.exists():
            return json.loads(cache.read_text())
        # each teacher's probabilities as it answers queries (one U-Net pass for voxel-head teachers that share it)
        scores = [dice_of_labels(probs.argmax(1).cpu().numpy() if isinstance(probs, torch.Tensor)
                                 else probs.argmax(1), labels)
                  for _, group in self.teacher_probability_groups(images, request) for probs in group]
        means = [s.get("mean") for s in scores]
        valid = [m for m in means if m is not None]
        result = {"hospital_id": self.hospital_id, "teacher_dice": means,
                  "teacher_dice_mean": float(np.mean(valid)) if valid else None, "on": on}
        if cache is not None:
            atomic_write_json(cache, result)
        return result

    def _evaluation_cache(self, images: np.ndarray, labels: np.ndarray):
        fingerprint = self._teachers_fingerprint()
        if fingerprint is None:
            return None
        digest = hashlib.sha256(fingerprint.encode())
        digest.update(np.ascontiguousarray(images).tobytes())
        digest.update(np.ascontiguousarray(labels).tobytes())
        return self.workdir / "teachers" / f"evaluation-{digest.hexdigest()[:16]}.json"
