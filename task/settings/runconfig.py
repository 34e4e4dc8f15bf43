"""Run settings shared by the ServerApp (``[tool.flwr.app.config]``), ``fedpate simulate`` and ``compare``.

Flower passes kebab-case keys (``teachers-per-hospital``); the CLI passes argparse names. Both become one
validated :class:`RunSettings`, so a bad value gets the same one-line error whichever way it came.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from privacy.mechanisms import NoiseSource
from task.learning.compute import Compute, check_compute
from task.errors import UserError
from task.settings import methods as registry
from task.options import Calibration, Init, look_up_option
from task.settings.presets import Preset, get_preset, preset_reference
from task.wire.requests import HospitalRequest

if TYPE_CHECKING:   # the real-scan check reads NIfTI files: not imported by the command line's start-up
    from task.reporting.realcheck import RealCheck


def check_epsilon(value: Any, option: str = "--epsilons") -> float:
    """One privacy budget: a positive finite number (the one check every path to a cell goes through)."""
    try:
        epsilon = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{option}: expected a positive number, got {value!r}") from None
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise UserError(f"{option}: expected a positive number, got {value!r}")
    return epsilon


#: how a threat model that came through Flower's run config names its settings (``check_secure_settings``)
RUN_CONFIG_THREAT_KEYS = "hospitals, secure-colluders, secure-dropouts and secure-threshold"


@dataclass(frozen=True)
class Cell:
    """One cell of a run plan: a method (a :mod:`task.settings.methods` record's name) at a budget (None for a
    method without one), at K teachers when a comparison sweeps K, started from ``init``, written to ``out``;
    ``shared_dir`` holds the ε-independent public models the cells of one K share. The same object travels to
    the ServerApp (:meth:`to_dict`, JSON in the run config) and back (:meth:`from_dict`)."""

    method: str
    epsilon: float | None
    out: str
    init: Init = Init.PUBLIC
    shared_dir: str | None = None
    teachers: int | None = None

    def __post_init__(self) -> None:
        record = registry.method(self.method) if self.method in registry.names() else None
        if record is None:
            raise UserError(f"method: unknown {self.method!r}; expected one of {', '.join(registry.names())}")
        if record.per_epsilon:
            object.__setattr__(self, "epsilon", check_epsilon(self.epsilon, "epsilon"))
        elif self.epsilon is not None:
            raise UserError(f"{self.method}: takes no privacy budget, got epsilon {self.epsilon!r}")
        object.__setattr__(self, "init", look_up_option(self.init, Init, "--init"))

    @property
    def record(self) -> "registry.Method":
        return registry.method(self.method)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Cell":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(data).items() if k in fields})


@dataclass(frozen=True)
class RunSettings:
    method: str = "pate-ae"
    preset: str = "tiny"
    epsilon: float | None = None
    delta: float | None = None
    seed: int = 0
    out: str = "runs/flwr"
    data: str | None = None
    hospitals: int | None = None
    teachers_per_hospital: int | None = None
    wait_seconds: float = 120.0
    reply_timeout: float = 600.0
    query_timeout: float | None = None   # a query round's deadline (None = reply_timeout)
    world: str | None = None          # a prepared world folder (set by fedpate's runners)
    calibration: str = Calibration.EXACT.value   # exact | paper (Fay et al. eq. 15)
    query_batch: int = 8              # public scans per query message
    reproducible_noise: bool = False  # simulation only: noise streams seeded by ``seed`` (not private)
    lifetime_epsilon: float | None = None  # simulated hospitals' lifetime budget (default: this run's budget)
    ledger_dir: str | None = None     # simulated hospitals' own ledgers (default: <out>/hospital-ledgers)
    init: str = "public"              # DP-FedAvg's start: the public model (as PATE) | scratch (random weights)
    layout: str | None = None         # the data folder's layout (task.data.layouts); None = detected
    partition_file: str | None = None  # FeTS partition CSV: its partitions are the hospitals (task.world)
    #: where every model trains and predicts (task.learning.device: auto = CUDA when there is one), the server's
    #: own models and the simulated hospitals' (deployed hospitals follow their node config), at which
    #: forward-pass precision, and whether progress bars show; its device and precision travel in the run
    #: config under their own keys (``device``, ``precision``: :func:`run_config_fields` flattens it)
    compute: Compute = Compute()
    #: the secure methods' threat model: up to ``secure_colluders`` hospitals share everything with the aggregator
    #: and up to ``secure_dropouts`` leave mid-protocol, so each hospital counts only the noise shares of the others
    #: that remain; ``secure_threshold`` is the Shamir threshold asked (None = the smallest the hospitals accept,
    #: ``task.wire.secagg.smallest_threshold``). Simulated hospitals adopt this model as their policy; deployed ones hold
    #: their own (node config) and refuse any other. A model the run's hospitals cannot hold is refused here.
    secure_colluders: int = 0
    secure_dropouts: int = 0
    secure_threshold: int | None = None
    #: the cells this run executes, in order (a comparison's; empty: one cell, the configured method at the budget,
    #: :meth:`planned_cells`). Given to an in-process ServerApp (``server.server_app.make_app``), not a run-config key
    cells: tuple[Cell, ...] = ()
    #: the real-scan check every model the run releases is scored on (``task.reporting.realcheck``; None: none). An open check
    #: of this process's, given like the cells; a run-config key it is not (a ServerApp in another process, behind
    #: ``flwr run``, has none)
    real_check: "RealCheck | None" = None

    def __post_init__(self) -> None:
        federated = registry.names(federated=True)
        if self.method not in federated:
            raise UserError(f"method: {self.method!r} is not a federated method; expected one of {', '.join(federated)}")
        object.__setattr__(self, "preset", preset_reference(self.preset))   # a name, or a variant's reference
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise UserError(f"epsilon: expected a positive number, got {self.epsilon}")
        if self.delta is not None and not (0 < self.delta < 1):
            raise UserError(f"delta: expected a number in (0, 1), got {self.delta}")
        for name in ("hospitals", "teachers_per_hospital"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name.replace('_', '-')}: expected a positive integer, got {value}")
        for name in ("secure_colluders", "secure_dropouts", "secure_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise UserError(f"{name.replace('_', '-')}: expected a non-negative integer, got {value!r}")
        if self.method in registry.names(secure_sum=True):   # before any work: a sum these settings cannot hold
            from task.wire.secagg import check_secure_settings

            check_secure_settings(self.resolved_preset.hospitals, self.secure_colluders, self.secure_dropouts,
                                  self.secure_threshold, RUN_CONFIG_THREAT_KEYS)
        if self.query_batch < 1:
            raise UserError(f"query-batch: expected a positive integer, got {self.query_batch}")
        if self.lifetime_epsilon is not None and not (math.isfinite(self.lifetime_epsilon)
                                                      and self.lifetime_epsilon > 0):
            raise UserError(f"lifetime-epsilon: expected a positive number, got {self.lifetime_epsilon}")
        # a plain string: it travels in Flower's run config (Init's value)
        object.__setattr__(self, "init", look_up_option(self.init, Init, "init").value)
        object.__setattr__(self, "calibration", look_up_option(self.calibration, Calibration, "calibration").value)
        check_compute(self.compute)
        cells = self.cells if isinstance(self.cells, (tuple, list)) else None
        if cells is None or not all(isinstance(cell, Cell) for cell in cells):
            raise UserError(f"cells: expected a sequence of task.settings.runconfig.Cell records, got {self.cells!r}")
        object.__setattr__(self, "cells", tuple(cells))

    @functools.cached_property
    def resolved_preset(self) -> Preset:
        """The federation spec (preset x hospitals x teachers per hospital), resolved once per settings object."""
        return get_preset(self.preset, hospitals=self.hospitals, teachers_per_hospital=self.teachers_per_hospital)

    @property
    def budget(self) -> float:
        return self.epsilon if self.epsilon is not None else self.resolved_preset.epsilon

    @property
    def resolved_delta(self) -> float:
        return self.delta if self.delta is not None else self.resolved_preset.delta

    @property
    def threat_model(self) -> dict[str, int]:
        """The secure methods' threat model as the server declares it (``server.pate_secure.threat_model``)."""
        return {"colluders": self.secure_colluders, "dropouts": self.secure_dropouts,
                **({"threshold": self.secure_threshold} if self.secure_threshold else {})}

    def hospital_privacy_config(self) -> dict[str, Any]:
        """What simulated hospitals are told about their own privacy (deployed ones use their node config):
        where each keeps its ledger, its lifetime budget and delta, and their codec policy -- simulated
        hospitals opt in to the identity codec, whose full-resolution votes only the simulation sees."""
        return HospitalRequest(ledger_dir=self.ledger_dir or str(Path(self.out) / "hospital-ledgers"),
                               lifetime_epsilon=float(self.lifetime_epsilon or self.budget), delta=self.resolved_delta,
                               allow_identity=True,
                               secure_policy={"colluders": self.secure_colluders, "dropouts": self.secure_dropouts},
                               ).to_config()

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], **overrides) -> "RunSettings":
        """From Flower's run_config: one kebab-case key per field (:func:`run_config_keys`); 0 / "" mean "the
        preset's value" (None) for a field that may be None; a missing key is the field's default."""
        values, compute = {}, {}
        for f in run_config_fields():
            value = run_config.get(run_config_key(f.name))
            if value in ("", None):
                continue
            (compute if f in COMPUTE_FIELDS else values)[f.name] = _from_config(value, f)
        values["compute"] = Compute(**compute)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case run_config ``flwr run -c`` accepts (every key is in pyproject.toml's
        ``[tool.flwr.app.config]``): the budget and delta resolved, None as 0 or ""."""
        resolved = {"epsilon": self.budget, "delta": self.resolved_delta}
        return {run_config_key(f.name): _to_config(resolved.get(f.name, getattr(self._owner(f), f.name)), f)
                for f in run_config_fields()}

    def _owner(self, f: dataclasses.Field) -> Any:
        """The object a run-config field belongs to: these settings, or their :class:`task.learning.compute.Compute`."""
        return self.compute if f in COMPUTE_FIELDS else self

    def noise_source(self, *names):
        """The privacy noise of the run (or of one cell, named by ``names``): secure unless this is a
        simulation that asked for reproducible noise (``--reproducible-noise``)."""

        source = NoiseSource.reproducible(self.seed) if self.reproducible_noise else NoiseSource()
        return source.child(*names) if names else source

    def planned_cells(self) -> tuple[Cell, ...]:
        """The cells this run executes: :attr:`cells`, or the one cell of the configured method at the budget."""
        return self.cells or (Cell(self.method, self.budget, self.out, init=self.init),)

    def cell_noise_source(self, cell: "Cell"):
        """The noise of one cell of a comparison, in its own namespace: method, budget and K (unique within
        a comparison, so no two cells ever share a draw)."""
        return self.noise_source(cell.method, f"eps-{float(cell.epsilon):g}", f"K-{self.resolved_preset.teachers}")

    def replace(self, **changes) -> "RunSettings":
        return dataclasses.replace(self, **changes)


def config_flag(value: Any, key: str) -> bool:
    """A boolean run-config or node-config value (Flower passes TOML booleans; ``-c`` may pass strings)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise UserError(f"{key}: expected true or false, got {value!r}")


#: RunSettings fields that are not run-config keys: the cells and the real-scan check, typed records this process
#: hands to the ServerApp it runs (``server.server_app.make_app``)
NOT_RUN_CONFIG = ("cells", "real_check")
#: the fields of :class:`task.learning.compute.Compute` that are run-config keys, each under its own name: progress bars
#: and worker processes are the caller's
COMPUTE_FIELDS = tuple(f for f in dataclasses.fields(Compute) if f.name not in ("progress", "workers"))


def run_config_fields() -> list[dataclasses.Field]:
    """The :class:`RunSettings` fields Flower's run config carries (``[tool.flwr.app.config]``), in order;
    ``compute`` flattened into its own run-config fields (:data:`COMPUTE_FIELDS`)."""
    fields = []
    for f in dataclasses.fields(RunSettings):
        if f.name == "compute":
            fields.extend(COMPUTE_FIELDS)
        elif f.name not in NOT_RUN_CONFIG:
            fields.append(f)
    return fields


def run_config_key(name: str) -> str:
    """A field's run-config key: its name in kebab case (``teachers_per_hospital`` -> ``teachers-per-hospital``)."""
    return name.replace("_", "-")


def run_config_keys() -> list[str]:
    return [run_config_key(f.name) for f in run_config_fields()]


def _kind(f: dataclasses.Field) -> tuple[str, bool]:
    """(base type name, whether None is allowed) of a field's annotation (``"float | None"`` -> ``("float", True)``)."""
    parts = [part.strip() for part in str(f.type).split("|")]
    return parts[0], "None" in parts


def _from_config(value: Any, f: dataclasses.Field) -> Any:
    kind, optional = _kind(f)
    if kind == "bool":
        return config_flag(value, run_config_key(f.name))
    converted = {"int": int, "float": float}.get(kind, str)(value)
    return (converted or None) if optional else converted


def _to_config(value: Any, f: dataclasses.Field) -> Any:
    kind, optional = _kind(f)
    if value is None and optional:
        return {"int": 0, "float": 0.0}.get(kind, "")
    return value
