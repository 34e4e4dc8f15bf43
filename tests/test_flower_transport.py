"""The server's FlowerTransport against the real ClientApp over an in-memory Grid: identification,
codec shipping, error replies, and a hospital dying mid query phase -- with the whole PATE protocol."""

import json
import time
import uuid

import numpy as np
import pytest
from flwr.app import Context, Message, Metadata, RecordDict

from privacy.ledger import Ledger
from task.learning.compute import Compute
from task.settings.presets import get_preset
from task.wire.flower_wire import read_content
from server.flower_transport import FlowerTransport, HospitalsUnavailable, TransportSettings
from task.wire.requests import QueryRequest

PRESET = get_preset("tiny").with_changes(teacher=dict(epochs=1), pretrain_epochs=1, student=dict(epochs=1))


class MemoryGrid:
    """Delivers each message to the real ClientApp of its node; ``dead`` nodes never reply."""

    def __init__(self, world_dir, nodes=2):
        from flwr.supercore.task_identity import TaskIdentity

        from clients import node as node_module

        # Messages built by a ServerApp take the run id from the runtime; play the runtime here.
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0

        node_module._HOSPITALS.clear()
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i,
                                          node_config={"partition-id": i, "num-partitions": nodes},
                                          state=RecordDict(), run_config={}) for i in range(nodes)}
        self.dead: set[int] = set()
        self.broken: set[int] = set()
        self.sent: list[tuple[int, str, int]] = []   # (node, message type, content bytes)
        self.on_send = None

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from clients.client_app import app

        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            size = sum(a.data.__len__() for r in message.content.array_records.values() for a in r.values())
            self.sent.append((node, message.metadata.message_type, size))
            if self.on_send:
                self.on_send(self, message)
            if node in self.dead:
                continue
            metadata = Metadata(run_id=1, message_id=uuid.uuid4().hex, src_node_id=0, dst_node_id=node,
                                reply_to_message_id="", group_id=message.metadata.group_id,
                                created_at=time.time(), ttl=3600.0, message_type=message.metadata.message_type)
            delivered = Message(metadata=metadata, content=message.content)
            if node in self.broken:
                from flwr.app import Error

                replies.append(Message(Error(code=0, reason="ClientApp raised"), reply_to=delivered))
                continue
            replies.append(app(delivered, self.contexts[node]))
        return replies


@pytest.fixture()
def world_dir(tiny_prepared, tiny_split, tmp_path):
    tiny_split.to_json(tmp_path / "split.json")
    (tmp_path / "world.json").write_text(json.dumps({"prepared": str(tiny_prepared.path), "preset": "tiny"}))
    return tmp_path


def _transport(grid, world_dir, **kw):
    return FlowerTransport(grid, TransportSettings(
        2, wait_seconds=1, reply_timeout=5, poll_seconds=0.01,
        base_config={"preset": "tiny", "seed": 0, "world": str(world_dir),
                     "preset_overrides": {"teacher": {"epochs": 1}},
                     # the simulated hospitals' own ledgers and lifetime budget
                     "ledger_dir": str(world_dir / "hospital-ledgers"),
                     "lifetime_epsilon": 8.0, "delta": 1e-3}, **kw))


def test_connect_maps_nodes_to_hospitals(world_dir, tiny_split):
    grid = MemoryGrid(world_dir)
    transport = _transport(grid, world_dir)
    assert transport.connect() == sorted(tiny_split.hospitals)
    assert set(transport.teachers_of.values()) == {4}


def test_too_few_hospitals_is_a_clear_error(world_dir):
    grid = MemoryGrid(world_dir)
    grid.contexts.clear()
    with pytest.raises(HospitalsUnavailable, match="only 0 of 2 hospitals"):
        _transport(grid, world_dir).connect()


def test_error_reply_drops_that_hospital_only(world_dir):
    grid = MemoryGrid(world_dir)
    transport = _transport(grid, world_dir)
    transport.connect()
    grid.broken.add(101)
    replies = transport.evaluate({})
    assert len(replies) == 1 and len(transport.dropped) == 1
    assert "error reply" in next(iter(transport.dropped.values()))


def test_pate_over_flower_transport_with_a_dropout_mid_query_phase(world_dir, tiny_prepared, tiny_split, tmp_path):
    """Hospital 1 dies after the first query message: the batch it missed is not released (its partner was
    charged for K = 8), and later queries are accounted with K = 4, not 8 -- on the server and in the
    surviving hospital's own ledger."""
    from server.pate import PateConfig, run_pate
    from task.world import load_world

    grid = MemoryGrid(world_dir)
    transport = _transport(grid, world_dir)
    transport.connect()
    queries_seen = []

    def kill_after_first_query(grid, message):
        if message.metadata.message_type == "query":
            queries_seen.append(message.metadata.dst_node_id)
            if len(queries_seen) > 2:  # both hospitals answered the first query message
                grid.dead.add(101)

    grid.on_send = kill_after_first_query
    world = load_world(tiny_prepared, tiny_split)
    out = tmp_path / "run"
    results = run_pate(transport, world, PRESET, PateConfig("pate-pca", 8.0, 1e-3, seed=0,
                                                            query_batch=2, pca_mode="clip",
                                                            compute=Compute(progress=False)), out)
    ledger = Ledger.load(out / "ledger.jsonl")
    queries = [r for r in ledger.records() if ":query-" in r["release_id"]]
    teachers = [r["note"]["teachers"] for r in queries]
    assert teachers[:2] == [8, 8] and set(teachers[2:]) <= {4} and teachers[2:]
    dead_hospital = sorted(tiny_split.hospitals)[1]
    assert all(r["owners"] == [sorted(tiny_split.hospitals)[0]] for r in queries[2:])
    assert dead_hospital in transport.dropped
    # a dropout doubles the replace-one sensitivity of the remaining queries, and the ledger says so
    s_full, s_reduced = queries[0]["event"]["sensitivity"], queries[2]["event"]["sensitivity"]
    assert s_reduced == pytest.approx(2 * s_full)
    # ...and the results' epsilon is the ledger's, within the budget
    worst = max(ledger.spent(o, 1e-3).epsilon for o in ledger.owners())
    assert results["epsilon"] == pytest.approx(worst) and results["epsilon"] <= 8.0
    # the surviving hospital charged its own ledger for every batch it answered, including the unreleased
    # one (K = 8 declared, only 4 answered): its own epsilon is never below the server's
    alive = sorted(tiny_split.hospitals)[0]
    own = Ledger.load(world_dir / "hospital-ledgers" / f"{alive}.jsonl")
    released = {r["release_id"] for r in queries}
    # the hospital's ids are the server's with the hospital's own nonce (a replayed id is a new release)
    assert released < {r["release_id"].split("@")[0] for r in own.records()}
    assert results["unreleased_queries"] == len(own.records()) - len(released) > 0
    assert own.spent(alive, 1e-3).epsilon >= ledger.spent(alive, 1e-3).epsilon
    # the compressor state travelled once per hospital, not with every query
    codec_sizes = [size for node, kind, size in grid.sent if kind == "query" and node == 100]
    assert codec_sizes[0] > codec_sizes[1]


def test_a_query_round_waits_for_the_query_deadline_and_training_for_the_reply_deadline(world_dir):
    """A hospital that dies mid-query holds the run up for the (short) query deadline, not the training one."""
    grid = MemoryGrid(world_dir)
    waited = []
    original = grid.send_and_receive

    def recording(messages, *, timeout=None):
        waited.append((messages[0].metadata.message_type, timeout))
        return original(messages, timeout=timeout)

    grid.send_and_receive = recording
    transport = _transport(grid, world_dir, query_timeout=2)
    transport.connect()
    grid.dead.add(101)
    transport.evaluate({})
    scans = np.zeros((1, 4, *PRESET.grid), np.float32)
    transport.query(scans, {"kind": np.array([0])},   # (a bogus codec: refused)
                    QueryRequest(release_ids=["q0"], sigma=1.0, teachers=8).to_config())
    assert waited[1] == ("evaluate", 5.0) and ("query", 2.0) in waited
    assert transport.dropped["hospital-01"] == "no reply within 5 s"
    assert _transport(MemoryGrid(world_dir), world_dir).query_timeout == 5.0   # none given: the reply deadline
