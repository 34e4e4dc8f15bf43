"""Which hospital this Flower node is, and where its data lives.

Two ways a node learns who it is:

* **Deployment** (a SuperNode on a hospital's own machine): ``--node-config "hospital-id='h0'
  data-dir='/data/msd' workdir='/var/fedpate'"``. The hospital reads *its own* MSD folder, prepares it
  at the grid the server asks for and splits its patients into ``teachers-per-hospital`` disjoint
  teacher partitions itself. Nothing about its patients is known to the server. Its privacy settings
  are its own, in the node config: ``epsilon-budget`` (lifetime ε over every run; required: a node
  without one refuses to start), ``max-teachers`` (the most teachers the consortium has, the largest K a
  server may declare; required: the sensitivity 2C/K it charges shrinks with K), ``delta`` (default 1e-3), ``max-latent-dim`` (longest encoding it uploads, default 1024) and
  ``allow-identity`` (whether it ever uploads full-resolution one-hot votes, default false); its ledger
  is ``workdir/privacy-ledger.jsonl``. Its threat model for secure sums is its own too
  (:func:`secure_policy_for`): ``secure-colluders`` and ``secure-dropouts`` (default 0: it then counts
  every participant's noise share and refuses to unmask when one is missing), ``secure-min-participants``
  and ``secure-min-threshold`` (default 2), and who it trusts in them (:func:`secure_identity_for`):
  ``secure-roster`` (the consortium's roster of hospital keys) and ``secure-signing-key`` (its own SuperNode
  key); without them it refuses every secure sum. Its compute is its own too: ``device`` (auto | cpu | cuda |
  cuda:N, default auto: its GPU when it has one) and ``precision`` (32 | bf16), whatever the run config says.
* **Simulation** (all hospitals on one machine): Flower gives ``partition-id``; the server's messages
  carry the path of the simulated world (prepared cases + the split manifest every party reads), and
  the node takes the ``partition-id``-th hospital of that split.

Hospitals are cached per process: Ray reuses worker processes across messages, and teacher weights
live on the hospital's disk (``workdir``) so a fresh process picks them up again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from clients.secure import SecurePolicy
from task.errors import UserError
from task.names import check_name_part
from task.settings.presets import get_preset
from task.wire.requests import RunContext, read_request_as
from task.settings.runconfig import config_flag
from task.wire.secagg import SigningIdentity

if TYPE_CHECKING:   # annotations only
    from clients.hospital import Hospital, HospitalSettings

# The hospital, its data and its models (clients.hospital, task.world, task.data.preprocess, task.codecs) import
# the training stack (torch, ~2 s): imported where a hospital is built, so a deployed node's ClientApp process
# started for a secure sum's key stage (:func:`hospital_card_for`) does without them.

_HOSPITALS: dict[tuple, Any] = {}


def _default_workroot() -> Path:
    return Path(os.environ.get("FEDPATE_NODE_ROOT", Path.home() / ".cache" / "fedpate" / "nodes"))


def _node_value(node_config: Mapping[str, Any], key: str, convert, default=None):
    """``node_config[key]`` through ``convert`` (``default`` when it is absent); one-line UserError naming it."""
    if key not in node_config:
        return default
    try:
        return convert(node_config[key])
    except (TypeError, ValueError):
        raise UserError(f"node-config: {key}: expected a {'number' if convert is not str else 'string'}, "
                        f"got {node_config[key]!r}") from None


@dataclass(frozen=True)
class NodeConfig:
    """A Flower node's own configuration (``--node-config``, kebab-case keys), parsed and checked before anything
    touches a disk: a simulated node names its ``partition-id``; a deployed hospital its ``data-dir`` and
    everything else below -- its own privacy settings, never defaulted for it where they bound what it releases
    (``epsilon-budget``, ``max-teachers``), and its compute. The secure-sum policy keys are read by
    :func:`secure_policy_for`."""

    partition_id: int | None = None
    data_dir: str | None = None
    hospital_id: str = ""
    workdir: str | None = None
    epsilon_budget: float | None = None
    max_teachers: int | None = None
    delta: float = 1e-3
    max_latent_dim: int = 1024
    allow_identity: bool = False
    device: str = "auto"
    precision: str = "32"
    teachers_per_hospital: int | None = None

    def __post_init__(self) -> None:
        if not self.deployed:
            if self.partition_id is None:
                raise UserError("node-config: expected either 'data-dir' (deployment) or 'partition-id' (simulation)")
            return
        if not self.hospital_id:
            raise UserError("node-config: 'hospital-id' is required next to 'data-dir'")
        check_name_part(self.hospital_id, "node-config hospital-id")   # names its folder and ledger owner
        required = {"epsilon-budget": (self.epsilon_budget, "its lifetime privacy budget"),
                    "max-teachers": (self.max_teachers,
                                     "the most teachers the consortium has (bounds the K a server may declare)")}
        for name, (value, meaning) in required.items():   # a hospital's privacy settings are never defaulted for it
            if value is None:
                raise UserError(f"node-config: '{name}' is required on a deployed hospital ({meaning})")

    @property
    def deployed(self) -> bool:
        return self.data_dir is not None

    @classmethod
    def from_node_config(cls, node_config: "Mapping[str, Any] | NodeConfig") -> "NodeConfig":
        if isinstance(node_config, cls):
            return node_config
        given = {k: v for k, v in dict(node_config).items() if v not in (None, "")
                 or k in ("data-dir", "partition-id")}
        return cls(
            partition_id=_node_value(given, "partition-id", int),
            data_dir=_node_value(given, "data-dir", str),
            hospital_id=str(given.get("hospital-id") or ""),
            workdir=_node_value(given, "workdir", str),
            epsilon_budget=_node_value(given, "epsilon-budget", float),
            max_teachers=_node_value(given, "max-teachers", int),
            delta=_node_value(given, "delta", float, 1e-3),
            max_latent_dim=_node_value(given, "max-latent-dim", int, 1024),
            allow_identity=config_flag(given.get("allow-identity", False), "node-config allow-identity"),
            device=str(given.get("device", "auto")), precision=str(given.get("precision", "32")),
            teachers_per_hospital=_node_value(given, "teachers-per-hospital", int) or None)

    def hospital_settings(self, seed: int) -> HospitalSettings:
        """A deployed hospital's own settings (its ledger is ``workdir/privacy-ledger.jsonl``)."""
        from clients.hospital import HospitalSettings
        from task.codecs import CodecPolicy

        return HospitalSettings(seed=seed, deployed=True, lifetime_epsilon=self.epsilon_budget, delta=self.delta,
                                codec_policy=CodecPolicy(max_latent_dim=self.max_latent_dim,
                                                         allow_identity=self.allow_identity),
                                max_teachers=self.max_teachers, device=self.device, precision=self.precision)


@dataclass(frozen=True)
class HospitalCard:
    """What a secure sum's key stages (setup, share-keys, unmask) ask of a deployed hospital: its name, that it
    is deployed, and its reading of a request -- nothing of its patients or teachers. A SuperNode starts a fresh
    ClientApp process for every message, and building the hospital imports the training stack and opens its
    data; these stages touch neither, and what they check (the roster, the node's own policy) comes from the node
    config, as it does with the full hospital."""

    hospital_id: str
    deployed: bool = True

    def read_request(self, kind, config):
        return read_request_as(self.hospital_id, kind, config)


def hospital_card_for(node_config: Mapping[str, Any]) -> HospitalCard | None:
    """A deployed node's :class:`HospitalCard` (its node config checked as for the full hospital); None for a
    simulated node, whose hospital lives on in its process (built once, cached)."""
    node = NodeConfig.from_node_config(node_config)
    return HospitalCard(node.hospital_id) if node.deployed else None


def hospital_for(node_config: Mapping[str, Any], config: Mapping[str, Any]) -> Hospital:
    """Return the (cached) :class:`clients.hospital.Hospital` this node plays."""
    from clients.hospital import Hospital, HospitalSettings
    from task.world import open_world

    context = RunContext.from_config(config)
    preset = get_preset(context.preset, **(context.preset_overrides or {}))
    node = NodeConfig.from_node_config(node_config)
    if node.deployed:
        return _deployed_hospital(node, context, preset, context.seed, Hospital, node_config)
    world_dir = context.world
    if not world_dir:
        raise UserError("message config: simulation messages must carry 'world' (the prepared world folder)")
    key = ("sim", str(world_dir), node.partition_id)
    if key not in _HOSPITALS:
        prepared, split = open_world(world_dir)
        hospital_ids = sorted(split.hospitals)
        index = node.partition_id
        if index >= len(hospital_ids):
            raise UserError(
                f"node-config partition-id={index}: the world at {world_dir} has only {len(hospital_ids)} hospitals"
            )
        # the world's split names this hospital's folder and ledger file
        hospital_id = check_name_part(hospital_ids[index], f"the world at {world_dir}: hospital id")
        workdir = Path(world_dir) / "nodes" / hospital_id
        # a simulated consortium knows its size: no server may declare more teachers than the world has
        consortium = sum(len(partitions) for partitions in split.hospitals.values())
        _HOSPITALS[key] = Hospital(hospital_id, prepared, split.hospitals[hospital_id], preset, workdir,
                                   HospitalSettings(seed=context.seed, max_teachers=consortium))
    return _HOSPITALS[key]


def _deployed_hospital(node_config, config, preset, seed, hospital_cls, raw_config=None):
    """The deployed hospital of ``node_config`` (a :class:`NodeConfig` or its mapping), made once per data
    folder, grid and teacher count: its own patients prepared and split into teacher partitions by patient."""
    node, context = NodeConfig.from_node_config(node_config), RunContext.from_config(config)
    hospital_id = node.hospital_id
    data_dir = Path(node.data_dir)
    workdir = Path(node.workdir or _default_workroot() / hospital_id)
    teachers = int(node.teachers_per_hospital or context.teachers_per_hospital or preset.teachers_per_hospital)
    key = ("deploy", str(data_dir), hospital_id, tuple(preset.grid), teachers)
    if key not in _HOSPITALS:
        from task.data.partitions import split_into_teachers
        from task.data.preprocess import PreprocessConfig, prepare_dataset

        if raw_config is not None:   # its secure-sum identity checked before any work (one line on a mistake)
            secure_identity_for(raw_config)
        prepared = prepare_dataset(data_dir, workdir / "prepared", PreprocessConfig(grid=tuple(preset.grid)),
                                   progress=False)
        # by patient: a hospital's scans of one patient (timepoints) all go to one teacher
        partitions = split_into_teachers(list(prepared.case_ids), teachers, seed=seed, patients=prepared.patient)

        _HOSPITALS[key] = hospital_cls(hospital_id, prepared, partitions, preset, workdir,
                                       node.hospital_settings(seed))
    return _HOSPITALS[key]


#: node-config keys naming the consortium's roster of hospital keys and this hospital's own signing key (its
#: SuperNode authentication key): a deployed hospital takes part in secure sums only with both
SECURE_IDENTITY_KEYS = ("secure-roster", "secure-signing-key")


def secure_identity_for(node_config: Mapping[str, Any]) -> SigningIdentity | None:
    """A deployed hospital's :class:`task.wire.secagg.SigningIdentity` from its node config (``secure-roster``: the
    consortium's ``roster.txt``; ``secure-signing-key``: its own private key, the one its roster line lists);
    None when neither is set (it then refuses every secure sum) or for a simulated node. One-line UserError
    naming the key or file when only one is set, a file cannot be read, or the two do not match."""
    if "data-dir" not in node_config:
        return None
    roster, key = (str(node_config.get(name) or "") for name in SECURE_IDENTITY_KEYS)
    if not roster and not key:
        return None
    if not (roster and key):
        missing, given = SECURE_IDENTITY_KEYS if not roster else SECURE_IDENTITY_KEYS[::-1]
        raise UserError(f"node-config: '{missing}' is required next to '{given}'")
    return SigningIdentity.load(str(node_config.get("hospital-id") or ""), key, roster)


#: node-config key -> ``clients.secure.SecurePolicy`` field (a deployed hospital's threat model for secure sums)
SECURE_POLICY_KEYS = {"secure-colluders": "colluders", "secure-dropouts": "dropouts",
                      "secure-min-participants": "min_participants", "secure-min-threshold": "min_threshold"}


def secure_policy_for(node_config: Mapping[str, Any]) -> SecurePolicy | None:
    """A deployed hospital's secure-sum policy from its node config (defaults: no colluder, no dropout, at
    least 2 participants and a threshold of 2); None for a simulated node, whose policy comes with the
    simulation's messages as its lifetime budget does."""
    if "data-dir" not in node_config:
        return None
    values = {}
    for key, field in SECURE_POLICY_KEYS.items():
        value = node_config.get(key)
        if value in (None, ""):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(f"node-config: {key} must be a non-negative integer, got {value!r}") from None
        if isinstance(value, bool) or not number.is_integer():
            raise UserError(f"node-config: {key} must be a non-negative integer, got {value!r}")
        values[field] = int(number)
    return SecurePolicy(**values)
