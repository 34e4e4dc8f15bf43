"""The PATE / DP-FedAvg protocols' view of the hospitals, over a Flower ``Grid``.

Implements ``server.transport.HospitalTransport``. Faults never stop a run: a hospital that times out or
replies with an error is reported and left out of that round (and, for the query phase, of later
rounds: a dropped hospital does not come back mid-phase, so every later query is accounted with the
reduced number of teachers rather than waiting for it again). The protocol decides what that means
for sensitivity and the ledger; this class only says who answered what.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
from flwr.app import Message

from task.errors import UserError
from task.wire.flower_wire import CODEC_DIGEST, arrays_digest, make_content, pack_nested, read_content, unpack_nested
from task.wire.requests import QueryRequest

log = logging.getLogger("fedpate.flower")


class HospitalsUnavailable(RuntimeError):
    """Fewer hospitals connected than the run needs (named in the message)."""


@dataclass(frozen=True)
class TransportSettings:
    """How a :class:`FlowerTransport` reaches the hospitals, validated when built.

    Args:
        expected_hospitals: the nodes to wait for before the run starts.
        wait_seconds: how long to wait for them (the run goes on with at least ``min_hospitals``).
        reply_timeout: the deadline of a reply (training rounds).
        query_timeout: the deadline of a query round (None or 0: ``reply_timeout``) -- a query is inference on
            teachers already trained, so a hospital that dies mid-query holds the run up for seconds, not for a
            training round's deadline.
        base_config: what every message carries beside its request (``task.wire.requests.RunContext`` and the
            simulated hospitals' privacy settings, ``task.settings.runconfig.RunSettings.hospital_privacy_config``).
        min_hospitals: the fewest hospitals a run starts with.
        poll_seconds: how often to look for connected nodes while waiting.
        clock: the clock the waiting is measured on (tests pass a fake one).
    """

    expected_hospitals: int
    wait_seconds: float = 120.0
    reply_timeout: float = 600.0
    query_timeout: float | None = None
    base_config: Mapping[str, Any] | None = None
    min_hospitals: int = 1
    poll_seconds: float = 0.5
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        for name in ("expected_hospitals", "min_hospitals"):
            if int(getattr(self, name)) < 0:
                raise UserError(f"{name.replace('_', '-')}: expected a non-negative integer, got {getattr(self, name)!r}")
        for name in ("wait_seconds", "reply_timeout", "poll_seconds"):
            if not float(getattr(self, name)) >= 0:
                raise UserError(f"{name.replace('_', '-')}: expected a non-negative number, got {getattr(self, name)!r}")
        object.__setattr__(self, "base_config", dict(self.base_config or {}))


class FlowerTransport:
    def __init__(self, grid, settings: TransportSettings):
        self.grid = grid
        self.settings = settings
        self.expected = int(settings.expected_hospitals)
        self.wait_seconds = float(settings.wait_seconds)
        self.reply_timeout = float(settings.reply_timeout)
        self.query_timeout = float(settings.query_timeout) if settings.query_timeout else self.reply_timeout
        self.base_config = dict(settings.base_config)
        self.min_hospitals = int(settings.min_hospitals)
        self.poll_seconds = settings.poll_seconds
        self.clock = settings.clock
        self.node_of: dict[str, int] = {}       # hospital id -> node id
        self.teachers_of: dict[str, int] = {}
        self.deployed: dict[str, bool] = {}     # hospital id -> runs on its own data (not a simulated node)
        self.dropped: dict[str, str] = {}       # hospital id -> why
        self.codec_sent: dict[str, str] = {}    # hospital id -> digest of the compressor state it holds
        self.bytes_up: list[dict[str, float]] = []  # per query round: hospital -> bytes per teacher per scan
        self.notes: list[dict[str, dict]] = []       # per query round: hospital -> what it said (counts only)
        self._round = 0

    # ----------------------------------------------------------------------------------------------
    def connect(self) -> list[str]:
        """Wait (with a deadline) for the expected nodes, then learn which hospital each node plays."""
        deadline = self.clock() + self.wait_seconds
        node_ids: list[int] = []
        while self.clock() < deadline:
            node_ids = sorted(self.grid.get_node_ids())
            if len(node_ids) >= self.expected:
                break
            time.sleep(self.poll_seconds)
        if len(node_ids) < self.min_hospitals:
            raise HospitalsUnavailable(
                f"only {len(node_ids)} of {self.expected} hospitals connected within {self.wait_seconds:.0f} s"
            )
        if len(node_ids) < self.expected:
            log.warning("only %d of %d hospitals connected within %.0f s; continuing with them",
                        len(node_ids), self.expected, self.wait_seconds)
        replies = self._send({node: (make_content(self.base_config), "query.identify") for node in node_ids})
        for node, (config, _) in replies.items():
            hospital = str(config["hospital_id"])
            self.node_of[hospital] = node
            self.teachers_of[hospital] = int(config["teachers"])
            self.deployed[hospital] = bool(config.get("deployed", False))
        if len(self.node_of) < self.min_hospitals:
            raise HospitalsUnavailable(f"only {len(self.node_of)} hospitals answered the identify round")
        return self.hospital_ids()

    def hospital_ids(self) -> list[str]:
        return sorted(h for h in self.node_of if h not in self.dropped)

    # ----------------------------------------------------------------------------------------------
    def train(self, config: Mapping[str, Any], init_weights: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        arrays = {"init_weights": dict(init_weights)} if init_weights else {}
        replies = self._send_to_all(lambda h: (make_content({**self.base_config, **config}, **arrays), "train"))
        return {h: config for h, (config, _) in replies.items()}

    def query(self, scans: np.ndarray, codec: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> dict[str, np.ndarray]:
        digest = arrays_digest(codec)
        request = QueryRequest.from_config(config)
        # the codec travels once per hospital; the message names the one meant, so a node that lost it asks again
        message_config = {**self.base_config, **request.to_config(), CODEC_DIGEST: digest}
        scans = np.ascontiguousarray(scans, np.float32)  # once, not per hospital

        def build(hospital: str, resend: bool = False):
            payload: dict[str, dict[str, np.ndarray]] = {"scans": {"scans": scans}}
            if resend or self.codec_sent.get(hospital) != digest:
                payload["codec"] = dict(codec)
            return make_content(message_config, **payload), "query"

        replies = self._send_to_all(build, retry_on="codec-missing", timeout=self.query_timeout)
        for hospital in replies:
            self.codec_sent[hospital] = digest
        # Payload bytes per (teacher, scan): what one teacher uploads for one query.
        if not request.diagnostic:
            self.bytes_up.append({h: arrays["encodings"]["z"].nbytes / max(1, arrays["encodings"]["z"].shape[0]
                                                                          * len(scans))
                                  for h, (_, arrays) in replies.items()})
            self.notes.append({h: {"fallback_teachers": int(reply.get("fallback_teachers", 0) or 0)}
                               for h, (reply, _) in replies.items()})
        return {h: arrays["encodings"]["z"] for h, (_, arrays) in replies.items()}

    def evaluate(self, config: Mapping[str, Any], test: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        arrays = {"test": dict(test)} if test else {}
        replies = self._send_to_all(lambda h: (make_content({**self.base_config, **config}, **arrays), "evaluate"))
        return {h: config for h, (config, _) in replies.items()}

    def secure_stage(self, stage: str, messages: Mapping[str, Mapping[str, Any]], config: Mapping[str, Any]
                     ) -> dict[str, dict]:
        """One stage of a secure sum (``server/secure.py``): one ``query.secure`` message per named hospital
        (the stage's message as ``task.wire.flower_wire.pack_nested`` packs it, beside the run's settings), under the
        query deadline; returns each hospital's unpacked reply. A hospital that refuses (its policy, its
        budget) is absent from this sum only, as on the in-process engine; one that does not reply in time,
        replies with an error or sends a malformed reply is absent and dropped from the run (it is not asked
        again: the secure sum recovers its masks from the others' shares, and the query phase stops before
        the next batch, whose noise was planned for every participant)."""
        content = {}
        for hospital, message in messages.items():
            if hospital in self.dropped or hospital not in self.node_of:
                continue
            skeleton, payload = pack_nested(dict(message))
            content[self.node_of[hospital]] = (
                make_content({**self.base_config, **config, "stage": stage, "message": skeleton}, message=payload),
                "query.secure")
        replies = self._send(content, by_hospital=True, timeout=self.query_timeout)
        unpacked: dict[str, dict] = {}
        for hospital, (reply, arrays) in replies.items():
            try:
                value = unpack_nested(reply["reply"], arrays.get("reply", {}))
                if not isinstance(value, dict):
                    raise ValueError("not a dict")
                unpacked[hospital] = value
            except (KeyError, TypeError, ValueError) as exc:
                self._last_errors[hospital] = f"malformed reply: {exc}"
        for hospital in messages:
            if hospital in unpacked:
                continue
            why = self._last_errors.get(hospital, f"no reply within {self.query_timeout:.0f} s")
            if why.startswith("refused"):
                log.warning("hospital %s refused the secure-sum stage %s: %s", hospital, stage, why)
            elif hospital not in self.dropped:
                self.dropped[hospital] = why
                log.warning("hospital %s dropped out at the secure-sum stage %s: %s", hospital, stage, why)
        return unpacked

    def fedavg_round(self, weights: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> dict[str, tuple[dict, dict]]:
        """One DP-FedAvg round: {hospital: (metrics, new local weights)}."""
        replies = self._send_to_all(
            lambda h: (make_content({**self.base_config, **config}, weights=dict(weights)), "train.fedavg"))
        return {h: (config, arrays["weights"]) for h, (config, arrays) in replies.items()}

    # ----------------------------------------------------------------------------------------------
    def _send_to_all(self, build, retry_on: str | None = None,
                     timeout: float | None = None) -> dict[str, tuple[dict, dict]]:
        hospitals = self.hospital_ids()
        timeout = self.reply_timeout if timeout is None else timeout
        replies = self._send({self.node_of[h]: build(h) for h in hospitals}, by_hospital=True, timeout=timeout)
        if retry_on:
            again = [h for h, why in self._last_errors.items() if retry_on in why and h in hospitals]
            if again:
                more = self._send({self.node_of[h]: build(h, True) for h in again}, by_hospital=True,
                                  timeout=timeout)
                replies.update(more)
        for hospital in hospitals:
            if hospital not in replies:
                why = self._last_errors.get(hospital, f"no reply within {timeout:.0f} s")
                self.dropped[hospital] = why
                log.warning("hospital %s dropped out: %s", hospital, why)
        return replies

    def _send(self, content_by_node: Mapping[int, tuple], by_hospital: bool = False,
              timeout: float | None = None) -> dict:
        self._round += 1
        messages = [Message(content, dst_node_id=node, message_type=message_type, group_id=str(self._round))
                    for node, (content, message_type) in content_by_node.items()]
        hospital_of = {node: h for h, node in self.node_of.items()}
        self._last_errors: dict[str, str] = {}
        replies: dict = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.reply_timeout if timeout is None else timeout):
            node = reply.metadata.src_node_id
            key = hospital_of.get(node, node) if by_hospital else node
            if reply.has_error():
                self._last_errors[str(key)] = f"error reply: {reply.error.reason}"
                continue
            try:
                config, arrays = read_content(reply.content)
            except (KeyError, ValueError) as exc:  # malformed reply: treat as that hospital's fault
                self._last_errors[str(key)] = f"malformed reply: {exc}"
                continue
            if config.get("status"):  # e.g. "codec-missing": the hospital asks for something first
                self._last_errors[str(key)] = str(config["status"])
                continue
            replies[key] = (config, arrays)
        return replies
