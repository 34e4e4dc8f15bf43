"""What leaves a hospital: the ClientApp is driven with real Flower Messages (no runtime needed) and
every reply is inspected. Scans, labels, teacher weights and full-resolution outputs never leave it."""

import json
import time
import uuid

import numpy as np
import pytest
from flwr.app import Context, Message, Metadata, RecordDict

from task.settings.presets import get_preset
from task.wire.flower_wire import arrays_digest, make_content, read_content

PRESET = get_preset("tiny").with_changes(teacher=dict(epochs=1))


@pytest.fixture(scope="module")
def world_dir(tiny_prepared, tiny_split, tmp_path_factory):
    folder = tmp_path_factory.mktemp("world")
    tiny_split.to_json(folder / "split.json")
    (folder / "world.json").write_text(json.dumps({"prepared": str(tiny_prepared.path), "preset": "tiny"}))
    return folder


def _message(content: RecordDict, message_type: str) -> Message:
    metadata = Metadata(run_id=1, message_id=uuid.uuid4().hex, src_node_id=1, dst_node_id=7,
                        reply_to_message_id="", group_id="1", created_at=time.time(), ttl=3600.0,
                        message_type=message_type)
    return Message(metadata=metadata, content=content)


@pytest.fixture(scope="module")
def node(world_dir):
    from clients import client_app, node as node_module

    node_module._HOSPITALS.clear()
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config={})
    base = {"preset": "tiny", "seed": 0, "world": str(world_dir),
            "preset_overrides": {"teacher": {"epochs": 1}}}

    def send(message_type, config=None, **arrays):
        reply = client_app.app(_message(make_content({**base, **(config or {})}, **arrays), message_type), context)
        return reply

    return send, context


def world_dir_ledgers(context):
    """A fresh folder for the simulated hospital's own ledgers (the server says where, in simulation)."""
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix="hospital-ledgers-"))


def _all_arrays(reply) -> dict:
    _, arrays = read_content(reply.content)
    return {f"{record}/{name}": value for record, values in arrays.items() for name, value in values.items()}


def test_hospital_uploads_only_l_numbers_per_teacher_and_query(node, tiny_prepared, tiny_split):
    send, context = node
    identity = read_content(send("query.identify").content)[0]
    assert identity["hospital_id"] == sorted(tiny_split.hospitals)[0]
    teachers = identity["teachers"]

    from task.learning.networks import build_unet

    init = {k: v.numpy() for k, v in build_unet(PRESET.unet).state_dict().items()}
    from server.pate import teacher_training

    trained = send("train", {**teacher_training(PRESET).to_config(), "teacher_epochs": 1}, init_weights=init)
    assert _all_arrays(trained) == {}, "train replies carry metrics only, never weights"
    metrics = read_content(trained.content)[0]
    assert metrics["teachers"] == teachers and "local_epsilon" in metrics

    scans = tiny_prepared.images(tiny_split.public_query[:3]).astype(np.float32)
    from task.codecs import PCACompressor
    from task.codecs import one_hot

    reference = one_hot(tiny_prepared.labels(tiny_split.public_reference), 4)
    codec = PCACompressor(n_components=3, sensitivity_mode="clip", clip=1.0).fit(reference).state()
    latent_dim = 3
    ledgers = world_dir_ledgers(context)
    declared = {"sigma": 0.5, "teachers": 2 * teachers, "ledger_dir": str(ledgers), "lifetime_epsilon": 50.0}
    reply = send("query", {"codec_digest": arrays_digest(codec), "release_ids": ["q-0", "q-1", "q-2"], **declared},
                 scans={"scans": scans}, codec=codec)
    assert not reply.has_error(), reply.error
    arrays = _all_arrays(reply)
    assert list(arrays) == ["encodings/z"]
    z = arrays["encodings/z"]
    assert z.shape == (teachers, len(scans), latent_dim)
    assert np.all(np.linalg.norm(z, axis=-1) <= 1.0 + 1e-5), "clipped before upload"
    voxels = scans[0, 0].size
    assert all(a.size < voxels for a in arrays.values()), "no full-resolution output leaves the hospital"
    assert z.nbytes == teachers * len(scans) * latent_dim * 4

    # The compressor state is kept in the node's context: the next query need not carry it.
    again = send("query", {"codec_digest": arrays_digest(codec), "release_ids": ["q-3"], **declared},
                 scans={"scans": scans[:1]})
    assert not again.has_error()
    assert _all_arrays(again)["encodings/z"].shape == (teachers, 1, latent_dim)

    # The hospital charged its own ledger for every scan, with the sensitivity it computed from the codec
    from privacy.ledger import Ledger

    ledger = Ledger.load(ledgers / f"{identity['hospital_id']}.jsonl")
    assert [r["release_id"].split("@")[0] for r in ledger.records()] == ["q-0", "q-1", "q-2", "q-3"]
    assert [r["event"]["sensitivity"] for r in ledger.records()] == [pytest.approx(2 * 1.0 / (2 * teachers))] * 4
    assert ledger.owners() == [identity["hospital_id"]]

    # A query that does not declare what it releases is refused, and nothing is charged
    undeclared = send("query", {"codec_digest": arrays_digest(codec)}, scans={"scans": scans[:1]})
    status = read_content(undeclared.content)[0]["status"]
    assert status.startswith("refused:") and "release_ids" in status and _all_arrays(undeclared) == {}
    assert len(Ledger.load(ledgers / f"{identity['hospital_id']}.jsonl")) == 4

    # A stale or unknown compressor state is refused (the server then re-sends it).
    stale = send("query", {"codec_digest": "0" * 16}, scans={"scans": scans[:1]})
    assert read_content(stale.content)[0]["status"] == "codec-missing" and _all_arrays(stale) == {}


def test_evaluate_replies_scalars_only(node, tiny_prepared, tiny_split):
    send, _ = node
    test_ids = tiny_split.test[:2]
    reply = send("evaluate", test={"images": tiny_prepared.images(test_ids).astype(np.float32),
                                   "labels": tiny_prepared.labels(test_ids)})
    assert _all_arrays(reply) == {}
    metrics = read_content(reply.content)[0]
    assert metrics["on"] == "public-test"
    assert len(metrics["teacher_dice"]) == read_content(send("query.identify").content)[0]["teachers"]


def test_nested_messages_travel_as_json_and_arrays_without_pickle():
    """The secure sum's messages: bytes become uint8 arrays, arrays stay arrays (dtype and shape), tuples
    become lists; what cannot travel, or a reference to a missing array, is an error."""
    from task.wire.flower_wire import pack_nested, unpack_nested

    message = {"public_keys": {"h0": (b"\x00pk1", b""), "h1": (b"pk1", b"pk2")}, "masked": np.arange(5, dtype=np.int64),
               "codec": {"kind": np.array("pca"), "latent_dim": np.array(4)}, "ids": ["q-0", "q-1"],
               "noise": {"local_variance": 1e6 / 3, "shares": 2, "flag": True, "none": None}}
    skeleton, arrays = pack_nested(message)
    config, records = read_content(make_content({"message": skeleton}, message=arrays))
    assert json.dumps(config)   # the skeleton is plain JSON
    back = unpack_nested(config["message"], records["message"])
    assert back["public_keys"] == {"h0": [b"\x00pk1", b""], "h1": [b"pk1", b"pk2"]}
    assert back["masked"].dtype == np.int64 and back["masked"].tolist() == [0, 1, 2, 3, 4]
    assert back["codec"]["kind"].item() == "pca" and back["codec"]["latent_dim"].shape == ()
    assert back["noise"] == message["noise"] and back["ids"] == message["ids"]
    for bad in ({"$bytes": 1}, {1: "int key"}, {"x": object()}):
        with pytest.raises((TypeError, ValueError)):
            pack_nested(bad)
    with pytest.raises(KeyError):
        unpack_nested({"k": {"$bytes": "b9"}}, {})
    with pytest.raises(ValueError, match="uint8"):
        unpack_nested({"k": {"$bytes": "a0"}}, {"a0": np.zeros(3, np.int64)})
