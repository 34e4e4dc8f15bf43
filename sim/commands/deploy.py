"""``fedpate deploy``: certificates, the commands for real machines, or a full deployment on localhost.

    fedpate deploy certs    --out DIR --hospitals K [--host H ...]
    fedpate deploy commands --certs DIR --superlink HOST:PORT --hospital h0=/data/h0 --hospital h1=/data/h1
    fedpate deploy local    --out DIR --hospitals K [--app DIR | --echo] [-c key=value ...]

The work is done in ``sim/deployment/`` (``tls.py``, ``recipe.py``, ``local.py``, ``fedpate_local.py``) (see docs/DEPLOYMENT.md).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

from sim.deployment.flower_cli import PROJECT_ROOT
from task.errors import UserError
from task.io import ensure_folder


#: what ``fedpate deploy --help`` says (the module docstring is for readers of the code)
DESCRIPTION = """\
Certificates, the commands for real machines, or a full deployment on this machine:

    fedpate deploy certs    --out DIR --hospitals K [--host H ...]
    fedpate deploy commands --certs DIR --superlink HOST:PORT --hospital h0=/data/h0 --hospital h1=/data/h1
    fedpate deploy local    --out DIR --hospitals K [--app DIR | --echo] [-c key=value ...]

`fedpate deploy STEP --help` for each step; docs/DEPLOYMENT.md in the source tree walks through a deployment."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("deploy", help="TLS certificates, SuperLink/SuperNode commands, local deployment",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="deploy_command", metavar="STEP")
    sub.required = True

    from sim.commands.common import non_negative_integer, positive_integer, positive_number

    certs = sub.add_parser("certs", help="make a CA, the SuperLink certificate and one key pair per hospital")
    certs.add_argument("--out", required=True, help="folder for ca.crt, superlink.crt/.key, supernodes/h<i>.key/.pub")
    certs.add_argument("--hospitals", type=positive_integer, required=True,
                       help="number of hospitals (names h0, h1, ...)")
    certs.add_argument("--host", action="append", default=None,
                       help="name or IP the SuperNodes use to reach the SuperLink (repeatable; "
                            "default: localhost 127.0.0.1 ::1)")
    certs.set_defaults(func=_certs)

    commands = sub.add_parser("commands", help="print the step-by-step commands for separate machines")
    commands.add_argument("--certs", required=True, help="folder written by `fedpate deploy certs`")
    commands.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink as the hospitals see it")
    commands.add_argument("--hospital", action="append", required=True, metavar="ID=DATA_DIR",
                          help="a hospital and its own data folder on its machine: MSD Task01 or a folder of BraTS case "
                               "folders (repeatable)")
    commands.add_argument("--teachers-per-hospital", type=positive_integer, default=None,
                          help="teachers each hospital trains, written into its node config (default: the node's own)")
    commands.add_argument("--epsilon-budget", type=positive_number, default=8.0,
                          help="each hospital's lifetime epsilon in its node config (default 8; its IT may change it)")
    commands.add_argument("--app", default=".", help="the fedpate source folder on the aggregator (default: .)")
    commands.add_argument("--device", default=None,
                          help="node-config device of every hospital: where it trains its teachers (auto: its GPU when "
                               "it has one, the default when omitted; cpu, cuda or cuda:N)")
    commands.add_argument("--precision", default=None, choices=("32", "bf16"),
                          help="node-config precision of every hospital (default when omitted: 32)")
    commands.set_defaults(func=_commands)

    local = sub.add_parser("local", help="start SuperLink + one SuperNode per hospital on 127.0.0.1, run, stop")
    local.add_argument("--out", required=True, help="work folder (certs, logs, pids, results)")
    local.add_argument("--hospitals", type=positive_integer, required=True,
                       help="number of hospitals (names h0, h1, ...)")
    local.add_argument("--app", default=None, help="Flower app folder (default: the fedpate app of this installation)")
    local.add_argument("--echo", action="store_true", help="run the built-in echo app (plumbing check)")
    local.add_argument("--hospital-data", action="append", default=[], metavar="ID=DATA_DIR",
                       help="data-dir of a hospital (default: empty = the preset's phantoms)")
    local.add_argument("--teachers-per-hospital", type=non_negative_integer, default=0,
                       help="teachers each hospital trains (default 0: the run config's preset's)")
    local.add_argument("--epsilon-budget", type=positive_number, default=8.0,
                       help="each hospital's lifetime epsilon, written into its node config (default 8)")
    local.add_argument("-c", "--run-config", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the app's [tool.flwr.app.config] (repeatable)")
    local.add_argument("--device", default=None,
                       help="auto|cpu|cuda|cuda:N for the aggregator's models and every local hospital's teachers "
                            "(run config and node config `device`; default: the app's, auto)")
    local.add_argument("--precision", default=None, choices=("32", "bf16"),
                       help="forward-pass precision of the run (run config and node config `precision`; default 32)")
    local.add_argument("--no-tls", action="store_true", help="plain HTTP and no SuperNode authentication")
    local.add_argument("--timeout", type=positive_number, default=3600.0,
                       help="seconds before the run is abandoned (default: 3600)")
    local.set_defaults(func=_local)


def _hospital_pairs(values: list[str], option: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        hid, sep, data = value.partition("=")
        if not sep or not hid or not data:
            raise UserError(f"{option} {value!r}: expected ID=DATA_DIR, e.g. h0=/data/h0")
        pairs.append((hid, data))
    return pairs


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _certs(args) -> int:
    from sim.deployment.tls import make_certificates

    if args.hospitals < 1:
        raise UserError(f"--hospitals: expected >= 1, got {args.hospitals}")
    ensure_folder(args.out)
    paths = make_certificates(args.out, args.host, [f"h{i}" for i in range(args.hospitals)])
    print(f"CA:        {paths['ca_cert']}   (ca.key: keep offline)")
    print(f"SuperLink: {paths['server_cert']}  {paths['server_key']}")
    for name, keys in paths["supernodes"].items():
        print(f"{name}: private {keys['private']} (to that hospital only), public {keys['public']} (register it)")
    return 0


def _commands(args) -> int:
    from sim.deployment.recipe import DeploymentRecipe, deployment_commands

    # the device spec is checked here (DeploymentRecipe) and resolved on each hospital
    print(deployment_commands(DeploymentRecipe(
        args.certs, args.superlink, _hospital_pairs(args.hospital, "--hospital"), app_dir=args.app,
        teachers_per_hospital=args.teachers_per_hospital, epsilon_budget=args.epsilon_budget,
        device=args.device or None, precision=args.precision)), end="")
    return 0


def _local(args) -> int:
    from sim.deployment.local import LocalDeployment, write_echo_app
    from task.settings.presets import get_preset
    from task.settings.runconfig import config_flag

    if args.hospitals < 1:
        raise UserError(f"--hospitals: expected >= 1, got {args.hospitals}")
    out = ensure_folder(args.out).resolve()
    data = dict(_hospital_pairs(args.hospital_data, "--hospital-data"))
    names = [f"h{i}" for i in range(args.hospitals)]
    if unknown := set(data) - set(names):
        raise UserError(f"--hospital-data: unknown hospital(s) {sorted(unknown)}; expected ids {names}")
    app = write_echo_app(out / "echo-app") if args.echo else Path(args.app or PROJECT_ROOT).resolve()
    try:
        app_config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"].get("config", {})
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"--app {app}: expected a Flower app folder with [tool.flwr.app] in pyproject.toml ({exc})")

    run_config: dict = {}
    defaults = {"out": str(out / "run"), "hospitals": args.hospitals, "expected-nodes": args.hospitals,
                "result-file": str(out / "echo-result.json")}
    run_config.update({k: v for k, v in defaults.items() if k in app_config})
    for item in args.run_config:
        key, sep, value = item.partition("=")
        if not sep or key not in app_config:
            raise UserError(f"-c {item!r}: expected KEY=VALUE with KEY one of {sorted(app_config)}")
        run_config[key] = _parse_value(value)

    if args.device or args.precision:
        from task.learning.device import resolve_device

        # everything runs on this machine: a GPU asked for and missing is refused before anything starts
        resolve_device(args.device or run_config.get("device") or "auto")
        compute = {"device": args.device, "precision": args.precision}
        run_config.update({k: v for k, v in compute.items() if v and k in app_config})
    if config_flag(run_config.get("reproducible-noise", False), "reproducible-noise"):
        raise UserError("-c reproducible-noise=true: refused; a deployment always draws secure noise "
                        "(seeded noise is for simulations only)")
    if not args.echo and not data and args.app is None:
        return _local_fedpate(args, out, run_config)
    # a deployed hospital sets its own budget and the consortium's size (it refuses to start without them)
    per_hospital = args.teachers_per_hospital or get_preset(str(run_config.get("preset", "tiny"))).teachers_per_hospital
    hospitals = [{"hospital-id": hid, "data-dir": data.get(hid, ""), "workdir": str(out / "hospitals" / hid),
                  "teachers-per-hospital": args.teachers_per_hospital, "epsilon-budget": args.epsilon_budget,
                  "max-teachers": per_hospital * len(names),
                  **({"device": args.device} if args.device else {}),
                  **({"precision": args.precision} if args.precision else {})} for hid in names]
    tls = not args.no_tls
    with LocalDeployment(app, out / "deployment", hospitals, tls=tls, auth=tls, verbose=True) as dep:
        status = dep.run(run_config, timeout=args.timeout)
    print(json.dumps({"run-id": status.run_id, "status": status.status, "seconds": round(status.seconds, 1),
                      "log": str(status.log_path)}, indent=1))
    if args.echo and (out / "echo-result.json").exists():
        print((out / "echo-result.json").read_text())
    return 0 if status.ok else 1


def _local_fedpate(args, out: Path, run_config: dict) -> int:
    """The real fedpate app on the preset's world: one MSD folder per hospital, exported from the world."""
    from task.settings.runconfig import RunSettings
    from sim.deployment.fedpate_local import run_local_deployment

    config = {"hospitals": args.hospitals, **run_config}
    if args.teachers_per_hospital:
        config["teachers-per-hospital"] = args.teachers_per_hospital
    settings = RunSettings.from_run_config(config, out=str(run_config.get("out", out / "run")))
    preset = settings.resolved_preset
    print(f"deploy local: runs {settings.method} (choose another with -c method=NAME) at epsilon {settings.budget:g}, "
          f"delta {settings.resolved_delta:g}, preset {preset.name}: {preset.hospitals} hospitals x "
          f"{preset.teachers_per_hospital} teachers, each hospital its own SuperNode process; results in "
          f"{settings.out}", flush=True)
    results = run_local_deployment(settings, out, tls=not args.no_tls, timeout=args.timeout, verbose=True)
    dice = (results.get("dice") or {}).get("mean")
    print(json.dumps({"method": results["method"], "mean_dice": dice, "epsilon": results["epsilon"],
                      "delta": results["delta"], "relation": results["relation"],
                      "dropped_hospitals": results.get("dropped_hospitals"), **results["deployment"]}, indent=1))
    print(f"results: {settings.out}/results.json")
    return 0
