"""End to end through Flower: the simulation engine, and real SuperLink/SuperNode processes with TLS and
SuperNode authentication on localhost -- including a hospital killed during the query phase."""

import json

import pytest

from privacy.ledger import Ledger
from task.learning.compute import Compute
from task.reporting.bundle import load_bundle
from task.settings.runconfig import RunSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedpate-cache")
    with pytest.MonkeyPatch.context() as env:   # module scope: the function-scoped monkeypatch cannot
        env.setenv("FEDPATE_CACHE", str(root))
        yield root


def _check_run(out, results):
    ledger = Ledger.load(out / "ledger.jsonl")
    worst = max(ledger.spent(o, results["delta"], relation=results["relation"]).epsilon for o in ledger.owners())
    assert results["epsilon"] == pytest.approx(worst)
    assert results["epsilon"] <= results["epsilon_budget"]
    assert load_bundle(out).card["epsilon"] == pytest.approx(worst)
    for key in ("method", "dice", "epsilon", "epsilon_budget", "delta", "relation", "accountant", "teachers",
                "hospitals", "queries", "sigma", "teacher_dice_mean", "ensemble_dice_mean",
                "bytes_up_per_query_per_teacher", "wall_seconds", "seed"):
        assert key in results, key
    return ledger


def test_pate_ae_in_flower_simulation_engine(cache, tmp_path):
    from sim.runners.simulation import simulate

    out = tmp_path / "sim"
    settings = RunSettings(method="pate-ae", preset="tiny", out=str(out), compute=Compute(progress=False))
    (results,) = simulate(settings, engine="flower")
    ledger = _check_run(out, results)
    assert results["method"] == "pate-ae" and results["teachers"] == 8 and results["hospitals"] == 2
    assert sorted(ledger.owners()) == ["hospital-00", "hospital-01"]
    assert results["bytes_up_measured_per_query_per_teacher"] == results["bytes_up_per_query_per_teacher"]
    assert list((out / "predictions").glob("*.nii.gz"))


def test_deployment_with_tls_and_a_hospital_killed_during_queries(cache, tmp_path):
    from sim.deployment.fedpate_local import run_local_deployment

    out = tmp_path / "run"
    settings = RunSettings(method="pate-pca", preset="tiny", out=str(out), query_batch=2,
                           wait_seconds=180, reply_timeout=150, query_timeout=45, compute=Compute(progress=False))
    # training has its own deadline: 45 s was too short for teacher training on a loaded machine (load 12:
    # hospital-01 timed out before the first query); a query round is inference only, and the killed
    # hospital costs the query deadline once
    results = run_local_deployment(settings, tmp_path / "work", timeout=900,
                                   kill_hospital_during_queries="hospital-01")
    assert results["deployment"]["status"] == "finished:completed"
    assert results["deployment"]["tls"] and results["deployment"]["supernode_auth"]
    assert "hospital-01" in results["dropped_hospitals"]
    ledger = _check_run(out, results)
    teachers = [r["note"]["teachers"] for r in ledger.records() if ":query-" in r["release_id"]]
    assert teachers[0] == 8 and teachers[-1] == 4, teachers   # the reduced K is in the ledger
    assert ledger.spent("hospital-00", 1e-3).releases > ledger.spent("hospital-01", 1e-3).releases


def test_pate_pca_through_flwr_run_and_a_simulation_superlink(cache, tmp_path):
    """The path `flwr run .` takes: a --simulation SuperLink (own port, stopped by PID) + flwr run -c ..."""
    from sim.runners.simulation import simulate

    out = tmp_path / "runtime"
    settings = RunSettings(method="pate-pca", preset="tiny", out=str(out), compute=Compute(progress=False))
    (results,) = simulate(settings, engine="runtime")
    _check_run(out, results)
    assert results["hospitals"] == 2 and results["dropped_hospitals"] == {}


def _check_secure(out, results, hospital_ledgers):
    """A secure PATE run's results: ε is the run ledger's (distributed discrete Gaussians, RDP), and every
    hospital charged its own ledger one release per query the run charged it."""
    from privacy.events import DistributedDiscreteGaussianEvent

    ledger = _check_run(out, results)
    assert results["aggregation"] == "secure" and results["accountant"] == "rdp"
    assert results["secure_aggregation"]["failed_batches"] == 0 and results["dropped_hospitals"] == {}
    assert "uniform modulo" in results["who_sees_what"]["aggregator"]
    for hospital in ledger.owners():
        run_events = ledger.events(hospital)
        own = Ledger.load(hospital_ledgers[hospital]).events(hospital)
        assert len(run_events) == results["queries"] == 8
        assert own == run_events and all(isinstance(e, DistributedDiscreteGaussianEvent) for e in own)


def test_secure_pate_in_flower_simulation_engine_matches_the_in_process_engine(cache, tmp_path):
    """pate-anchored-secure as a ServerApp and ClientApps in Flower's simulation engine: the secure stages
    travel as Flower messages, each hospital's secrets stay in its node's context.state, and results.json
    has what the in-process engine's has."""
    from sim.runners.simulation import simulate

    runs = {}
    for engine in ("inprocess", "flower"):
        out = tmp_path / engine
        settings = RunSettings(method="pate-anchored-secure", preset="tiny", out=str(out),
                               compute=Compute(progress=False))
        (runs[engine],) = simulate(settings, engine=engine)
        _check_secure(out, runs[engine], {h: out / "hospital-ledgers" / f"{h}.jsonl"
                                          for h in ("hospital-00", "hospital-01")})
    flower, inprocess = runs["flower"], runs["inprocess"]
    assert set(flower) == set(inprocess)
    assert set(flower["secure_aggregation"]) == set(inprocess["secure_aggregation"])
    for key in ("participants", "counted_shares", "threshold", "bits", "local_variance", "granularity"):
        assert flower["secure_aggregation"][key] == inprocess["secure_aggregation"][key], key
    # the same bytes per hospital and batch: the same messages, whichever engine carried them
    assert flower["secure_aggregation"]["bytes_up_per_hospital"] == inprocess["secure_aggregation"]["bytes_up_per_hospital"]
    assert flower["epsilon"] == pytest.approx(inprocess["epsilon"])


def test_secure_dp_fedavg_in_flower_simulation_engine_is_the_in_process_run(cache, tmp_path):
    """dp-fedavg-secure as a ServerApp and ClientApps in Flower's simulation engine (Ray): every step's secure
    sum travels as Flower messages; under reproducible noise (simulation only) the hospitals' shares are seeded,
    so the trained head -- and with it Dice and the ledger's epsilon -- is the in-process engine's exactly."""
    from sim.runners.simulation import simulate

    runs = {}
    for engine in ("inprocess", "flower"):
        settings = RunSettings(method="dp-fedavg-secure", preset="tiny", out=str(tmp_path / engine),
                               reproducible_noise=True, compute=Compute(progress=False))
        (runs[engine],) = simulate(settings, engine=engine)
    flower, inprocess = runs["flower"], runs["inprocess"]
    assert flower["aggregation"] == inprocess["aggregation"] == "secure"
    assert flower["dice"] == inprocess["dice"] and flower["epsilon"] == inprocess["epsilon"] <= flower["epsilon_budget"]
    assert flower["seed"] is None and flower["noise"] == "reproducible"
    assert flower["secure_aggregation"]["bits"] == inprocess["secure_aggregation"]["bits"]


def test_secure_pate_deployed_with_tls_and_supernode_authentication(cache, tmp_path):
    """pate-anchored-secure across separate SuperNode processes (TLS, authenticated keys): each deployed
    hospital checks the request against its own policy (node config), keeps its secrets on its node and
    charges its own ledger (workdir/privacy-ledger.jsonl)."""
    from sim.deployment.fedpate_local import run_local_deployment

    out, work = tmp_path / "run", tmp_path / "work"
    settings = RunSettings(method="pate-anchored-secure", preset="tiny", out=str(out),
                           wait_seconds=180, reply_timeout=300, query_timeout=120, compute=Compute(progress=False))
    results = run_local_deployment(settings, work, timeout=900)
    assert results["deployment"]["status"] == "finished:completed"
    assert results["deployment"]["tls"] and results["deployment"]["supernode_auth"]
    _check_secure(out, results, {h: work / "hospitals" / h / "privacy-ledger.jsonl"
                                 for h in ("hospital-00", "hospital-01")})


def test_secure_dp_fedavg_deployed_with_tls_and_supernode_authentication(cache, tmp_path):
    """dp-fedavg-secure across separate SuperNode processes (TLS, authenticated keys): every step is a secure sum
    of the deployed hospitals' clipped patient gradients with their own noise shares; each hospital checks the
    request against its node-config policy and charges its own ledger one distributed discrete Gaussian per step,
    and the run's epsilon is its ledger's. A short variant of the tiny preset (one epoch of expected batch 17 of the
    34 patients: two steps, each four message rounds of some 8 s) keeps the test to minutes; the protocol per step is
    the full one."""
    from privacy.events import DistributedDiscreteGaussianEvent
    from sim.deployment.fedpate_local import run_local_deployment
    from task.settings.presets import get_preset

    out, work = tmp_path / "run", tmp_path / "work"
    preset = get_preset("tiny").with_changes(central_epochs=1, dp_sgd=dict(batch_size=17))
    settings = RunSettings(method="dp-fedavg-secure", preset=preset, out=str(out), compute=Compute(progress=False),
                           wait_seconds=180, reply_timeout=300, query_timeout=120)
    results = run_local_deployment(settings, work, timeout=1200)
    assert results["deployment"]["status"] == "finished:completed"
    assert results["deployment"]["tls"] and results["deployment"]["supernode_auth"]
    assert results["aggregation"] == "secure" and results["dropped_hospitals"] in ({}, [], None)
    steps = results["secure_aggregation"]["steps_released"]
    assert steps >= 1
    run_ledger = Ledger.load(out / "ledger.jsonl")
    worst = max(run_ledger.spent(o, results["delta"], relation=results["relation"]).epsilon
                for o in run_ledger.owners())
    assert results["epsilon"] == pytest.approx(worst) and results["epsilon"] <= results["epsilon_budget"]
    for hospital in ("hospital-00", "hospital-01"):
        own = Ledger.load(work / "hospitals" / hospital / "privacy-ledger.jsonl").events(hospital)
        assert len(own) == steps and all(isinstance(e, DistributedDiscreteGaussianEvent) for e in own)
        assert own == run_ledger.events(hospital)
