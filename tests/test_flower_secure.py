"""The secure sum over Flower messages: ``FlowerTransport.secure_stage`` against the real ClientApp over an
in-memory Grid (tests/test_flower_transport.py's MemoryGrid). The sum is the in-process engine's, the
server-side of the transport receives masked vectors that are uniform modulo 2^bits and never a hospital's
contribution or secret, the secrets live in the node's ``context.state`` and are dropped after the unmask
stage, a hospital leaving mid-protocol is recovered, and a whole secure PATE run goes through."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flwr.app import RecordDict

from clients import node as node_module
from clients.client_app import NodeSecureSessions
from clients.secure import FINISHED, SecureHospital, SecurePolicy, restore_session, run_stage, session_state
from privacy.distributed import centered
from privacy.ledger import Ledger
from server.flower_transport import FlowerTransport, TransportSettings
from server.secure import secure_sum
from task.learning.compute import Compute
from task.errors import UserError
from task.wire.flower_wire import read_content
from tests.test_flower_transport import PRESET, MemoryGrid
from tests.test_secure_hospital import DELTA, GRID, FixedTeachers, _codec, _declaration

BITS = 40
REPO = Path(__file__).resolve().parents[1]


class RecordingGrid(MemoryGrid):
    """A MemoryGrid that keeps every secure-sum message sent and every reply the server receives (decoded
    as the transport decodes them), and a snapshot of each node's ``context.state`` after every message."""

    def __init__(self, world_dir, nodes=2):
        super().__init__(world_dir, nodes)
        self.outgoing: list[tuple[int, dict, dict]] = []
        self.incoming: list[tuple[int, str, dict, dict]] = []
        self.states: list[RecordDict] = []

    def send_and_receive(self, messages, *, timeout=None):
        stages = {}
        for message in messages:
            if message.metadata.message_type == "query.secure":
                config, arrays = read_content(message.content)
                stages[message.metadata.dst_node_id] = config["stage"]
                self.outgoing.append((message.metadata.dst_node_id, config, arrays))
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            node = reply.metadata.src_node_id
            if node in stages and not reply.has_error():
                config, arrays = read_content(reply.content)
                self.incoming.append((node, stages[node], config, arrays))
        for node in stages:
            self.states.append(RecordDict(dict(self.contexts[node].state)))
        return replies


def _fixed_federation(tmp_path, n=3, policy=None, grid_class=RecordingGrid):
    """``n`` hospitals with fixed teachers (no training) behind the real ClientApp, connected."""
    world = str(tmp_path / "world")
    grid = grid_class(world, nodes=n)
    hospitals = [FixedTeachers(f"h{i}", tmp_path / "nodes", 2, i) for i in range(n)]
    for i, hospital in enumerate(hospitals):   # what clients.node.hospital_for returns for partition i
        node_module._HOSPITALS[("sim", world, i)] = hospital
    base = {"preset": "tiny", "seed": 0, "world": world, "ledger_dir": str(tmp_path / "flower-ledgers"),
            "lifetime_epsilon": 8.0, "delta": DELTA, "secure_policy": (policy or SecurePolicy()).to_dict(),
            "secure_noise_seed": 7}
    transport = FlowerTransport(grid, TransportSettings(n, wait_seconds=1, reply_timeout=5, poll_seconds=0.01,
                                                        base_config=base))
    assert transport.connect() == [h.hospital_id for h in hospitals]
    return grid, transport, hospitals, base


def _request(hospitals, scans_count, policy=None):
    codec, scans = _codec(), np.zeros((scans_count, 4, *GRID), np.float32)
    shares = (policy or SecurePolicy()).counted_shares(len(hospitals))
    grid, noise = _declaration(codec, scans_count, shares, len(hospitals), policy=policy or SecurePolicy())
    inputs = {h.hospital_id: {"scans": scans, "codec": codec} for h in hospitals}
    return grid, noise, inputs, scans_count * grid.dimension


def _record_contributions(monkeypatch):
    """Every contribution a hospital computes (before masking), by hospital."""
    seen: dict[str, list[np.ndarray]] = {}
    original = SecureHospital.pate_contribution

    def recording(self, session, message, config):
        vector = original(self, session, message, config)
        seen.setdefault(self.hospital.hospital_id, []).append(np.asarray(vector, np.int64).copy())
        return vector

    monkeypatch.setattr(SecureHospital, "pate_contribution", recording)
    return seen


def test_the_sum_over_flower_messages_is_the_in_process_sum(tmp_path):
    """Same hospitals, same seeded noise: the Flower path unmasks exactly the in-process engine's total, and
    every hospital charges its own ledger the same releases on both."""
    grid, transport, hospitals, base = _fixed_federation(tmp_path)
    _, noise, inputs, length = _request(hospitals, 2)
    names = [h.hospital_id for h in hospitals]
    flower = secure_sum(lambda stage, messages: transport.secure_stage(stage, messages, {}), names, 2, BITS,
                        length, noise, inputs)

    local = [FixedTeachers(f"h{i}", tmp_path / "local-nodes", 2, i) for i in range(3)]
    parties = {h.hospital_id: SecureHospital(h) for h in local}
    stores: dict[str, dict] = {h: {} for h in names}
    config = {**base, "ledger_dir": str(tmp_path / "local-ledgers")}
    inprocess = secure_sum(lambda stage, messages: {h: run_stage(parties[h], stage, m, config, stores[h])
                                                    for h, m in messages.items()},
                           names, 2, BITS, length, noise, inputs)
    np.testing.assert_array_equal(centered(flower.total, BITS), centered(inprocess.total, BITS))
    assert flower.survivors == names and not flower.dropped and not transport.dropped
    assert flower.bytes_up == inprocess.bytes_up and flower.bytes_down == inprocess.bytes_down
    for name in names:
        ours = Ledger(tmp_path / "flower-ledgers" / f"{name}.jsonl").events(name)
        assert len(ours) == 2 and ours == Ledger(tmp_path / "local-ledgers" / f"{name}.jsonl").events(name)
    # the rebuilt ClientApp found each stage's secrets in context.state; after unmask only the id is left
    session = grid.outgoing[0][1]["message"]["session"]
    for context in grid.contexts.values():
        assert not any(name.startswith(NodeSecureSessions.PREFIX) for name in context.state)
        assert NodeSecureSessions(context.state)[session] is FINISHED
    assert all(store[next(iter(store))] is FINISHED for store in stores.values())


def test_the_server_side_never_receives_a_contribution_or_a_secret(tmp_path, monkeypatch):
    """Instrumented: every reply the server's Grid receives in a secure sum. The masked vectors are uniform
    modulo 2^bits (the contributions, small centred integers, are not), none of them is a contribution, and
    no key, self-mask seed or share a hospital keeps in its context.state ever travels in either direction."""
    contributions = _record_contributions(monkeypatch)
    grid, transport, hospitals, _ = _fixed_federation(tmp_path)
    _, noise, inputs, length = _request(hospitals, 64)
    result = secure_sum(lambda stage, messages: transport.secure_stage(stage, messages, {}),
                        [h.hospital_id for h in hospitals], 2, BITS, length, noise, inputs)
    assert len(result.total) == length == 256
    assert sorted(contributions) == ["h0", "h1", "h2"]
    mine = {h: (v[0] & ((1 << BITS) - 1)) for h, v in contributions.items()}
    masked = [arrays["reply"] for _, stage, _, arrays in grid.incoming if stage == "collect-masked"]
    assert len(masked) == 3
    for record in masked:
        (vector,) = record.values()
        assert vector.dtype == np.int64 and len(vector) == length
        for contribution in mine.values():
            assert np.mean(vector == contribution) < 0.01
        # uniform modulo 2^40: half the residues lie within 2^38 of 0 (centred); a contribution: all of them
        near_zero = np.mean(np.abs(centered(vector, BITS)) < (1 << (BITS - 2)))
        assert 0.38 < near_zero < 0.62, near_zero
        counts = np.bincount(vector >> (BITS - 4), minlength=16)      # top 4 bits: 16 equally likely bins
        chi2 = float(((counts - 16.0) ** 2 / 16.0).sum())
        assert chi2 < 50, chi2                                         # 15 d.o.f.: beyond the 0.99999 quantile
    for contribution in mine.values():
        assert np.mean(np.abs(centered(contribution, BITS)) < (1 << (BITS - 2))) == 1.0
    # every array the server received outside collect-masked is a key, a ciphertext or a share (bytes)
    for _, stage, _, arrays in grid.incoming:
        for value in arrays.get("reply", {}).values():
            assert stage == "collect-masked" or value.dtype == np.uint8
    # the secrets each hospital kept between stages never left it: its private keys, its self-mask seed and
    # the shares of the others' masking keys (without a dropout, unmask reveals only self-mask seed shares)
    secrets = set()
    for state in grid.states:
        for name in state.config_records:
            if name.startswith(NodeSecureSessions.PREFIX) and name != NodeSecureSessions.FINISHED_RECORD:
                session, _ = restore_session(NodeSecureSessions(state)[name[len(NodeSecureSessions.PREFIX):]])
                secrets.update(s for s in (session.sk1, session.sk2, session.seed) if s)
                secrets.update(session.key_shares.values())
    assert len(secrets) >= 3 * (3 + 3)
    wire = [bytes(a.tobytes()) for _, _, arrays in grid.outgoing for r in arrays.values() for a in r.values()]
    wire += [bytes(a.tobytes()) for _, _, _, arrays in grid.incoming for r in arrays.values() for a in r.values()]
    wire += [json.dumps(c).encode() for _, c, _ in grid.outgoing] + [json.dumps(c).encode() for *_, c, _ in grid.incoming]
    for secret in secrets:
        assert not any(secret in blob for blob in wire)


def test_a_hospital_leaving_at_collect_masked_is_recovered_over_flower(tmp_path, monkeypatch):
    """Three hospitals that each count on at most one dropout: h2's node goes silent once it has shared its
    keys. The survivors unmask without it (its pairwise masks rebuilt from their shares of its key): the sum
    is h0's and h1's contributions, h2 is dropped from the run, and h2 was never charged."""
    contributions = _record_contributions(monkeypatch)
    policy = SecurePolicy(dropouts=1)
    grid, transport, hospitals, _ = _fixed_federation(tmp_path, policy=policy)

    def silence_h2(grid, message):
        if message.metadata.message_type == "query.secure" and \
                read_content(message.content)[0]["stage"] == "collect-masked":
            grid.dead.add(102)

    grid.on_send = silence_h2
    _, noise, inputs, length = _request(hospitals, 2, policy)
    result = secure_sum(lambda stage, messages: transport.secure_stage(stage, messages, {}),
                        [h.hospital_id for h in hospitals], 2, BITS, length, noise, inputs)
    assert result.survivors == ["h0", "h1"] and result.dropped == {"h2": "collect-masked"}
    assert sorted(contributions) == ["h0", "h1"]
    np.testing.assert_array_equal(centered(result.total, BITS), contributions["h0"][0] + contributions["h1"][0])
    assert transport.dropped["h2"].startswith("no reply") and transport.hospital_ids() == ["h0", "h1"]
    assert not (tmp_path / "flower-ledgers" / "h2.jsonl").exists()
    assert all(e.shares == 2 for h in ("h0", "h1")
               for e in Ledger(tmp_path / "flower-ledgers" / f"{h}.jsonl").events(h))


def test_a_refusal_leaves_the_hospital_out_of_that_sum_only(tmp_path):
    """A request below a hospital's policy is refused (a status reply, nothing charged): the hospital is
    absent from that sum but stays connected, as on the in-process engine."""
    grid, transport, hospitals, _ = _fixed_federation(tmp_path, n=2)
    _, noise, inputs, length = _request(hospitals, 1)
    replies = transport.secure_stage("setup", {"h0": {"session": "s1", "participants": ["h0", "h1"],
                                                     "threshold": 1, "bits": BITS, "length": length,
                                                     "noise": noise}}, {})
    assert replies == {} and transport.dropped == {} and transport.hospital_ids() == ["h0", "h1"]
    # a stage for a session the node never set up is refused too, and so is any stage of a finished one
    assert transport.secure_stage("unmask", {"h1": {"session": "nope", "survivors": [], "dropped": []}}, {}) == {}
    assert transport.dropped == {}


def test_secure_pate_over_the_flower_transport_with_a_dropout(tiny_prepared, tmp_path):
    """The whole protocol (server/pate_secure.py) over Flower messages with three simulated hospitals that
    each count on one dropout: hospital-02 goes silent in the first batch's collect-masked stage. That batch
    is released from the four teachers left; the next is not asked (its noise was planned for three
    participants); the results' epsilon is the run ledger's."""
    from server.pate import PateConfig, run_pate
    from task.data.partitions import split_for_preset
    from task.settings.presets import get_preset
    from task.world import load_world

    preset = PRESET.with_changes(hospitals=3, teachers_per_hospital=2)
    split = split_for_preset(tiny_prepared, get_preset("tiny", hospitals=3, teachers_per_hospital=2), seed=0)
    split.to_json(tmp_path / "split.json")
    (tmp_path / "world.json").write_text(json.dumps({"prepared": str(tiny_prepared.path), "preset": "tiny"}))
    grid = RecordingGrid(tmp_path, nodes=3)
    transport = FlowerTransport(grid, TransportSettings(3, wait_seconds=1, reply_timeout=30, poll_seconds=0.01,
                                base_config={"preset": "tiny", "seed": 0, "world": str(tmp_path),
                                             "preset_overrides": {"teacher": {"epochs": 1}, "hospitals": 3,
                                                                  "teachers_per_hospital": 2},
                                             "ledger_dir": str(tmp_path / "hospital-ledgers"),
                                             "lifetime_epsilon": 8.0, "delta": 1e-3,
                                             "secure_policy": {"dropouts": 1}}))
    transport.connect()

    def silence_the_third(grid, message):
        if message.metadata.message_type == "query.secure" and \
                read_content(message.content)[0]["stage"] == "collect-masked":
            grid.dead.add(102)

    grid.on_send = silence_the_third
    config = PateConfig("pate-anchored-secure", 8.0, 1e-3, seed=0, diagnostics=False,
                        query_batch=4, secure={"dropouts": 1}, compute=Compute(progress=False))
    out = tmp_path / "run"
    results = run_pate(transport, load_world(tiny_prepared, split), preset, config, out)
    assert results["aggregation"] == "secure" and results["secure_aggregation"]["counted_shares"] == 2
    assert results["queries"] == 4 and results["queries_planned"] == 8 and results["stopped_early"]
    assert results["teachers_per_query"] == {"min": 4, "max": 4}
    assert "hospital-02" in results["dropped_hospitals"]
    ledger = Ledger.load(out / "ledger.jsonl")
    worst = max(ledger.spent(o, 1e-3).epsilon for o in ledger.owners())
    assert results["epsilon"] == pytest.approx(worst) and 0 < results["epsilon"] <= 8.0
    for hospital in ("hospital-00", "hospital-01"):
        own = Ledger(tmp_path / "hospital-ledgers" / f"{hospital}.jsonl").events(hospital)
        assert len(own) == 4 and all(e.shares == 2 for e in own)
    # no teacher encoding travelled: the only query messages were the secure stages
    assert {kind for _, kind, _ in grid.sent} <= {"query.identify", "train", "evaluate", "query.secure"}


def test_node_sessions_round_trip_and_forget_their_secrets(tmp_path):
    """What run_stage stores survives the trip into a RecordDict and back (bytes as uint8 arrays, no
    pickle); FINISHED drops it and keeps only the id."""
    hospital = FixedTeachers("h0", tmp_path, 2, 0)
    secure = SecureHospital(hospital)
    _, noise, _, length = _request([hospital, FixedTeachers("h1", tmp_path, 2, 1)], 1)
    store = NodeSecureSessions(RecordDict())
    config = {"ledger_dir": str(tmp_path / "l"), "lifetime_epsilon": 8.0, "delta": DELTA,
              "secure_policy": {"colluders": 0, "dropouts": 0}}
    reply = run_stage(secure, "setup", {"session": "s", "participants": ["h0", "h1"], "threshold": 2,
                                        "bits": BITS, "length": length, "noise": noise}, config, store)
    assert set(reply) == {"pk1", "pk2"} and "s" in store and not secure.party.sessions
    session, policy = restore_session(store["s"])
    assert (session.pk1, session.stage, session.participants) == (reply["pk1"], "setup", ["h0", "h1"])
    assert session_state(session, policy) == session_state(*restore_session(store["s"]))
    with pytest.raises(UserError, match="already set up"):     # a setup replayed for the same id
        run_stage(SecureHospital(hospital), "setup", {"session": "s", "participants": ["h0", "h1"],
                                                      "threshold": 2, "bits": BITS, "length": length,
                                                      "noise": noise}, config, store)
    # an unmask message ends the session even when it is refused (here: out of order, right after setup)
    with pytest.raises(UserError, match="out of order"):
        run_stage(SecureHospital(hospital), "unmask", {"session": "s", "survivors": ["h0", "h1"], "dropped": []},
                  config, store)
    assert store["s"] is FINISHED and list(store.state) == [NodeSecureSessions.FINISHED_RECORD]
    with pytest.raises(UserError, match="finished"):
        run_stage(SecureHospital(hospital), "share-keys", {"session": "s", "public_keys": {}}, config, store)


@pytest.mark.parametrize("node_store", [True, False], ids=["node-state", "in-process-dict"])
def test_a_new_sum_drops_the_secrets_of_one_left_unfinished(tmp_path, node_store):
    """A sum the server gave up on (or that this hospital dropped out of) never reaches unmask: the next
    setup drops its key pairs and shares, marks it finished, and a late message for it is refused."""
    hospital = FixedTeachers("h0", tmp_path, 2, 0)
    _, noise, _, length = _request([hospital, FixedTeachers("h1", tmp_path, 2, 1)], 1)
    store = NodeSecureSessions(RecordDict()) if node_store else {}
    config = {"ledger_dir": str(tmp_path / "l"), "lifetime_epsilon": 8.0, "delta": DELTA,
              "secure_policy": {"colluders": 0, "dropouts": 0}}

    def setup(session):
        return run_stage(SecureHospital(hospital), "setup", {"session": session, "participants": ["h0", "h1"],
                                                             "threshold": 2, "bits": BITS, "length": length,
                                                             "noise": noise}, config, store)

    setup("abandoned")
    assert store["abandoned"] is not FINISHED
    setup("next")
    assert store["abandoned"] is FINISHED and store["next"] is not FINISHED
    if node_store:   # nothing of the abandoned session's secrets is left in the node's state
        assert not [name for name in store.state if "abandoned" in name]
    with pytest.raises(UserError, match="finished"):
        run_stage(SecureHospital(hospital), "share-keys", {"session": "abandoned", "public_keys": {}}, config, store)


def test_a_deployed_hospital_takes_its_secure_policy_from_its_node_config_only(tmp_path):
    from clients.node import secure_policy_for

    assert secure_policy_for({"partition-id": 0}) is None
    assert secure_policy_for({"data-dir": "/d"}) == SecurePolicy()
    assert secure_policy_for({"data-dir": "/d", "secure-colluders": 1, "secure-dropouts": "1"}) == \
        SecurePolicy(colluders=1, dropouts=1)
    with pytest.raises(UserError, match="secure-dropouts"):
        secure_policy_for({"data-dir": "/d", "secure-dropouts": 0.5})
    # the server's secure_policy (simulations) is ignored by a deployed hospital, even one given no policy
    from tests.test_secure_sum import _identities

    hospital = FixedTeachers("h0", tmp_path, 2, 0)
    hospital.deployed = True
    secure = SecureHospital(hospital, None, _identities(["h0", "h1"])["h0"])
    _, noise, _, length = _request([hospital, FixedTeachers("h1", tmp_path, 2, 1)], 1,
                                   SecurePolicy(colluders=1))
    setup = {"session": "s", "participants": ["h0", "h1"], "threshold": 2, "bits": BITS, "length": length,
             "noise": {**noise, "shares": 2, "total_variance": 2 * noise["local_variance"], "colluders": 0}}
    secure.handle("setup", setup, {"secure_policy": {"colluders": 1}})
    assert secure.party.policy == SecurePolicy()


def test_a_deployed_hospital_answers_a_key_stage_without_its_data_or_torch(tmp_path):
    """A SuperNode starts a ClientApp process for every message. For a secure sum's key stages (setup,
    share-keys, unmask) a deployed hospital answers as its card: its data folder is not opened and torch is not
    imported -- and it still refuses a sum without the consortium's roster, as the full hospital does."""
    script = textwrap.dedent(f"""
        import sys, time, uuid
        from flwr.app import Context, Message, Metadata, RecordDict
        from clients.client_app import app
        from task.wire.flower_wire import make_content, pack_nested, read_content
        node_config = {{"hospital-id": "h0", "data-dir": {str(tmp_path / "absent")!r}, "epsilon-budget": 8.0,
                       "max-teachers": 4, "workdir": {str(tmp_path / "work")!r}}}
        skeleton, payload = pack_nested({{"session": "s1", "participants": ["h0", "h1"], "threshold": 2}})
        content = make_content({{"preset": "tiny", "seed": 0, "stage": "setup", "message": skeleton}},
                               message=payload)
        metadata = Metadata(run_id=1, message_id=uuid.uuid4().hex, src_node_id=0, dst_node_id=1,
                            reply_to_message_id="", group_id="", created_at=time.time(), ttl=60.0,
                            message_type="query.secure")
        context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={{}})
        reply = app(Message(metadata=metadata, content=content), context)
        print(read_content(reply.content)[0]["status"])
        print("torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    status, torch_imported = result.stdout.strip().splitlines()[-2:]
    assert status.startswith("refused: hospital h0: takes part in secure sums only with the consortium's roster")
    assert torch_imported == "False"
    assert not (tmp_path / "absent").exists() and not (tmp_path / "work").exists()
