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
  and ``secure-min-threshold`` (default 2). Its compute is its own too: ``device`` (auto | cpu | cuda |
  cuda:N, default auto: its GPU when it has one) and ``precision`` (32 | bf16), whatever the run config says.
* **Simulation** (all hospitals on one machine): Flower gives ``partition-id``; the server's messages
  carry the path of the simulated world (prepared cases + the split manifest every party reads), and
  the node takes the ``partition-id``-th hospital of that split.

Hospitals are cached per process: Ray reuses worker processes across messages, and teacher weights
live on the hospital's disk (``workdir``) so a fresh process picks them up again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from clients.hospital import Hospital
from clients.secure import SecurePolicy
from task.codecs import CodecPolicy
from task.data.partitions import split_into_teachers
from task.data.preprocess import PreprocessConfig, prepare_dataset
from task.errors import UserError
from task.names import check_name_part
from task.presets import get_preset
from task.runconfig import config_flag
from task.world import open_world

_HOSPITALS: dict[tuple, Any] = {}


def _default_workroot() -> Path:
    return Path(os.environ.get("FEDPATE_NODE_ROOT", Path.home() / ".cache" / "fedpate" / "nodes"))


def hospital_for(node_config: Mapping[str, Any], config: Mapping[str, Any]):
    """Return the (cached) :class:`clients.hospital.Hospital` this node plays."""

    preset = get_preset(str(config["preset"]), **(config.get("preset_overrides") or {}))
    seed = int(config.get("seed", 0))
    if "data-dir" in node_config:
        return _deployed_hospital(node_config, config, preset, seed, Hospital)
    if "partition-id" not in node_config:
        raise UserError("node-config: expected either 'data-dir' (deployment) or 'partition-id' (simulation)")
    world_dir = config.get("world")
    if not world_dir:
        raise UserError("message config: simulation messages must carry 'world' (the prepared world folder)")
    key = ("sim", str(world_dir), int(node_config["partition-id"]))
    if key not in _HOSPITALS:
        prepared, split = open_world(world_dir)
        hospital_ids = sorted(split.hospitals)
        index = int(node_config["partition-id"])
        if index >= len(hospital_ids):
            raise UserError(
                f"node-config partition-id={index}: the world at {world_dir} has only {len(hospital_ids)} hospitals"
            )
        # the world's split names this hospital's folder and ledger file
        hospital_id = check_name_part(hospital_ids[index], f"the world at {world_dir}: hospital id")
        workdir = Path(world_dir) / "nodes" / hospital_id
        # a simulated consortium knows its size: no server may declare more teachers than the world has
        consortium = sum(len(partitions) for partitions in split.hospitals.values())
        _HOSPITALS[key] = Hospital(hospital_id, prepared, split.hospitals[hospital_id], preset, workdir, seed,
                                   max_teachers=consortium)
    return _HOSPITALS[key]


def _deployed_hospital(node_config, config, preset, seed, hospital_cls):
    hospital_id = str(node_config.get("hospital-id") or "")
    if not hospital_id:
        raise UserError("node-config: 'hospital-id' is required next to 'data-dir'")
    hospital_id = check_name_part(hospital_id, "node-config hospital-id")   # names its folder and ledger owner
    data_dir = Path(str(node_config["data-dir"]))
    required = {"epsilon-budget": "its lifetime privacy budget", "max-teachers":
                "the most teachers the consortium has (bounds the K a server may declare)"}
    for name, meaning in required.items():   # a hospital's privacy settings are never defaulted for it
        if node_config.get(name) in (None, ""):
            raise UserError(f"node-config: '{name}' is required on a deployed hospital ({meaning})")
    workdir = Path(str(node_config.get("workdir") or _default_workroot() / hospital_id))
    teachers = int(node_config.get("teachers-per-hospital") or config.get("teachers_per_hospital")
                   or preset.teachers_per_hospital)
    key = ("deploy", str(data_dir), hospital_id, tuple(preset.grid), teachers)
    if key not in _HOSPITALS:
        prepared = prepare_dataset(data_dir, workdir / "prepared", PreprocessConfig(grid=tuple(preset.grid)),
                                   progress=False)
        # by patient: a hospital's scans of one patient (timepoints) all go to one teacher
        partitions = split_into_teachers(list(prepared.case_ids), teachers, seed=seed, patients=prepared.patient)

        policy = CodecPolicy(max_latent_dim=int(node_config.get("max-latent-dim", 1024)),
                             allow_identity=config_flag(node_config.get("allow-identity", False), "node-config allow-identity"))
        _HOSPITALS[key] = hospital_cls(hospital_id, prepared, partitions, preset, workdir, seed, deployed=True,
                                       lifetime_epsilon=float(node_config["epsilon-budget"]),
                                       delta=float(node_config.get("delta", 1e-3)), codec_policy=policy,
                                       max_teachers=int(node_config["max-teachers"]),
                                       device=str(node_config.get("device", "auto")),
                                       precision=str(node_config.get("precision", "32")))
    return _HOSPITALS[key]


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
