"""The hospital's Flower ClientApp: a thin adapter from messages to :class:`clients.hospital.Hospital`.

What leaves the hospital (checked by tests/test_flower_wire.py): metrics, its local epsilon, and per
query the clipped l-dimensional encodings of each teacher. Never scans, labels, teacher weights or
full-resolution outputs.

Message types (``message_type`` = ``<category>[.<action>]``):
- ``query.identify``  -> {"hospital_id", "teachers"}
- ``train``           -> trains the hospital's teachers; replies with metrics and local epsilon
- ``query``           -> encodings (T, n, l) of the public scans sent; the compressor state is sent once
                         and kept in the node's ``context.state``
- ``evaluate``        -> per-teacher Dice on the public test scans and labels sent
- ``train.fedavg``    -> one DP-FedAvg round of local DP-SGD from the global weights sent
- ``query.secure``    -> one stage of a secure sum (``config["stage"]``: setup, share-keys, collect-masked,
                         unmask; or dp-fedavg-secure's join before its sums; ``clients/secure.py``); the
                         message and the reply are nested values (``task.wire.flower_wire.pack_nested``). The
                         hospital's secrets of that sum (key pairs, self-mask seed, the shares it holds) stay
                         in the node's ``context.state`` between stages and are dropped after the unmask
                         stage; they are never sent

A request the hospital refuses (its budget would be exceeded, a codec it does not accept, a diagnostic
asked of a deployed hospital, a query that does not declare what it releases) is answered with
``{"status": "refused: <why>"}`` and nothing else; the server treats that hospital as not answering. A budget
refusal says only ``refused: privacy budget``: its full text (what the hospital spent in other runs) stays
in the hospital's own log.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.node import hospital_card_for, hospital_for, secure_identity_for, secure_policy_for
from clients.secure import FINISHED, KEY_STAGES, SecureHospital, run_stage
from privacy.errors import PrivacyError
from task.errors import UserError
from task.wire.flower_wire import (CODEC_DIGEST, arrays_digest, arrays_to_record, config_to_record, make_content,
                                   pack_nested, read_content, record_to_arrays, record_to_config, unpack_nested)
from task.wire.requests import EvaluationRequest, TeacherTrainingRequest

app = ClientApp()
log = logging.getLogger(__name__)


def refusals_as_replies(handler):
    """A refusal (UserError: bad request; PrivacyError: budget) becomes a one-line status reply."""
    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except PrivacyError as exc:
            # the full text states what this hospital spent in other runs: it stays in the hospital's log
            log.warning("refused %s: %s", msg.metadata.message_type, exc)
            return Message(make_content({"status": "refused: privacy budget"}), reply_to=msg)
        except UserError as exc:   # a request the hospital cannot or will not run: the reason is the request's
            return Message(make_content({"status": f"refused: {exc}"}), reply_to=msg)

    return wrapped

_CODEC_RECORD = "codec"


@app.query("identify")
def identify(msg: Message, context: Context) -> Message:
    config, _ = read_content(msg.content)
    hospital = hospital_for(context.node_config, config)
    return Message(make_content({"hospital_id": hospital.hospital_id, "teachers": hospital.num_teachers,
                                 "deployed": hospital.deployed}), reply_to=msg)


@app.train()
@refusals_as_replies
def train(msg: Message, context: Context) -> Message:
    config, arrays = read_content(msg.content)
    hospital = hospital_for(context.node_config, config)
    request = hospital.read_request(TeacherTrainingRequest, config)
    metrics = hospital.train_teachers(dataclasses.replace(request, init_weights=arrays.get("init_weights")))
    return Message(make_content({"hospital_id": hospital.hospital_id, **metrics}), reply_to=msg)


@app.query()
@refusals_as_replies
def query(msg: Message, context: Context) -> Message:
    config, arrays = read_content(msg.content)
    hospital = hospital_for(context.node_config, config)
    codec = arrays.get(_CODEC_RECORD)
    if codec is not None:  # first query of a run: keep the public compressor state for the next ones
        context.state[_CODEC_RECORD] = msg.content.array_records[_CODEC_RECORD]
    elif _CODEC_RECORD in context.state.array_records:
        codec = read_content(context.state)[1][_CODEC_RECORD]
    if codec is None or arrays_digest(codec) != config.get(CODEC_DIGEST):
        # The server re-sends the state when it sees this (e.g. after this node restarted).
        return Message(make_content({"hospital_id": hospital.hospital_id, "status": "codec-missing"}), reply_to=msg)
    encodings, notes = hospital.answer_query(arrays["scans"]["scans"], codec, config)   # the request read there
    return Message(make_content({"hospital_id": hospital.hospital_id, **notes}, encodings={"z": encodings}),
                   reply_to=msg)


@app.evaluate()
@refusals_as_replies
def evaluate(msg: Message, context: Context) -> Message:
    config, arrays = read_content(msg.content)
    hospital = hospital_for(context.node_config, config)
    test = arrays.get("test", {})
    request = hospital.read_request(EvaluationRequest, config)
    metrics = hospital.evaluate(dataclasses.replace(request, images=test.get("images"), labels=test.get("labels")))
    return Message(make_content({"hospital_id": hospital.hospital_id, **metrics}), reply_to=msg)


@app.train("fedavg")
@refusals_as_replies
def fedavg_round(msg: Message, context: Context) -> Message:
    from clients.fedavg import local_dpsgd_round   # the training stack: only the messages that train import it

    config, arrays = read_content(msg.content)
    hospital = hospital_for(context.node_config, config)
    weights, metrics = local_dpsgd_round(hospital, arrays["weights"], config)
    return Message(make_content({"hospital_id": hospital.hospital_id, **metrics}, weights=weights),
                   reply_to=msg)


class NodeSecureSessions:
    """``clients.secure.run_stage``'s store of one hospital's secure-sum secrets, in the node's
    ``context.state``: a RecordDict that the SuperNode keeps on the hospital's machine between messages (the
    ClientApp object may be rebuilt for every message). One ConfigRecord (JSON skeleton) and one ArrayRecord
    (bytes and arrays) per open session; the ids of finished sessions in one ConfigRecord."""

    PREFIX, FINISHED_RECORD = "secure-session:", "secure-sessions-finished"

    def __init__(self, state) -> None:
        self.state = state

    def _finished(self) -> list[str]:
        record = self.state.config_records.get(self.FINISHED_RECORD)
        return list(record_to_config(record)["ids"]) if record is not None else []

    def __iter__(self):
        """Every session id the node knows of: the open ones, then the finished ones."""
        opened = [name[len(self.PREFIX):] for name in self.state.config_records if name.startswith(self.PREFIX)]
        return iter(opened + self._finished())

    def __contains__(self, key: object) -> bool:
        return f"{self.PREFIX}{key}" in self.state.config_records or key in self._finished()

    def __getitem__(self, key: str):
        name = f"{self.PREFIX}{key}"
        if name in self.state.config_records:
            skeleton = record_to_config(self.state.config_records[name])["state"]
            return unpack_nested(skeleton, record_to_arrays(self.state.array_records[f"{name}:arrays"]))
        if key in self._finished():
            return FINISHED
        raise KeyError(key)

    def __setitem__(self, key: str, value) -> None:
        name = f"{self.PREFIX}{key}"
        if value is FINISHED:   # the secrets go; only the fact that the session finished stays
            for record in (name, f"{name}:arrays"):
                if record in self.state:
                    del self.state[record]
            self.state[self.FINISHED_RECORD] = config_to_record({"ids": [*self._finished(), str(key)]})
            return
        skeleton, arrays = pack_nested(value)
        self.state[name] = config_to_record({"state": skeleton})
        self.state[f"{name}:arrays"] = arrays_to_record(arrays)


_SECURE_KEYS = ("stage", "message")


@app.query("secure")
@refusals_as_replies
def secure_stage(msg: Message, context: Context) -> Message:
    config, arrays = read_content(msg.content)
    # a deployed hospital answers the key stages as its card (no data, no models, no torch in this process)
    card = hospital_card_for(context.node_config) if config.get("stage") in KEY_STAGES else None
    hospital = card or hospital_for(context.node_config, config)
    try:
        stage = str(config["stage"])
        message = unpack_nested(config["message"], arrays.get("message", {}))
        if not isinstance(message, dict):
            raise ValueError("the message is not a dict")
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"hospital {hospital.hospital_id}: malformed secure-sum message ({exc})") from None
    settings = {k: v for k, v in config.items() if k not in _SECURE_KEYS}
    node_config = context.node_config
    secure = SecureHospital(hospital, secure_policy_for(node_config), secure_identity_for(node_config))
    reply = run_stage(secure, stage, message, settings, NodeSecureSessions(context.state))
    skeleton, payload = pack_nested(reply)
    return Message(make_content({"hospital_id": hospital.hospital_id, "reply": skeleton}, reply=payload),
                   reply_to=msg)
