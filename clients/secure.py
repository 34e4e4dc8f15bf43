"""A hospital in the secure sum: the SecAgg+ client stages, and the threat model it enforces itself.

Protocol: Bell, Bonawitz, Gascón, Lepoint & Raykova, "Secure single-server aggregation with (poly)logarithmic
overhead" (CCS 2020, SecAgg+), on the complete graph (every hospital is every other's neighbour, which is
Bonawitz et al.'s SecAgg, CCS 2017; consortia have tens of hospitals, not millions of phones). The stages
are Flower's (``secaggplus_mod``): **setup** (two key pairs), **share-keys** (Shamir shares of the self-mask
seed and of the masking key, encrypted to each neighbour), **collect-masked** (the contribution plus the
self mask plus one pairwise mask per neighbour, modulo 2^bits) and **unmask** (shares of the survivors'
self-mask seeds and of the dropped hospitals' masking keys). Every primitive is a library's
(``task.wire.secagg``). The server sees masked vectors that are uniform modulo 2^bits, and the sum.

Threat model (the hospital's :class:`SecurePolicy`, from its own node config, never from the server): up to
``colluders`` hospitals that share everything with the aggregator, up to ``dropouts`` hospitals that leave
mid-protocol, and an aggregator that adds no noise and may deviate from the protocol. The hospital counts only
the noise it can rely on -- its own share and the honest survivors', ``participants - colluders - dropouts``
shares -- and before anything is charged refuses a request that

* declares another threat model than its own (``check_request`` says why mixed policies are refused);
* has fewer participants than its policy's minimum, or (a deployed hospital, with the consortium's roster,
  :class:`task.wire.secagg.SigningIdentity`) a participant who is not on the roster;
* sets the Shamir threshold at or below the colluders (``threshold <= colluders`` would let the colluders
  alone rebuild its self-mask seed and masking key), below its policy's minimum, above the hospitals left
  after the dropouts, or -- with dropouts allowed -- at or below half of ``participants + colluders``
  (``task.wire.secagg.threat_problem``: a server lying about who dropped could otherwise collect both secrets of
  one hospital);
* declares noise that does not add up, or counts other than exactly the shares it can count on;
* (a deployed hospital) forwards keys that their owner did not sign, over the setup this hospital was told,
  with its roster key -- checked at share-keys, before any share is encrypted: no substituted key, no
  hospital told another setup;
* leaves fewer than ``participants - dropouts`` hospitals that shared their keys (at collect-masked, before
  the charge: the unmask would be refused);

and refuses to unmask when fewer hospitals than ``participants - dropouts`` sent masked inputs (their noise,
which it counted, would be missing), when a name is repeated, or when asked for both shares of one hospital.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from clients.secure_checks import SecureRequestRefused, declared_grid
from clients.secure_gradients import contributor_for
from privacy.distributed import share_count
from task.wire import secagg
from task.wire.secagg import SigningIdentity, SumSetup, setup_statement, threat_problem
from task.errors import UserError
from task.wire.requests import HospitalRequest, SecureStageRequest

STAGES = ("setup", "share-keys", "collect-masked", "unmask")
#: the stages that exchange only keys, shares and masks: the hospital's data and teachers are not touched
KEY_STAGES = ("setup", "share-keys", "unmask")


@dataclass(frozen=True)
class SecurePolicy:
    """What a hospital assumes about everybody else, and the least it accepts (its own configuration)."""

    colluders: int = 0               # t: hospitals that may share everything with the aggregator
    dropouts: int = 0                # d: hospitals that may leave mid-protocol
    min_participants: int = 2
    min_threshold: int = 2           # the Shamir threshold it accepts at least (and always > colluders)

    def __post_init__(self) -> None:
        for name in ("colluders", "dropouts", "min_participants", "min_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"secure policy: {name} must be a non-negative integer, got {value!r}")

    def counted_shares(self, participants: int) -> int:
        """Noise shares this hospital can rely on in a sum over ``participants`` hospitals."""
        return share_count(participants, self.colluders, self.dropouts)

    def to_dict(self) -> dict:
        return {"colluders": self.colluders, "dropouts": self.dropouts, "min_participants": self.min_participants,
                "min_threshold": self.min_threshold}


def declared_threat(who: str, noise: Mapping[str, Any]) -> tuple[int, int]:
    """The (colluders, dropouts) a request's noise declaration states (its threat model), checked."""
    values = []
    for name in ("colluders", "dropouts"):
        value = noise.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise SecureRequestRefused(f"hospital {who}: a secure sum must declare its {name} (a non-negative "
                                       f"integer), got {value!r}")
        values.append(int(value))
    return values[0], values[1]


def check_request(policy: SecurePolicy, who: str, participants: list, threshold: int, noise: Mapping[str, Any]
                  ) -> int:
    """Refuse (:class:`SecureRequestRefused`) a setup request below ``policy``; returns the shares it counts.

    The request's declared threat model (``noise["colluders"]``, ``noise["dropouts"]``) must be the hospital's
    own. A hospital that assumed fewer dropouts than the others would count more noise shares than the sum
    may hold -- the others, assuming more, still unmask it when that many leave, so its own refusal to unmask
    would enforce nothing and its ledger would under-charge -- and one that assumed more would be asked to
    rely on shares it does not trust. Refusing a different policy (rather than charging the fewest shares any
    policy allows) also keeps one unmask rule for every hospital in a sum, which the threshold's protection
    against a server lying about dropouts needs (``task.wire.secagg.threat_problem``)."""
    count = len(participants)
    if len(set(participants)) != count:
        raise SecureRequestRefused(f"hospital {who}: the participant list repeats a hospital")
    if count < max(2, policy.min_participants):
        raise SecureRequestRefused(f"hospital {who}: refuses a secure sum over {count} hospital(s); its policy "
                                   f"needs at least {max(2, policy.min_participants)}")
    colluders, dropouts = declared_threat(who, noise)
    if (colluders, dropouts) != (policy.colluders, policy.dropouts):
        raise SecureRequestRefused(
            f"hospital {who}: the request assumes {colluders} colluder(s) and {dropouts} dropout(s), its policy "
            f"{policy.colluders} and {policy.dropouts}: every hospital of a secure sum must assume the same")
    floor = max(policy.min_threshold, policy.colluders + 1)
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < floor:
        raise SecureRequestRefused(f"hospital {who}: reconstruction threshold {threshold!r} is below its policy's "
                                   f"{floor} (more than {policy.colluders} colluder(s) must be needed to rebuild a "
                                   "hospital's masks)")
    if threshold > count:
        raise SecureRequestRefused(f"hospital {who}: threshold {threshold} exceeds the {count} participants")
    problem = threat_problem(count, policy.colluders, policy.dropouts, threshold)
    if problem:
        raise SecureRequestRefused(f"hospital {who}: {problem}")
    counted = policy.counted_shares(count)
    try:
        local = float(noise["local_variance"])
        declared = int(noise["shares"])
        total = float(noise["total_variance"])
    except (KeyError, TypeError, ValueError):
        raise SecureRequestRefused(f"hospital {who}: a secure sum must declare local_variance, shares and "
                                   "total_variance") from None
    if not (np.isfinite(local) and local > 0):
        raise SecureRequestRefused(f"hospital {who}: local variance {local} must be positive")
    if declared > count or declared < 1:
        raise SecureRequestRefused(f"hospital {who}: {declared} noise shares declared over {count} participants")
    if abs(total - declared * local) > 1e-9 * total:
        raise SecureRequestRefused(f"hospital {who}: the noise shares do not add up ({declared} x {local:.6g} != "
                                   f"declared total {total:.6g})")
    if declared != counted:
        raise SecureRequestRefused(
            f"hospital {who}: the request counts {declared} noise shares, but with {policy.colluders} colluder(s) "
            f"and {policy.dropouts} dropout(s) it can rely on {counted}: the declaration must be exactly that")
    return counted


@dataclass
class _Session:
    index: int
    participants: list                      # hospital names, in share order
    threshold: int
    bits: int
    length: int
    noise: dict
    counted: int
    key: str = ""                           # the session id (what the signed setup statement names)
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    seed: bytes = b""
    public_keys: dict = field(default_factory=dict)     # name -> (pk1, pk2)
    seed_shares: dict = field(default_factory=dict)     # owner -> share of its self-mask seed held here
    key_shares: dict = field(default_factory=dict)      # owner -> share of its masking key held here
    neighbours: list = field(default_factory=list)      # those whose share ciphertexts arrived (U2)
    stage: str = "setup"
    revealed_seed: set = field(default_factory=set)
    revealed_key: set = field(default_factory=set)


class SecureSumParty:
    """One hospital's side of the protocol, framework-free: ``handle(stage, message, contribute)``.

    ``contribute(session_note) -> int64 vector`` is called in the collect-masked stage, once, after every
    check: it charges the hospital's ledger and returns its noised integer contribution (modulo nothing:
    the party reduces it)."""

    def __init__(self, name: str, policy: SecurePolicy | None = None, identity: SigningIdentity | None = None
                 ) -> None:
        self.name = str(name)
        self.policy = policy or SecurePolicy()
        #: the consortium's roster and this hospital's signing key (a deployed hospital's, from its node
        #: config): with it every participant must be on the roster and every advertised key signed by its
        #: owner; None (a simulated hospital: the simulation plays every party) checks neither
        self.identity = identity
        self.sessions: dict[str, _Session] = {}

    # -------------------------------------------------------------------------------------------- stages
    def handle(self, stage: str, message: Mapping[str, Any],
               contribute: Callable[[Mapping[str, Any]], np.ndarray] | None = None) -> dict:
        if stage == "setup":
            return self.setup(message)
        session = self._session(message, stage)
        if stage == "share-keys":
            return self.share_keys(session, message)
        if stage == "collect-masked":
            return self.collect_masked(session, message, contribute)
        if stage == "unmask":
            return self.unmask(session, message)
        raise SecureRequestRefused(f"hospital {self.name}: unknown secure-sum stage {stage!r}")

    def _session(self, message: Mapping[str, Any], stage: str) -> _Session:
        session = self.sessions.get(str(message.get("session")))
        if session is None:
            raise SecureRequestRefused(f"hospital {self.name}: no secure-sum session {message.get('session')!r}")
        expected = STAGES[STAGES.index(session.stage) + 1] if session.stage != "unmask" else None
        if stage != expected:
            raise SecureRequestRefused(f"hospital {self.name}: stage {stage!r} out of order (expected {expected!r})")
        session.stage = stage
        return session

    def setup(self, message: Mapping[str, Any]) -> dict:
        key = str(message["session"])
        if key in self.sessions:
            raise SecureRequestRefused(f"hospital {self.name}: session {key!r} was already set up")
        participants = [str(p) for p in message["participants"]]
        if self.name not in participants:
            raise SecureRequestRefused(f"hospital {self.name}: not among the session's participants")
        if self.identity is not None:   # invented participants would inflate the shares it counts
            strangers = [p for p in participants if p not in self.identity.roster.keys]
            if strangers:
                raise SecureRequestRefused(f"hospital {self.name}: participants {strangers} are not on the "
                                           "consortium's secure-roster")
        threshold = message.get("threshold")
        counted = check_request(self.policy, self.name, participants, threshold, dict(message.get("noise") or {}))
        bits, length = int(message["bits"]), int(message["length"])
        if not (2 <= bits <= 62) or length < 1:
            raise SecureRequestRefused(f"hospital {self.name}: bits {bits} / length {length} out of range")
        session = _Session(participants.index(self.name) + 1, participants, int(threshold), bits, length,
                           dict(message["noise"]), counted, key)
        session.sk1, session.pk1 = secagg.generate_keys()
        session.sk2, session.pk2 = secagg.generate_keys()
        self.sessions[key] = session
        reply = {"pk1": session.pk1, "pk2": session.pk2}
        if self.identity is not None:
            reply["signature"] = self.identity.sign(self._statement(session, self.name, session.pk1, session.pk2))
        return reply

    @staticmethod
    def _statement(session: _Session, hospital: str, pk1: bytes, pk2: bytes) -> bytes:
        setup = SumSetup(session.key, tuple(session.participants), session.threshold, session.bits,
                         session.length, session.noise)
        return setup_statement(setup, hospital, pk1, pk2)

    def share_keys(self, session: _Session, message: Mapping[str, Any]) -> dict:
        advertised = dict(message["public_keys"])
        keys = {str(k): (bytes(v[0]), bytes(v[1])) for k, v in advertised.items()}
        if self.identity is not None:
            # before any share leaves: every advertised key signed by its owner on the roster, over the setup
            # this hospital was told -- no substituted key, no hospital told another setup or threat model
            for name, (pk1, pk2) in keys.items():
                value = advertised[name]
                try:
                    signature = bytes(value[2]) if len(value) > 2 else b""
                except (TypeError, ValueError):
                    signature = b""
                if not self.identity.roster.verify(name, self._statement(session, name, pk1, pk2), signature):
                    raise SecureRequestRefused(f"hospital {self.name}: the keys advertised for {name} are not "
                                               "signed by that hospital's roster key for this setup")
        if len(keys) < session.threshold:
            raise SecureRequestRefused(f"hospital {self.name}: {len(keys)} hospitals advertised keys, fewer than "
                                       f"the threshold {session.threshold}")
        if keys.get(self.name) != (session.pk1, session.pk2):
            raise SecureRequestRefused(f"hospital {self.name}: its own public keys were not forwarded unchanged")
        flat = [k for pair in keys.values() for k in pair]
        if len(set(flat)) != len(flat):
            raise SecureRequestRefused(f"hospital {self.name}: two advertised public keys are identical")
        if any(name not in session.participants for name in keys):
            raise SecureRequestRefused(f"hospital {self.name}: keys from a hospital outside the session")
        session.public_keys = keys
        session.seed = os.urandom(32)
        holders = sorted(keys, key=session.participants.index)
        seed_shares = secagg.split(session.seed, session.threshold, len(holders))
        key_shares = secagg.split(session.sk1, session.threshold, len(holders))
        ciphertexts = {}
        for position, holder in enumerate(holders):
            if holder == self.name:
                session.seed_shares[self.name] = seed_shares[position]
                session.key_shares[self.name] = key_shares[position]
                continue
            channel = secagg.agree(session.sk2, keys[holder][1])
            plaintext = secagg.pack_shares(session.index, session.participants.index(holder) + 1,
                                           seed_shares[position], key_shares[position])
            ciphertexts[holder] = secagg.encrypt(channel, plaintext)
        return {"ciphertexts": ciphertexts}

    def collect_masked(self, session: _Session, message: Mapping[str, Any], contribute) -> dict:
        received = {str(k): bytes(v) for k, v in dict(message["ciphertexts"]).items()}
        if len(received) + 1 < session.threshold:
            raise SecureRequestRefused(f"hospital {self.name}: only {len(received)} neighbours left, below the "
                                       f"threshold {session.threshold}")
        for source, ciphertext in received.items():
            if source not in session.public_keys or source == self.name:
                raise SecureRequestRefused(f"hospital {self.name}: shares from an unknown hospital {source!r}")
            channel = secagg.agree(session.sk2, session.public_keys[source][1])
            origin, destination, seed_share, key_share = secagg.unpack_shares(secagg.decrypt(channel, ciphertext))
            if origin != session.participants.index(source) + 1 or destination != session.index:
                raise SecureRequestRefused(f"hospital {self.name}: a share from {source} was addressed wrongly")
            session.seed_shares[source] = seed_share
            session.key_shares[source] = key_share
        session.neighbours = sorted(received, key=session.participants.index)
        need = len(session.participants) - self.policy.dropouts
        if len(received) + 1 < need:   # the unmask would be refused: refuse now, before the charge
            raise SecureRequestRefused(
                f"hospital {self.name}: only {len(received) + 1} of {len(session.participants)} hospitals shared "
                f"their keys; with its policy of at most {self.policy.dropouts} dropout(s) the sum needs {need}")
        if contribute is None:
            raise SecureRequestRefused(f"hospital {self.name}: nothing to contribute")
        vector = np.asarray(contribute(message), dtype=np.int64).reshape(-1)
        if len(vector) != session.length:
            raise SecureRequestRefused(f"hospital {self.name}: contribution of length {len(vector)}, expected "
                                       f"{session.length}")
        modulus = (1 << session.bits) - 1
        masked = (vector & modulus) + secagg.mask(session.seed, session.length, session.bits)
        masked &= modulus
        for other in session.neighbours:
            pairwise = secagg.mask(secagg.agree(session.sk1, session.public_keys[other][0]), session.length,
                                   session.bits)
            if session.index > session.participants.index(other) + 1:
                masked = (masked + pairwise) & modulus
            else:
                masked = (masked - pairwise) & modulus
        return {"masked": masked}

    def unmask(self, session: _Session, message: Mapping[str, Any]) -> dict:
        survivors = [str(s) for s in message["survivors"]]
        dropped = [str(s) for s in message["dropped"]]
        if len(set(survivors)) != len(survivors) or len(set(dropped)) != len(dropped):
            raise SecureRequestRefused(f"hospital {self.name}: the survivors or dropped list repeats a hospital")
        if set(survivors) & set(dropped):
            both = sorted(set(survivors) & set(dropped))
            raise SecureRequestRefused(f"hospital {self.name}: asked for both shares of {both}")
        if self.name not in survivors:
            raise SecureRequestRefused(f"hospital {self.name}: not listed among the survivors")
        need = len(session.participants) - self.policy.dropouts
        if len(survivors) < max(need, session.threshold):
            raise SecureRequestRefused(
                f"hospital {self.name}: only {len(survivors)} masked inputs arrived; with its policy of at most "
                f"{self.policy.dropouts} dropout(s) the sum needs {max(need, session.threshold)} (the noise it "
                "counted would be missing)")
        unknown = [h for h in survivors + dropped if h not in session.seed_shares]
        if unknown:
            raise SecureRequestRefused(f"hospital {self.name}: holds no shares of {unknown}")
        if any(h in session.revealed_key for h in survivors) or any(h in session.revealed_seed for h in dropped):
            raise SecureRequestRefused(f"hospital {self.name}: would reveal both shares of one hospital")
        session.revealed_seed.update(survivors)
        session.revealed_key.update(dropped)
        shares = {h: session.seed_shares[h] for h in survivors}
        shares.update({h: session.key_shares[h] for h in dropped})
        return {"shares": shares}


# ------------------------------------------------------------------------------------------ a hospital
def policy_from(request: HospitalRequest | Mapping[str, Any] | None, default: SecurePolicy | None = None
                ) -> SecurePolicy:
    """A simulated hospital's policy as the simulation sets it (the request's ``secure_policy``), else
    ``default``."""
    given = dict(HospitalRequest.from_config(request).secure_policy or {})
    if not given:
        return default or SecurePolicy()
    try:
        return SecurePolicy(**{k: int(v) for k, v in given.items()})
    except TypeError as exc:
        raise UserError(f"secure policy: {exc}") from None


class SecureHospital:
    """A :class:`clients.hospital.Hospital` taking part in secure sums: the stages of :class:`SecureSumParty`,
    and in the collect-masked stage its PATE contribution -- every teacher's encoding of the public scans,
    re-clipped and conditionally rounded row by row onto the declared integer grid, summed over its
    teachers, plus its own share of discrete Gaussian noise (``privacy.distributed``). Before any teacher runs
    it charges its own ledger, for each query of the batch, the distributed discrete Gaussian with the noise
    shares it can count on (:class:`SecurePolicy`); a refusal or an exceeded budget costs nothing. For a
    ``dp-fedavg-secure`` run (noise ``kind`` ``head-gradient``) the contribution is instead its patients'
    clipped head gradients, after a ``join`` request that brought the frozen start model
    (``clients.secure_gradients``); the same order holds: refusals, the charge, then the data.

    A deployed hospital's policy is its own (``policy``); a simulated one's comes with the simulation's
    messages (``secure_policy``), as its lifetime budget does."""

    def __init__(self, hospital, policy: SecurePolicy | None = None, identity: SigningIdentity | None = None
                 ) -> None:
        self.hospital = hospital
        self.policy = policy
        self.party = SecureSumParty(hospital.hospital_id, policy or SecurePolicy(), identity)

    @property
    def gradients(self):
        """This hospital's ``dp-fedavg-secure`` contributor (``clients.secure_gradients``; one per hospital)."""
        return contributor_for(self.hospital)

    def handle(self, stage: str, message: Mapping[str, Any],
               config: SecureStageRequest | Mapping[str, Any] | None = None) -> dict:
        """One stage of a secure sum; ``config``: the run's settings beside it (a
        :class:`task.wire.requests.SecureStageRequest`, read once here)."""
        request = self.hospital.read_request(SecureStageRequest, config)
        if stage == secagg.JOIN_STAGE:   # before any secure sum of a dp-fedavg-secure run: nothing is charged
            return self.gradients.join(message, request)
        if stage == "setup":
            deployed = bool(getattr(self.hospital, "deployed", False))
            if deployed and self.party.identity is None:
                raise SecureRequestRefused(
                    f"hospital {self.party.name}: takes part in secure sums only with the consortium's roster "
                    "(node-config secure-roster and secure-signing-key): without it a server could substitute "
                    "the other hospitals' keys")
            # a deployed hospital's policy is its own node config's, never the server's (default: the strictest)
            self.party.policy = (self.policy or SecurePolicy()) if deployed else policy_from(request, self.policy)
            noise = dict(message.get("noise") or {})
            declared_grid(self.party.name, noise)
            ids = noise.get("release_ids")
            if not isinstance(ids, (list, tuple)) or not ids or len(set(map(str, ids))) != len(ids):
                raise SecureRequestRefused(f"hospital {self.party.name}: a secure release must declare distinct "
                                           "release ids, one per query")
        session_id = str(message.get("session"))
        return self.party.handle(stage, message, lambda msg: self.contribution(self.party.sessions[session_id], msg,
                                                                               request))

    def contribution(self, session: _Session, message: Mapping[str, Any],
                     request: SecureStageRequest | Mapping[str, Any]) -> np.ndarray:
        """The contribution the session's noise declaration names (``kind``): PATE's teachers' encodings
        (the default) or ``dp-fedavg-secure``'s patient gradients (``task.wire.secagg.CONTRIBUTION_KIND``)."""
        from task.wire.secagg import CONTRIBUTION_KIND as KIND, PATE_CONTRIBUTION_KIND

        kind = str(session.noise.get("kind") or PATE_CONTRIBUTION_KIND)
        if kind == KIND:
            return self.gradients.contribution(session, message, request, self.party.policy)
        if kind != PATE_CONTRIBUTION_KIND:
            raise SecureRequestRefused(f"hospital {self.party.name}: unknown contribution kind {kind!r}")
        return self.pate_contribution(session, message, request)

    def pate_contribution(self, session: _Session, message: Mapping[str, Any],
                          config: SecureStageRequest | Mapping[str, Any]) -> np.ndarray:
        """Charge, then the noised integer sum of this hospital's teachers' rounded encodings (flattened)."""
        from clients.replay import mint_nonce
        from privacy.distributed import ddg_event, sample_discrete_gaussian
        from privacy.mechanisms import NoiseSource
        from task.codecs import make_encoder, verify_codec

        hospital, noise = self.hospital, session.noise
        request = hospital.read_request(SecureStageRequest, config)
        who = hospital.hospital_id
        scans = np.asarray(message["scans"], np.float32)
        codec = verify_codec(message["codec"], hospital._codec_policy(request), scans_shape=scans.shape)
        grid = declared_grid(who, noise)
        release_ids = [str(r) for r in noise["release_ids"]]
        latent = int(np.asarray(codec["latent_dim"]).item())
        if len(release_ids) != len(scans) or grid.dimension != latent or session.length != len(scans) * latent:
            raise SecureRequestRefused(f"hospital {who}: {len(scans)} scans of latent dimension {latent} do not match "
                                       f"the declared {len(release_ids)} releases of dimension {grid.dimension}")
        local_variance = float(noise["local_variance"])
        encode = make_encoder(codec, hospital.compute(request)[0])
        # refusals first: nothing is charged for a request this hospital will not answer
        seed = request.secure_noise_seed
        if seed is not None and getattr(hospital, "deployed", False):
            raise SecureRequestRefused(f"hospital {who}: refuses seeded noise (simulation only)")
        hospital.load_teachers(request)   # a hospital that cannot answer refuses before it is charged
        # the charge: one release per query, the noise it can count on, before any teacher sees a scan
        event = ddg_event(grid, local_variance, session.counted, 1, "replace-one")
        nonce = mint_nonce()
        hospital.lifetime_guard(request).charge_all(
            [who], event, [f"{r}@{nonce}" for r in release_ids],
            {"secure_sum": True, "participants": len(session.participants), "counted_shares": session.counted,
             "colluders": self.party.policy.colluders, "dropouts": self.party.policy.dropouts,
             "threshold": session.threshold, "local_variance": local_variance,
             "codec": str(np.asarray(codec["kind"]).item()), "latent_dim": latent})
        source = NoiseSource() if seed is None else NoiseSource.reproducible(seed)
        # a stream named by what the release is (the server's query batch), not by the run's nonce: reproducible
        # noise repeats; with secure noise the name only separates streams
        generator = source.generator(who, str(message.get("stream") or ",".join(release_ids)))
        total = np.zeros((len(scans), latent), np.int64)
        # every teacher's rows (a broken teacher's: the fixed fallback), encoded where the teachers computed them,
        # then rounded teacher after teacher, in the order the rounding draws from the stream
        for rows in hospital.encoded_answers(scans, request, codec, encode)[0]:
            total += grid.to_integers(np.asarray(rows, np.float64), generator)
        shares = sample_discrete_gaussian(local_variance, total.size, generator)
        return total.reshape(-1) + shares


# ------------------------------------------------------------------------- secrets kept between stages
def session_state(session: _Session, policy: SecurePolicy) -> dict:
    """Everything a hospital keeps of one secure sum between its stages -- its key pairs, its self-mask seed,
    the shares it holds, and the policy it checked the request against at setup -- as a plain dict of str,
    int, float, lists, dicts and bytes (``task.wire.flower_wire.pack_nested`` carries it). Secret: it never leaves
    the hospital (:func:`run_stage` keeps it in a node-local store)."""
    state = {name: getattr(session, name) for name in _Session.__dataclass_fields__}
    state["public_keys"] = {k: [v[0], v[1]] for k, v in session.public_keys.items()}
    state["revealed_seed"], state["revealed_key"] = sorted(session.revealed_seed), sorted(session.revealed_key)
    return {"session": state, "policy": policy.to_dict()}


def restore_session(state: Mapping[str, Any]) -> tuple[_Session, SecurePolicy]:
    """Inverse of :func:`session_state`."""
    fields = dict(state["session"])
    fields["public_keys"] = {str(k): (bytes(v[0]), bytes(v[1])) for k, v in dict(fields["public_keys"]).items()}
    for name in ("sk1", "pk1", "sk2", "pk2", "seed"):
        fields[name] = bytes(fields[name])
    for name in ("seed_shares", "key_shares"):
        fields[name] = {str(k): bytes(v) for k, v in dict(fields[name]).items()}
    fields["revealed_seed"], fields["revealed_key"] = set(fields["revealed_seed"]), set(fields["revealed_key"])
    return _Session(**fields), SecurePolicy(**{k: int(v) for k, v in dict(state["policy"]).items()})


#: what a store holds for a session whose last stage (unmask) is done: its secrets are gone
FINISHED = None


def run_stage(secure: SecureHospital, stage: str, message: Mapping[str, Any],
              config: SecureStageRequest | Mapping[str, Any], store) -> dict:
    """One secure-sum stage at a hospital whose per-session secrets live in ``store`` (a mutable mapping
    session id -> :func:`session_state`, or :data:`FINISHED`), not in ``secure``: the in-process engine keeps
    a dict per hospital, the Flower ClientApp the node's ``context.state`` (rebuilt objects, same secrets), so
    both engines run exactly this code. After an unmask message -- answered or refused, nothing can follow
    it -- the session's secrets are dropped and only the fact that it finished is kept: every later message
    for it is refused. Another stage that is refused still records what it changed (as
    :class:`SecureSumParty` does in memory: an out-of-order stage is not retried).

    A hospital takes part in one secure sum at a time (the server runs them one after another), so a new
    setup abandons any sum left unfinished -- one the server gave up on, or one this hospital dropped out of:
    its secrets are dropped and its session marked finished, and a late message for it is refused."""
    key = str(message.get("session"))
    if key in store and store[key] is FINISHED:
        raise SecureRequestRefused(f"hospital {secure.party.name}: secure-sum session {key!r} is finished")
    if stage == "setup":
        for abandoned in [other for other in store if other != key and store[other] is not FINISHED]:
            store[abandoned] = FINISHED
    secure.party.sessions.pop(key, None)
    if key in store:
        session, secure.party.policy = restore_session(store[key])
        secure.party.sessions[key] = session
    try:
        reply = secure.handle(stage, message, config)
    finally:
        session = secure.party.sessions.pop(key, None)
        if session is not None:
            store[key] = FINISHED if stage == "unmask" else session_state(session, secure.party.policy)
    return reply
