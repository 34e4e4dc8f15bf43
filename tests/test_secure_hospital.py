"""Hospitals in the secure sum (clients/secure.py SecureHospital): each charges its own ledger for the noise
it can count on before any teacher runs, the sum of their noised contributions is the teachers' sum, and a
request below a hospital's threat-model policy is refused with nothing charged."""

from pathlib import Path

import numpy as np
import pytest

from clients.hospital import Hospital, HospitalSettings
from clients.secure import SecureHospital, SecurePolicy, SecureRequestRefused
from privacy.accountants import epsilon_spent
from privacy.distributed import IntegerGrid, calibrate_local_variance, centered, ddg_event
from privacy.errors import BudgetExceeded
from privacy.ledger import Ledger
from task.codecs import PCACompressor
from server.secure import secure_sum
from task import codecs
from task.settings.presets import get_preset

GRID = (8, 8, 8)
PRESET = get_preset("tiny")
DELTA = 1e-3


class FixedTeachers(Hospital):
    """Teachers that answer fixed probabilities (no training); counts how often a teacher ran."""

    def __init__(self, name, tmp_path, teachers, level):
        super().__init__(name, prepared=None, partitions=[[f"{name}-p{k}"] for k in range(teachers)], preset=PRESET,
                         workdir=tmp_path / name, settings=HospitalSettings(lifetime_epsilon=8.0, delta=DELTA))
        self.level = level
        self.runs = 0

    def load_teachers(self, config=None):
        pass

    def teacher_probs(self, k, scans, config=None):
        self.runs += 1
        probs = np.full((len(scans), 4, *GRID), 0.1, np.float32)
        probs[:, (k + self.level) % 4] = 0.7
        return probs


def _codec():
    rng = np.random.default_rng(0)
    maps = codecs.one_hot(rng.integers(0, 4, size=(12, *GRID)), 4)
    return codecs.verify_codec(PCACompressor(4, "public").fit(maps).state())


def _world(tmp_path, policy=None, names=("h0", "h1", "h2"), budget=8.0, identities=None):
    hospitals = [FixedTeachers(n, tmp_path, 2, i) for i, n in enumerate(names)]
    policy = policy or SecurePolicy()
    config = {"ledger_dir": str(tmp_path / "ledgers"), "lifetime_epsilon": budget, "delta": DELTA,
              "secure_policy": policy.to_dict(), "secure_noise_seed": 7}
    secure = {h.hospital_id: SecureHospital(h, None, (identities or {}).get(h.hospital_id)) for h in hospitals}

    def exchange(stage, messages):
        return {h: secure[h].handle(stage, m, config) for h, m in messages.items()}

    return hospitals, exchange, config


def _declaration(codec, scans, shares, participants, variance=None, release="q", epsilon=2.0, total=None,
                 policy=None):
    """An honest server's declaration; ``policy``: the threat model it declares (default: the one whose
    counted shares are ``shares`` -- colluders 0 and ``participants - shares`` dropouts)."""
    grid = IntegerGrid.for_rows(codecs.row_bound(codec), int(codec["latent_dim"]))
    variance = variance or calibrate_local_variance(epsilon, DELTA, scans, grid, shares)
    policy = policy or SecurePolicy(dropouts=participants - shares)
    return grid, {"local_variance": variance, "shares": shares,
                  "total_variance": shares * variance if total is None else total,
                  "colluders": policy.colluders, "dropouts": policy.dropouts,
                  "clip": grid.clip, "granularity": grid.granularity, "dimension": grid.dimension,
                  "release_ids": [f"{release}-{i}" for i in range(scans)]}


def _ledger_records(tmp_path, name):
    path = tmp_path / "ledgers" / f"{name}.jsonl"
    return [] if not path.exists() else Ledger(path).events(name)


def test_secure_pate_sum_and_each_hospitals_charge(tmp_path):
    hospitals, exchange, config = _world(tmp_path, SecurePolicy(colluders=1))
    codec, scans = _codec(), np.zeros((2, 4, *GRID), np.float32)
    counted = 3 - 1
    grid, noise = _declaration(codec, len(scans), counted, 3, policy=SecurePolicy(colluders=1))
    latent = grid.dimension
    inputs = {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals}
    result = secure_sum(exchange, [h.hospital_id for h in hospitals], 2, 40, len(scans) * latent, noise, inputs)
    summed = grid.to_reals(centered(result.total, 40)).reshape(len(scans), latent)
    clean = sum(codecs.encode(codec, h.teacher_probs(k, scans)) for h in hospitals for k in range(2))
    noise_sd = grid.granularity * np.sqrt(3 * noise["local_variance"])
    assert np.max(np.abs(summed - clean)) < 6 * noise_sd + 6 * 6 * grid.granularity
    event = ddg_event(grid, noise["local_variance"], counted, 1)
    for h in hospitals:
        events = _ledger_records(tmp_path, h.hospital_id)
        assert events == [event, event]            # one release per query, the counted shares
        spent = Ledger(tmp_path / "ledgers" / f"{h.hospital_id}.jsonl").spent(h.hospital_id, DELTA)
        # against dp_accounting: its RDP accountant on the same zCDP
        from dp_accounting import dp_event
        from dp_accounting.rdp import rdp_privacy_accountant

        theirs = rdp_privacy_accountant.RdpAccountant()
        theirs.compose(dp_event.ZCDpEvent(2 * event.rho))
        assert spent.epsilon == pytest.approx(theirs.get_epsilon(DELTA), rel=1e-9)
        assert spent.epsilon <= 2.0
        assert spent.epsilon == pytest.approx(epsilon_spent([event, event], DELTA)[0])


@pytest.mark.parametrize("policy, declared, change, match", [
    (SecurePolicy(colluders=2), SecurePolicy(colluders=2), {"threshold": 2}, "threshold"),   # threshold <= colluders
    (SecurePolicy(min_threshold=3), None, {"threshold": 2}, "threshold"),       # below the policy's minimum
    (SecurePolicy(min_participants=4), None, {}, "needs at least 4"),          # too few participants
    (SecurePolicy(), None, {"total_variance": "double"}, "do not add up"),     # shares that do not add up
    (SecurePolicy(dropouts=1), SecurePolicy(dropouts=1), {}, "can rely on 2"),  # claims 3 shares, 2 countable
    (SecurePolicy(dropouts=1), None, {}, "must assume the same"),              # it assumes more than declared
    (SecurePolicy(), SecurePolicy(dropouts=1), {"shares": 2}, "must assume the same"),   # ... or fewer
    (SecurePolicy(), None, {"no_threat": True}, "must declare its colluders"),   # a declaration without one
])
def test_a_request_below_policy_is_refused_with_nothing_charged(tmp_path, policy, declared, change, match):
    hospitals, exchange, config = _world(tmp_path, policy)
    codec, scans = _codec(), np.zeros((2, 4, *GRID), np.float32)
    grid, noise = _declaration(codec, len(scans), change.get("shares", 3), 3, variance=1e6,
                               policy=declared or SecurePolicy())
    if change.get("total_variance") == "double":
        noise["total_variance"] *= 2
    if change.get("no_threat"):
        del noise["colluders"], noise["dropouts"]
    inputs = {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals}
    with pytest.raises(SecureRequestRefused, match=match):
        secure_sum(exchange, [h.hospital_id for h in hospitals], change.get("threshold", 2), 40,
                   len(scans) * grid.dimension, noise, inputs)
    for h in hospitals:
        assert _ledger_records(tmp_path, h.hospital_id) == []
        assert h.runs == 0


def test_a_budget_the_release_would_exceed_is_refused_before_any_teacher_runs(tmp_path):
    hospitals, exchange, config = _world(tmp_path, budget=0.5)
    codec, scans = _codec(), np.zeros((2, 4, *GRID), np.float32)
    grid, noise = _declaration(codec, len(scans), 3, 3, epsilon=2.0)
    inputs = {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals}
    with pytest.raises(BudgetExceeded):
        secure_sum(exchange, [h.hospital_id for h in hospitals], 2, 40, len(scans) * grid.dimension, noise, inputs)
    assert all(h.runs == 0 for h in hospitals)
    assert all(_ledger_records(tmp_path, h.hospital_id) == [] for h in hospitals)


def test_more_dropouts_than_counted_leave_the_sum_masked(tmp_path):
    """A hospital that counted on at most one dropout refuses to unmask when two left after charging."""
    names = ("h0", "h1", "h2", "h3", "h4")
    hospitals, exchange, config = _world(tmp_path, SecurePolicy(dropouts=1), names=names)
    codec, scans = _codec(), np.zeros((1, 4, *GRID), np.float32)
    grid, noise = _declaration(codec, 1, 4, 5, variance=1e6)
    inputs = {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals}

    def dropping(stage, messages):
        if stage == "collect-masked":
            messages = {h: m for h, m in messages.items() if h not in ("h2", "h3")}
        return exchange(stage, messages)

    with pytest.raises(SecureRequestRefused, match="masked inputs arrived"):
        secure_sum(dropping, list(names), 3, 40, grid.dimension, noise, inputs)


def test_a_hospital_without_teachers_refuses_before_it_is_charged(tmp_path):
    from task.errors import UserError

    hospitals, exchange, config = _world(tmp_path)
    untrained = Hospital("h9", prepared=None, partitions=[["p0"]], preset=PRESET, workdir=tmp_path / "h9",
                         settings=HospitalSettings(lifetime_epsilon=8.0, delta=DELTA))
    secure = {h.hospital_id: SecureHospital(h) for h in hospitals + [untrained]}
    codec, scans = _codec(), np.zeros((1, 4, *GRID), np.float32)
    grid, noise = _declaration(codec, 1, 4, 4, variance=1e6)
    names = [h.hospital_id for h in hospitals] + ["h9"]
    with pytest.raises(UserError):
        secure_sum(lambda stage, messages: {h: secure[h].handle(stage, m, config) for h, m in messages.items()},
                   names, 2, 40, grid.dimension, noise, {h: {"scans": scans, "codec": codec} for h in names})
    assert _ledger_records(tmp_path, "h9") == []


def test_a_deployed_hospital_refuses_seeded_noise_before_it_is_charged(tmp_path):
    """Seeded noise is for simulations: a deployed hospital asked for it refuses, and its own ledger stays empty.
    A deployed hospital without the consortium's roster refuses every secure sum at setup."""
    from tests.test_secure_sum import _identities

    codec, scans = _codec(), np.zeros((1, 4, *GRID), np.float32)
    grid, noise = _declaration(codec, 1, 3, 3, variance=1e6)
    hospitals, exchange, config = _world(tmp_path / "no-roster")
    for hospital in hospitals:
        hospital.deployed = True
    with pytest.raises(SecureRequestRefused, match="secure-roster"):
        secure_sum(exchange, [h.hospital_id for h in hospitals], 2, 40, grid.dimension, noise,
                   {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals})
    hospitals, exchange, config = _world(tmp_path, identities=_identities(["h0", "h1", "h2"]))
    for hospital in hospitals:   # the simulation's config asks for secure_noise_seed 7
        hospital.deployed = True
    with pytest.raises(SecureRequestRefused, match="seeded noise"):
        secure_sum(exchange, [h.hospital_id for h in hospitals], 2, 40, grid.dimension, noise,
                   {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals})
    assert all(h.runs == 0 for h in hospitals)
    for hospital in hospitals:   # a deployed hospital's ledger is its own, not the simulation's ledger_dir
        path = Path(hospital.privacy_ledger)
        assert not path.exists() or Ledger.load(path).records() == []


def test_mixed_dropout_policies_never_record_less_noise_than_the_release_had(tmp_path):
    """Four hospitals; h0 assumes no dropout, the others one, and the server declares one (three counted
    shares, 8 queries calibrated to epsilon 1); h3 leaves after sharing its keys. h0 would count four shares --
    epsilon 0.845 in its ledger -- while the sum is unmasked with three (0.9995 spent). Whatever the threshold,
    every hospital's ledger records at least what the released sums cost it: h0 refuses the request (its
    policy differs from the declared one) and nothing is released with fewer shares than anyone counted."""
    from clients.secure import SecureRequestRefused
    from server.secure import SecureSumFailed

    names = ("h0", "h1", "h2", "h3")
    codec, scans = _codec(), np.zeros((8, 4, *GRID), np.float32)
    grid, noise = _declaration(codec, 8, 3, 4, epsilon=1.0, policy=SecurePolicy(dropouts=1))
    for threshold in (2, 3):   # the old default, and the smallest one a server lying about dropouts cannot exploit
        root = tmp_path / f"threshold-{threshold}"
        hospitals = [FixedTeachers(n, root, 2, i) for i, n in enumerate(names)]
        config = {"ledger_dir": str(root / "ledgers"), "lifetime_epsilon": 8.0, "delta": DELTA}
        secure = {h.hospital_id: SecureHospital(h, SecurePolicy(dropouts=0 if h.hospital_id == "h0" else 1))
                  for h in hospitals}
        refusals = {}

        def exchange(stage, messages):   # a refusal leaves that hospital out, as the transports do
            replies = {}
            for h, m in messages.items():
                if h == "h3" and stage in ("collect-masked", "unmask"):
                    continue
                try:
                    replies[h] = secure[h].handle(stage, m, config)
                except SecureRequestRefused as exc:
                    refusals.setdefault(h, str(exc))
            return replies

        try:
            result = secure_sum(exchange, list(names), threshold, 40, 8 * grid.dimension, noise,
                                {h: {"scans": scans, "codec": codec} for h in names})
            in_sum = len(result.survivors)
        except SecureSumFailed:
            in_sum = None
        spent_on_release = epsilon_spent([ddg_event(grid, noise["local_variance"], in_sum or 1, 8)], DELTA)[0]
        assert spent_on_release == pytest.approx(0.9995, abs=5e-4) or in_sum != 3
        for name in names:
            events = _ledger_records(root, name)
            if in_sum is not None and events:
                own = Ledger(root / "ledgers" / f"{name}.jsonl").spent(name, DELTA).epsilon
                assert own >= spent_on_release * (1 - 1e-9), (name, own, spent_on_release)
            assert all(e.shares <= (in_sum or 3) for e in events), (name, [e.shares for e in events])
        assert _ledger_records(root, "h0") == [] and "must assume the same" in refusals["h0"]
