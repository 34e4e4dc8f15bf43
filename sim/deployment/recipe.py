"""The step-by-step commands for a deployment on real separate machines, as text (``fedpate deploy commands``).

One aggregator (SuperLink + ServerApp) and one SuperNode per hospital, TLS and SuperNode authentication
with the certificates ``fedpate deploy certs`` made (sim/deployment/tls.py); docs/DEPLOYMENT.md explains
every step.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from sim.deployment.flower_cli import FLOWER_ENV, config_string
from sim.deployment.tls import ROSTER_FILE
from task.learning.device import check_device_spec, check_precision
from task.errors import UserError
from task.settings.presets import get_preset
from task.wire.secagg import Roster


@dataclass(frozen=True)
class DeploymentRecipe:
    """What ``fedpate deploy commands`` writes the commands for, validated on construction.

    ``epsilon_budget`` and ``max_teachers`` go into every node config: a deployed hospital refuses to start
    without them.

    Args:
        certs_dir: where ``fedpate deploy certs`` wrote the CA, the SuperLink certificate and one key pair per
            hospital.
        superlink: ``HOST:PORT`` as the hospitals reach the aggregator (the SuperLink listens on that port).
        hospitals: ``[(hospital_id, data_dir_on_that_hospital), ...]``.
        app_dir: the fedpate source folder ``flwr run`` is started from on the aggregator.
        supernode_port: the local port each SuperNode listens on (127.0.0.1 only).
        teachers_per_hospital: written into each node config when given (None = the node's default).
        remote_certs: the certificate folder on every machine.
        workdir_root: each hospital's work folder is ``<workdir_root>/<hospital_id>``.
        epsilon_budget: each hospital's lifetime ε.
        max_teachers: the consortium's K (None = hospitals x ``teachers_per_hospital``, or x the quick preset's).
        device / precision: written into each node config when given: where that hospital trains its teachers
            and at which precision (None = the node's default, auto and 32). Not a :class:`task.learning.compute.Compute`:
            each is the hospital's own machine's setting, written only when asked for.
    """

    certs_dir: Path
    superlink: str
    hospitals: Sequence[tuple[str, str]]
    app_dir: str = "."
    supernode_port: int = 9094
    teachers_per_hospital: int | None = None
    remote_certs: str = "/etc/fedpate/certs"
    workdir_root: str = "/var/lib/fedpate"
    epsilon_budget: float = 8.0
    max_teachers: int | None = None
    device: str | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        host, _, port = self.superlink.rpartition(":")
        if not host:
            raise UserError(f"--superlink {self.superlink!r}: expected HOST:PORT")
        if not port.isdigit():
            raise UserError(f"--superlink {self.superlink!r}: port must be a number")
        object.__setattr__(self, "certs_dir", Path(self.certs_dir))
        object.__setattr__(self, "hospitals", tuple((str(h), str(d)) for h, d in self.hospitals))
        if not 0 < int(self.supernode_port) < 65536:
            raise UserError(f"supernode port: expected 1..65535, got {self.supernode_port!r}")
        if not (math.isfinite(float(self.epsilon_budget)) and float(self.epsilon_budget) > 0):
            raise UserError(f"--epsilon-budget: expected a positive number, got {self.epsilon_budget!r}")
        for name in ("teachers_per_hospital", "max_teachers"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise UserError(f"--{name.replace('_', '-')}: expected a positive integer, got {value!r}")
        if self.device:
            object.__setattr__(self, "device", check_device_spec(self.device))
        if self.precision:
            object.__setattr__(self, "precision", check_precision(self.precision))
        names = [hid for hid, _ in self.hospitals]
        if len(set(names)) != len(names):
            raise UserError(f"--hospital: each hospital once, got {', '.join(names)}")
        self.check_certificates()

    def check_certificates(self) -> None:
        """Every file the commands copy must be there, and every hospital on the roster its secure sums check
        participants against: printing steps that fail at the first ``scp`` on another machine helps nobody.
        Refused in one line naming the folder and what is missing."""
        certs = self.certs_dir
        if not certs.is_dir():
            raise UserError(f"--certs {certs}: no such folder; make it with `fedpate deploy certs --out {certs} "
                            f"--hospitals {len(self.hospitals)} --host <aggregator's name>`")
        if not (certs / ROSTER_FILE).is_file():
            raise UserError(f"--certs {certs}: no {ROSTER_FILE} (`fedpate deploy certs` writes it beside the "
                            "keys; rerun it)")
        roster = Roster.load(certs / ROSTER_FILE)
        strangers = [h for h, _ in self.hospitals if h not in roster.keys]
        if strangers:
            raise UserError(f"--hospital {strangers[0]}: not on {certs / ROSTER_FILE} (the hospitals "
                            f"`fedpate deploy certs` made keys for: {', '.join(sorted(roster.keys))})")
        needed = ["ca.crt", "superlink.crt", "superlink.key"]
        needed += [f"supernodes/{hid}.{kind}" for hid, _ in self.hospitals for kind in ("key", "pub")]
        missing = [name for name in needed if not (certs / name).is_file()]
        if missing:
            raise UserError(f"--certs {certs}: missing {', '.join(missing)} (make them with `fedpate deploy certs`)")


def deployment_commands(recipe: DeploymentRecipe) -> str:
    """The step-by-step commands for real separate machines, as text (``recipe``: :class:`DeploymentRecipe`)."""
    certs, hospitals, teachers_per_hospital = recipe.certs_dir, recipe.hospitals, recipe.teachers_per_hospital
    host, port = recipe.superlink.rsplit(":", 1)
    supernode_port, app_dir, device, precision = recipe.supernode_port, recipe.app_dir, recipe.device, recipe.precision
    per_hospital = teachers_per_hospital or get_preset("quick").teachers_per_hospital
    consortium = int(recipe.max_teachers or len(hospitals) * per_hospital)
    q = shlex.quote
    r = recipe.remote_certs.rstrip("/")
    lines = [
        "# fedpate deployment: one aggregator (SuperLink + ServerApp) and one SuperNode per hospital.",
        f"# Generated from certificates in {certs}. Run each block on the machine named in its heading.",
        "# Every machine: the same fedpate + flwr 1.41 installation (bash .ci/install), and for every command",
        "export " + " ".join(f"{key}={value}" for key, value in FLOWER_ENV.items()),
        "",
        "## 0. On the machine that made the certificates: distribute the files (never copy *.key elsewhere",
        "##    than stated; ca.key stays offline; roster.txt goes to every hospital from here, never through the",
        "##    aggregator: it names the keys the hospitals trust in secure sums)",
        f"ssh {host} 'mkdir -p {r} && chmod 700 {r}'",
        f"scp {q(str(certs / 'ca.crt'))} {q(str(certs / 'superlink.crt'))} {q(str(certs / 'superlink.key'))} "
        f"{host}:{r}/",
    ]
    for hid, _ in hospitals:
        lines += [
            f"ssh <{hid}-machine> 'mkdir -p {r} && chmod 700 {r}'",
            f"scp {q(str(certs / 'ca.crt'))} {q(str(certs / ROSTER_FILE))} "
            f"{q(str(certs / 'supernodes' / (hid + '.key')))} <{hid}-machine>:{r}/",
            f"scp {q(str(certs / 'supernodes' / (hid + '.pub')))} {host}:{r}/   # public key, for registration",
        ]
    lines += [
        "",
        f"## 1. Aggregator ({host}): open TCP {port} to the hospitals only (the SuperLink's single HTTPS port:",
        "##    Fleet API for SuperNodes, Control API for `flwr`, Runtime API for its ServerApp)",
        f"flower-superlink --host 0.0.0.0 --port {port} \\",
        f"    --ssl-ca-certfile {r}/ca.crt --ssl-certfile {r}/superlink.crt --ssl-keyfile {r}/superlink.key \\",
        "    --enable-supernode-auth --database /var/lib/fedpate/superlink.db \\",
        "    --disable-runtime-dependency-installation",
        "",
        f"## 2. Aggregator ({host}): a FLWR_HOME with the connection, then register every hospital's key",
        "export FLWR_HOME=/var/lib/fedpate/flwr-home && mkdir -p $FLWR_HOME",
        "cat > $FLWR_HOME/config.toml <<'EOF'",
        "[superlink]",
        'default = "fedpate"',
        "[superlink.fedpate]",
        f'address = "{host}:{port}"',
        f'root-certificates = "{r}/ca.crt"',
        "EOF",
    ]
    for hid, _ in hospitals:
        lines.append(f"flwr supernode register {r}/{hid}.pub fedpate --name {hid}")
    lines.append("flwr supernode ls fedpate        # every hospital listed, status 'registered'")
    lines.append("")
    for hid, data in hospitals:
        node_config = {"hospital-id": hid, "data-dir": data, "workdir": f"{recipe.workdir_root}/{hid}"}
        if teachers_per_hospital:
            node_config["teachers-per-hospital"] = teachers_per_hospital
        node_config["epsilon-budget"] = float(recipe.epsilon_budget)
        node_config["max-teachers"] = consortium
        if device:      # where this hospital trains its teachers (its own GPU; default auto)
            node_config["device"] = device
        if precision:
            node_config["precision"] = precision
        # secure sums: the consortium's roster and this hospital's own key, the one it authenticates with
        node_config["secure-roster"] = f"{r}/{ROSTER_FILE}"
        node_config["secure-signing-key"] = f"{r}/{hid}.key"
        lines += [
            f"## 3. Hospital {hid}: outbound TCP to {host}:{port} only; nothing listens except 127.0.0.1:{supernode_port}",
            f"flower-supernode --superlink {host}:{port} --root-certificates {r}/ca.crt \\",
            f"    --auth-supernode-private-key {r}/{hid}.key \\",
            f"    --host 127.0.0.1 --port {supernode_port} \\",
            "    --node-config " + q(config_string(node_config, quote='"')),
            "",
        ]
    lines += [
        f"## 4. Aggregator ({host}), from the fedpate source folder: start the run (logs stream back)",
        f"flwr run {app_dir} fedpate --stream -c \"method='pate-ae' preset='quick' hospitals={len(hospitals)}\"",
        "flwr ls fedpate --format json     # the run's real status: finished:completed (flwr run exits 0 anyway)",
    ]
    return "\n".join(lines) + "\n"
