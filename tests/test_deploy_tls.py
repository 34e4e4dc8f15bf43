"""TLS material for a deployment (sim/deployment/tls.py) and the pure helpers of sim/deployment/ (flower_cli, recipe, the echo app)."""

import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from task.errors import UserError
from sim.deployment.flower_cli import config_string, parse_run_id
from sim.deployment.local import write_echo_app
from sim.deployment.recipe import DeploymentRecipe, deployment_commands
from sim.deployment.tls import certificate_sans, make_certificates, verify_chain


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"), None, ["h0", "h1"])


def test_server_certificate_chains_to_ca_and_has_sans(certs):
    verify_chain(certs["ca_cert"], certs["server_cert"])
    assert set(certificate_sans(certs["server_cert"])) == {"localhost", "127.0.0.1", "::1"}
    ca = x509.load_pem_x509_certificate(certs["ca_cert"].read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_foreign_ca_does_not_verify(certs, tmp_path):
    other = make_certificates(tmp_path, ["example.org"], [])
    with pytest.raises(Exception):
        verify_chain(other["ca_cert"], certs["server_cert"])
    assert certificate_sans(other["server_cert"]) == ["example.org"]


def test_private_keys_are_0600_and_public_files_are_not_secret(certs):
    private = [certs["ca_key"], certs["server_key"]]
    for keys in certs["supernodes"].values():
        private += [keys["private"], keys["private_pem"]]
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(certs["ca_cert"].stat().st_mode) == 0o644


def test_supernode_keys_are_p384_in_the_formats_flower_reads(certs):
    keys = certs["supernodes"]["h0"]
    private = load_ssh_private_key(keys["private"].read_bytes(), None)   # what flower-supernode does
    public = load_ssh_public_key(keys["public"].read_bytes())              # what `flwr supernode register` does
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert public.public_numbers() == private.public_key().public_numbers()
    assert keys["public"].read_text().startswith("ecdsa-sha2-nistp384 ")
    other = load_ssh_public_key(certs["supernodes"]["h1"]["public"].read_bytes())
    assert other.public_numbers() != public.public_numbers()


def test_bad_names_are_user_errors(tmp_path):
    with pytest.raises(UserError):
        make_certificates(tmp_path, None, ["h0", "h0"])
    with pytest.raises(UserError):
        make_certificates(tmp_path, None, ["../evil"])


def test_config_string_is_what_flower_parses():
    from flwr.common.config import parse_config_args

    config = {"hospital-id": "h0", "data-dir": "/data/with space/h0", "teachers-per-hospital": 2,
              "ratio": 0.5, "flag": True}
    assert parse_config_args([config_string(config)]) == config
    with pytest.raises(UserError):
        config_string({"bad key": 1})


def test_parse_run_id():
    assert parse_run_id("\x1b[32mSuccessfully started run 123456\x1b[0m\n...") == 123456
    assert parse_run_id("error") is None


def test_deployment_commands_cover_every_hospital(certs):
    text = deployment_commands(DeploymentRecipe(certs["ca_cert"].parent, "agg.example.org:9093",
                                                [("h0", "/data/h0"), ("h1", "/srv/msd/h1")], teachers_per_hospital=2))
    assert "flower-superlink --host 0.0.0.0 --port 9093" in text
    assert "--enable-supernode-auth" in text
    for hid, data in (("h0", "/data/h0"), ("h1", "/srv/msd/h1")):
        assert f"flwr supernode register /etc/fedpate/certs/{hid}.pub fedpate" in text
        assert f"--auth-supernode-private-key /etc/fedpate/certs/{hid}.key" in text
        assert f'data-dir="{data}"' in text
    assert text.count("flower-supernode --superlink agg.example.org:9093") == 2
    with pytest.raises(UserError, match="--superlink"):
        DeploymentRecipe(certs["ca_cert"].parent, "no-port", [("h0", "/d")])
    with pytest.raises(UserError, match="--device"):
        DeploymentRecipe(certs["ca_cert"].parent, "agg.example.org:9093", [("h0", "/d")], device="gpu")


def test_echo_app_is_a_valid_flower_app(tmp_path):
    from flwr.common.config import validate_fields_in_config
    import tomllib

    app = write_echo_app(tmp_path / "app")
    ok, errors, _ = validate_fields_in_config(tomllib.loads((app / "pyproject.toml").read_text()))
    assert ok, errors


def test_cli_certs_and_commands(tmp_path, capsys):
    from sim.cli import main

    assert main(["deploy", "certs", "--out", str(tmp_path / "c"), "--hospitals", "2", "--host", "agg.test"]) == 0
    assert certificate_sans(tmp_path / "c" / "superlink.crt") == ["agg.test"]
    assert (tmp_path / "c" / "supernodes" / "h1.pub").exists()
    assert main(["deploy", "commands", "--certs", str(tmp_path / "c"), "--superlink", "agg.test:9093",
                 "--hospital", "h0=/d0", "--hospital", "h1=/d1"]) == 0
    out = capsys.readouterr().out
    assert "flwr supernode register /etc/fedpate/certs/h1.pub fedpate" in out
    assert main(["deploy", "commands", "--certs", str(tmp_path / "c"), "--superlink", "agg.test:9093",
                 "--hospital", "h0"]) == 2
    assert main(["deploy", "local", "--out", str(tmp_path / "l"), "--hospitals", "2", "-c", "no-such-key=1"]) == 2


def test_the_roster_lists_every_hospitals_key_and_a_node_checks_its_own_against_it(certs, tmp_path):
    """``deploy certs`` writes roster.txt (every hospital's SuperNode public key); a deployed node's
    secure-roster and secure-signing-key must both be given, readable and match -- one line otherwise."""
    from clients.node import secure_identity_for
    from task.wire.secagg import Roster

    roster = Roster.load(certs["roster"])
    assert sorted(roster.keys) == ["h0", "h1"]
    for name in ("h0", "h1"):
        public = load_ssh_public_key(certs["supernodes"][name]["public"].read_bytes())
        assert roster.verify(name, b"x", b"") is False
        assert load_ssh_public_key(roster.keys[name]).public_numbers() == public.public_numbers()
    node = {"data-dir": "/d", "hospital-id": "h0", "secure-roster": str(certs["roster"]),
            "secure-signing-key": str(certs["supernodes"]["h0"]["private"])}
    identity = secure_identity_for(node)
    assert identity.roster.verify("h0", b"statement", identity.sign(b"statement"))
    assert not identity.roster.verify("h1", b"statement", identity.sign(b"statement"))
    assert secure_identity_for({**node, "secure-signing-key": str(certs["supernodes"]["h0"]["private_pem"])})
    assert secure_identity_for({"data-dir": "/d", "hospital-id": "h0"}) is None
    bad = tmp_path / "roster.txt"
    bad.write_text("h0 ssh-rsa AAAA\n")
    for change, message in [({"secure-roster": ""}, "'secure-roster' is required next to 'secure-signing-key'"),
                            ({"secure-signing-key": ""}, "'secure-signing-key' is required next to 'secure-roster'"),
                            ({"secure-roster": str(tmp_path / "none")}, "cannot be read"),
                            ({"secure-roster": str(bad)}, "line 1"),
                            ({"hospital-id": "h9"}, "not on the secure-roster"),
                            ({"secure-signing-key": str(certs["supernodes"]["h1"]["private"])}, "not the key")]:
        with pytest.raises(UserError, match=message) as error:
            secure_identity_for({**node, **change})
        assert "\n" not in str(error.value)
    text = deployment_commands(DeploymentRecipe(certs["ca_cert"].parent, "agg.example.org:9093",
                                                [("h0", "/data/h0"), ("h1", "/data/h1")]))
    assert "roster.txt" in text and 'secure-signing-key="/etc/fedpate/certs/h1.key"' in text
    with pytest.raises(UserError, match="--hospital h7: not on"):
        DeploymentRecipe(certs["ca_cert"].parent, "agg.example.org:9093", [("h0", "/d"), ("h7", "/d")])


def test_deploy_commands_refuse_missing_certificates_in_one_line(tmp_path, certs, capsys):
    """Printing steps whose first ``scp`` fails on another machine helps nobody: a missing folder, a hospital
    without its key pair, or a hospital not on the roster is refused in one line naming what is missing."""
    import shutil

    from sim.cli import main

    partial = tmp_path / "partial"
    shutil.copytree(certs["ca_cert"].parent, partial)
    (partial / "supernodes" / "h1.pub").unlink()
    for folder, hospitals, missing in ((tmp_path / "absent", ["h0=/d"], "no such folder"),
                                       (certs["ca_cert"].parent, ["h0=/d", "h7=/d"], "--hospital h7: not on"),
                                       (tmp_path, ["h0=/d"], "no roster.txt"),
                                       (partial, ["h0=/d", "h1=/d"], "missing supernodes/h1.pub")):
        argv = ["deploy", "commands", "--certs", str(folder), "--superlink", "agg.test:9093"]
        for hospital in hospitals:
            argv += ["--hospital", hospital]
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and missing in captured.err


def test_deploy_local_says_what_it_runs_before_it_starts(tmp_path, capsys, monkeypatch):
    """`deploy local` without an app runs the fedpate app's default method: it names it (and how to choose
    another), the budget and the consortium first, then reports as it goes -- not minutes of silence."""
    import sim.deployment.fedpate_local as fedpate_local
    from sim.cli import main

    seen = {}

    def deployed(settings, out, **kwargs):
        seen.update(kwargs, method=settings.method)
        print("[deploy] running", flush=True)
        return {"method": settings.method, "dice": {"mean": 0.5}, "epsilon": 1.0, "delta": 1e-3,
                "relation": "replace-one", "dropped_hospitals": {}, "deployment": {"run_id": 1}}

    monkeypatch.setattr(fedpate_local, "run_local_deployment", deployed)
    assert main(["deploy", "local", "--out", str(tmp_path / "l"), "--hospitals", "2"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("deploy local: runs pate-ae (choose another with -c method=NAME) at epsilon")
    assert "2 hospitals" in first and seen["verbose"] is True and seen["method"] == "pate-ae"


def test_a_running_deployment_reports_its_progress(tmp_path, capsys):
    from concurrent.futures import Future
    import threading

    from sim.deployment.fedpate_local import _wait_saying_progress

    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"a": 1}\n{"b": 2}\n')
    future = Future()
    threading.Timer(0.35, lambda: future.set_result("done")).start()
    said = []
    assert _wait_saying_progress(future, ledger, said.append, every=0.1) == "done"
    assert said and all("still running after" in line for line in said) and "2 release(s)" in said[0]
