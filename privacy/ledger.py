"""The privacy ledger: one append-only JSON-lines file of releases, viewed per data owner
(docs/PRIVACY.md, "The ledger").

Each line is one release::

    {"release_id": "...", "owners": ["hospital-1", ...], "event": {...}, "note": {...}, "time": 1.7e9}

``record`` writes the line with a single ``write``, then ``flush`` and ``os.fsync`` *before it returns*;
callers release the noisy result only afterwards. A process killed at any point therefore leaves either
the complete line (the release may have happened — it is counted) or a truncated last line (``record``
never returned, so nothing was released — it is dropped on load, and cut off before the next append).

Repeats merge: the same ``release_id`` recorded twice (a retried round, a resumed run) counts once;
different owners or event under one ``release_id`` is an error. A repeat is only sound where the mechanism
behind it does not run again with fresh noise: release ids that a party outside the data owner can choose
(a server's round number) must carry a nonce the owner mints (``clients/replay.py``).

Several writers: every process and thread that opens the same file serialises on an exclusive
``flock`` of ``<file>.lock`` (:meth:`Ledger.exclusive`; the file exists only while the lock is held). ``record``
holds it while it re-reads what others appended and appends its own line; opening a file holds it while it
reads and cuts a torn tail, so a complete record another process appended in between is never cut off. The
budget guard holds it from its check to its record (``privacy.guard``), so two guards over one lifetime ledger
cannot both pass. Within one process the lock is one per file, by its folder's device and inode and its name:
Ledger objects (or paths) naming the same file share it instead of waiting for each other.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

try:  # POSIX advisory locks; where fcntl does not exist (Windows) only threads are serialised
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms we run
    fcntl = None

from privacy.accountants import accountant_for, make_accountant
from privacy.errors import PrivacyError
from privacy.events import Event, event_from_dict


class _SharedFileLock:
    """One lock file's ``flock`` in this process: taken once by the outermost holder, re-entrant in its thread;
    other threads of the process wait on ``mutex`` (and other processes on the ``flock``)."""

    def __init__(self) -> None:
        self.mutex = threading.RLock()
        self.depth = 0
        self.handle = None


_FILE_LOCKS: dict[tuple, _SharedFileLock] = {}
_FILE_LOCKS_GUARD = threading.Lock()


def _forget_file_locks() -> None:
    """In a forked child: no thread of the parent exists there to release what it held."""
    global _FILE_LOCKS_GUARD
    _FILE_LOCKS.clear()
    _FILE_LOCKS_GUARD = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_file_locks)


def _lock_key(lock_path: Path) -> tuple:
    """Which lock ``lock_path`` is, whatever path names it and whether or not the file exists now: its folder's
    device and inode, and its name (a ``..`` or a linked folder give the same key; the file itself comes and
    goes, :func:`_file_lock`)."""
    folder = os.stat(lock_path.parent)
    return (folder.st_dev, folder.st_ino, lock_path.name)


def _flock_current(lock_path: Path):
    """An open handle of the file now at ``lock_path``, exclusively ``flock``ed. The previous holder removes the
    file before it unlocks, so a waiter that wakes up holding a removed file tries again with the file now there:
    two processes never both hold the file at ``lock_path``."""
    while True:
        handle = open(lock_path, "a+b")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            mine = os.fstat(handle.fileno())
            try:
                current = os.stat(lock_path)
            except FileNotFoundError:
                current = None
            if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                return handle
        except BaseException:
            handle.close()
            raise
        handle.close()


@contextlib.contextmanager
def _file_lock(lock_path: Path | None, ledger_path: Path | None) -> Iterator[None]:
    """Hold the exclusive lock of ``lock_path`` (:func:`_lock_key`: any number of Ledgers and paths naming one
    file take one ``flock`` in this process); nothing to hold in memory or without fcntl. The lock file exists
    only while the lock is held: the outermost holder removes it before unlocking (:func:`_flock_current`), so
    no empty ``.lock`` file is left beside a ledger."""
    if lock_path is None or fcntl is None:
        yield
        return
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    with _FILE_LOCKS_GUARD:
        shared = _FILE_LOCKS.setdefault(_lock_key(lock_path), _SharedFileLock())
    shared.mutex.acquire()
    try:
        if shared.depth == 0:
            shared.handle = _flock_current(lock_path)
        shared.depth += 1
    except BaseException:
        shared.mutex.release()
        raise
    try:
        yield
    finally:
        shared.depth -= 1
        if shared.depth == 0:
            held, shared.handle = shared.handle, None
            try:
                lock_path.unlink(missing_ok=True)   # still held: whoever waits on this file will take the next
            finally:
                try:
                    fcntl.flock(held.fileno(), fcntl.LOCK_UN)
                finally:
                    held.close()
        shared.mutex.release()


@dataclass(frozen=True)
class Spent:
    """What one owner has spent: (ε, δ) under ``accountant`` and ``relation`` over ``releases`` releases."""

    epsilon: float
    delta: float
    accountant: str
    relation: str | None
    releases: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _content(record: dict) -> tuple:
    """What must agree between two records with the same release_id (note and time are informational)."""
    return (tuple(sorted(record["owners"])), _canonical(record["event"]))


class Ledger:
    """Per-owner privacy ledger; ``path=None`` keeps it in memory.

    Opening an existing file loads it (same rules as :meth:`load`) and appends after it.

    ``timestamps=False``: the records this object writes carry ``"time": null``. For a release whose
    guarantee needs its running time kept secret (private selection, Papernot & Steinke 2022, arXiv
    2110.03620: the number of repetitions must not be published), a time written at the charge, before the
    repetitions, would date their start.
    """

    def __init__(self, path: str | Path | None = None, *, timestamps: bool = True, read_only: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.timestamps = bool(timestamps)
        #: opened to be read (``fedpate privacy spent``): nothing is written, a torn tail is left as found
        self.read_only = bool(read_only)
        self._records: list[dict] = []
        self._by_id: dict[str, dict] = {}
        self._events_cache: dict[str, list[Event]] = {}
        self._accountant_cache: dict[tuple, tuple] = {}
        self._checked: dict[tuple, tuple] = {}    # (owner, relation, accountant) -> (events, accountant over them)
        self._epsilons: dict[tuple, tuple] = {}   # (owner, relation, accountant, delta) -> (events, epsilon)
        self._thread_lock = threading.RLock()
        self._lock_depth = 0
        self._offset = 0   # bytes of the file merged so far (always the end of a complete line)
        if self.path is not None and self.path.exists():
            self.refresh()   # reading needs no lock (complete lines only), so a read-only copy opens too
            if self.read_only:
                return
            if self.path.stat().st_size > self._offset or not self._ends_with_newline():
                with self.exclusive():   # re-read under the lock, then cut the torn tail while no one appends
                    self._truncate_partial_tail(self._offset)

    @property
    def torn_tail_bytes(self) -> int:
        """Bytes after the last complete record (0 in memory or when the file ends with one): a write cut short
        by a kill (nothing was released) -- or, in a copied file, a copy cut short (a release may be missing, so
        the ε it gives is only a lower bound). Cut off when the file is opened for writing; kept read-only."""
        if self.path is None or not self.path.exists():
            return 0
        return max(0, self.path.stat().st_size - self._offset)

    # ------------------------------------------------------------------ locking

    @property
    def lock_path(self) -> Path | None:
        """``<ledger>.lock`` beside the file: locked, never written, there only while the lock is held (the
        ledger itself may not exist yet)."""
        return None if self.path is None else self.path.with_name(self.path.name + ".lock")

    def lock_identity(self) -> tuple:
        """Which lock this ledger takes: ``("file", st_dev, st_ino, name)`` of its lock file's folder and name
        (:func:`_lock_key`), so that two paths naming one file -- a linked folder, a ``..`` -- are seen as one,
        and every process orders the same locks alike whether their files exist at the moment or not;
        ``("memory", id)`` in memory. A chain of guards orders and de-duplicates the locks it takes by it
        (``privacy.guard.GuardChain``)."""
        if self.path is None:
            return ("memory", id(self))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return ("file", *_lock_key(self.lock_path))

    @contextlib.contextmanager
    def exclusive(self, refresh: bool = True) -> Iterator["Ledger"]:
        """Hold this ledger's exclusive lock (re-entrant within one thread); on entry, merge what other
        writers appended (``refresh``). Everything that decides on the ledger's content and then writes to it
        -- the guard's check-then-record, a batch of charges, cutting a torn tail -- runs inside it.

        The file lock is shared by every Ledger of this process whose lock file is the same file (same folder and
        name, whatever path named it): ``flock`` locks belong to an open file, so a second Ledger over the same
        file in the same thread would otherwise wait for itself forever."""
        with _file_lock(None if self.path is None else self.lock_path, self.path):
            with self._thread_lock:
                outermost = self._lock_depth == 0
                self._lock_depth += 1
                try:
                    if outermost and refresh:
                        self.refresh()
                    yield self
                finally:
                    self._lock_depth -= 1

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path, read_only: bool = False) -> "Ledger":
        """Load an existing ledger file (PrivacyError if it is missing or corrupt before its last line);
        ``read_only``: change nothing in it (a torn tail stays, :attr:`torn_tail_bytes`)."""
        path = Path(path)
        if not path.is_file():
            raise PrivacyError(f"ledger file {path} does not exist")
        return cls(path, read_only=read_only)

    @staticmethod
    def _read(path: Path, start: int = 0) -> tuple[list[dict], int]:
        """Parse the records from byte ``start`` (a line boundary) on; returns them and the byte length of the
        valid prefix (complete lines), counted from the file's start."""
        with open(path, "rb") as handle:
            handle.seek(start)
            data = handle.read()
        lines = data.split(b"\n")
        records: list[dict] = []
        offset = start
        valid_bytes = start
        for number, raw in enumerate(lines, start=1):
            is_last = number == len(lines)
            line_end = offset + len(raw) + (0 if is_last else 1)
            if raw.strip():
                try:
                    record = Ledger._parse(raw)
                except PrivacyError as exc:
                    # Only the final, newline-less fragment can be a write cut short by a kill.
                    if is_last:
                        break
                    raise PrivacyError(f"ledger {path}, line {number}: {exc}") from None
                records.append(record)
            valid_bytes = line_end
            offset = line_end
        return records, valid_bytes

    @staticmethod
    def _parse(raw: bytes) -> dict:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PrivacyError(f"not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
        return Ledger._validate(record)

    @staticmethod
    def _validate(record: Any) -> dict:
        if not isinstance(record, dict):
            raise PrivacyError("a record must be a JSON object")
        missing = {"release_id", "owners", "event"} - set(record)
        if missing:
            raise PrivacyError(f"record lacks {sorted(missing)}")
        if not isinstance(record["release_id"], str) or not record["release_id"]:
            raise PrivacyError("release_id must be a non-empty string")
        owners = record["owners"]
        if not isinstance(owners, list) or not owners or not all(isinstance(o, str) and o for o in owners):
            raise PrivacyError("owners must be a non-empty list of non-empty strings")
        if len(set(owners)) != len(owners):
            raise PrivacyError(f"owners must be distinct, got {owners}")
        event_from_dict(record["event"])  # validates
        note = record.get("note") or {}
        if not isinstance(note, dict):
            raise PrivacyError("note must be a JSON object")
        return {
            "release_id": record["release_id"],
            "owners": list(owners),
            "event": record["event"],
            "note": note,
            "time": record.get("time"),
        }

    def _ends_with_newline(self) -> bool:
        if self._offset == 0:
            return True
        with open(self.path, "rb") as handle:
            handle.seek(self._offset - 1)
            return handle.read(1) == b"\n"

    def _truncate_partial_tail(self, valid_bytes: int) -> None:
        """Cut a torn last fragment off (callers hold :meth:`exclusive`, so no live writer is mid-line)."""
        assert self.path is not None and self._lock_depth > 0
        if not self.path.exists():
            return
        size = self.path.stat().st_size
        if size > valid_bytes:
            # The fragment belongs to a record() that never returned (its release never happened). Cut it
            # off so our next line does not glue onto it and become a corrupt middle line.
            with open(self.path, "r+b") as handle:
                handle.truncate(valid_bytes)
                handle.flush()
                os.fsync(handle.fileno())
        if valid_bytes > 0:
            with open(self.path, "rb") as handle:
                handle.seek(valid_bytes - 1)
                last = handle.read(1)
            if last != b"\n":  # a complete last record without newline: terminate it
                with open(self.path, "ab") as handle:
                    handle.write(b"\n")
                    handle.flush()
                    os.fsync(handle.fileno())
                self._offset = valid_bytes + 1

    def _merge(self, record: dict, source: str) -> bool:
        """Add a validated record; False if it repeats an identical one. PrivacyError on a conflict."""
        existing = self._by_id.get(record["release_id"])
        if existing is not None:
            if _content(existing) != _content(record):
                raise PrivacyError(
                    f"{source}: release_id {record['release_id']!r} recorded twice with different owners or event"
                )
            return False
        self._records.append(record)
        self._by_id[record["release_id"]] = record
        event = None
        for owner in record["owners"]:
            if owner in self._events_cache:  # keep computed per-owner views current (append-only)
                event = event or event_from_dict(record["event"])
                self._events_cache[owner].append(event)
        return True

    def refresh(self) -> int:
        """Merge the records other writers (processes, earlier runs) appended to the file since it was read;
        returns how many were new. The cached accountants then only compose the new events."""
        if self.path is None or not self.path.exists():
            return 0
        if self.path.stat().st_size < self._offset:   # the file was replaced: read it whole (merges are idempotent)
            self._offset = 0
        records, self._offset = self._read(self.path, self._offset)
        return sum(1 for record in records if self._merge(record, source=str(self.path)))

    # ------------------------------------------------------------------ writing

    def record(
        self, owners: Sequence[str], event: Event, release_id: str, note: dict | None = None
    ) -> None:
        """Append one release charged to every owner in ``owners``; durable (fsync) before returning."""
        if not isinstance(event, Event):
            raise PrivacyError(f"record expects a privacy event, got {event!r}")
        if isinstance(owners, str):
            raise PrivacyError(f"owners must be a list of owner names, got the string {owners!r}")
        candidate = {
            "release_id": release_id,
            "owners": list(owners),
            "event": event.to_dict(),
            "note": dict(note or {}),
            "time": time.time() if self.timestamps else None,
        }
        if self.read_only:
            raise PrivacyError(f"ledger {self.path} was opened read-only: release {release_id!r} not recorded")
        record = self._validate(candidate)
        try:
            line = _canonical(record) + "\n"
        except (TypeError, ValueError) as exc:
            raise PrivacyError(f"release {release_id!r}: note must be JSON-serialisable ({exc})") from None
        with self.exclusive(refresh=False):
            # what other writers appended is merged first: a repeat is seen as one, and no complete line is taken
            # for a torn tail. Read here, not only when the lock is first taken: another Ledger object on the
            # same file may have appended under the same hold of the lock (two paths to one file in one chain)
            self.refresh()
            existing = self._by_id.get(release_id)
            if existing is not None:
                if _content(existing) != _content(record):
                    raise PrivacyError(
                        f"release_id {release_id!r} already recorded with different owners or event"
                    )
                return  # a repeat: already durable, counts once
            if self.path is not None:
                self._truncate_partial_tail(self._offset)   # a writer killed mid-line left a fragment
                payload = line.encode("utf-8")
                self._append(payload)
                self._offset += len(payload)
            self._merge(record, source=str(self.path or "<memory>"))

    def _append(self, payload: bytes) -> None:
        assert self.path is not None
        created = not self.path.exists()
        if created:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND + one write per record: a record is never interleaved with another line. Owner-only (0600):
        # a ledger is its owner's record of what was released about its patients, not a report to share.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            view = memoryview(payload)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # make the new directory entry durable too
            try:
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
            except OSError:
                return
            try:
                os.fsync(dir_fd)
            except OSError:
                pass
            finally:
                os.close(dir_fd)

    # ------------------------------------------------------------------ views

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[dict]:
        """The merged records, in the order first recorded (copies)."""
        return json.loads(_canonical(self._records))

    def has_release(self, release_id: str) -> bool:
        return release_id in self._by_id

    def owners(self) -> list[str]:
        return sorted({owner for record in self._records for owner in record["owners"]})

    def events(self, owner: str, relation: str | None = None) -> list[Event]:
        """Events charged to ``owner`` (optionally only those under ``relation``), in recording order."""
        if owner not in self._events_cache:
            self._events_cache[owner] = [
                event_from_dict(record["event"]) for record in self._records if owner in record["owners"]
            ]
        events = list(self._events_cache[owner])
        if relation is not None:
            events = [event for event in events if event.relation == relation]
        return events

    def relations(self, owner: str) -> list[str]:
        return sorted({event.relation for event in self.events(owner)})

    def spent(
        self,
        owner: str,
        delta: float,
        relation: str | None = None,
        accountant: str | None = None,
        extra: Sequence[Event] = (),
    ) -> Spent:
        """ε spent by ``owner`` at ``delta`` (accountant from ``accountant_for`` unless named).

        Refuses (PrivacyError) to add up events under different neighbouring relations unless a
        ``relation`` filter is given. ``extra`` adds hypothetical events (used by the budget guard).
        """
        events = self.events(owner, relation) + list(extra)
        relations = sorted({event.relation for event in events})
        if len(relations) > 1:
            raise PrivacyError(
                f"owner {owner!r} has events under different neighbouring relations {relations}; "
                "pass relation= to account one of them (they must not be added up)"
            )
        name = accountant_for(events).name if accountant is None else accountant
        key = (owner, relation, name)
        acc = self._accountant(owner, relation, name, len(events) - len(extra))
        if extra:
            # Hypothetical events go on a copy: the cached state must keep matching the ledger. The copy is kept
            # with the events it holds: a guard checks a release, then records it, and the next accountant over
            # the ledger is this one if (only if) those very events were recorded (``_accountant``)
            acc = copy.deepcopy(acc).compose_all(extra)
            self._checked[key] = (tuple(events), acc)
        epsilon = self._epsilon(key, tuple(events), acc, delta) if events else 0.0
        releases = len(events) - len(extra)
        return Spent(
            epsilon=float(epsilon),
            delta=float(delta),
            accountant=acc.name,
            relation=relations[0] if relations else relation,
            releases=releases,
        )

    def _accountant(self, owner: str, relation: str | None, name: str, upto: int):
        """Accountant over the owner's first ``upto`` events, composed incrementally and cached.

        The ledger is append-only, so a cached accountant over a prefix only needs the new events; this
        keeps per-epoch/per-query charging linear instead of quadratic (PLD compositions are costly).
        """
        key = (owner, relation, name)
        cached = self._accountant_cache.get(key)
        if cached is None or cached[1] > upto:
            cached = (make_accountant(name), 0)
        acc, done = cached
        events = self.events(owner, relation)
        checked = self._checked.get(key)
        if checked is not None:
            held, checked_acc = checked
            # the accountant a budget check composed over exactly these events (the same ones, compared, not
            # assumed): the composition need not be done twice, once to check and once to record
            if done < len(held) <= upto and tuple(events[:len(held)]) == held:
                acc, done = checked_acc, len(held)
                del self._checked[key]
        acc.compose_all(events[done:upto])
        self._accountant_cache[key] = (acc, upto)
        return acc

    def adopt(self, owner: str, events: Sequence[Event], accountant, delta: float, epsilon: float) -> None:
        """Remember an accountant composed elsewhere over exactly ``events`` (and its ε at ``delta``), so that once
        ``owner``'s events *are* those events, :meth:`spent` reads it instead of composing them again.

        Compared, not assumed: it is used only while the owner's events equal ``events`` (the same events in the
        same order, under the accountant ``accountant_for`` picks for them); anything else composes as usual. A
        budget guard's verified plan uses it (``privacy.guard.BudgetGuard.expect``): the plan is composed once,
        and the ledger's ε at the end of a run that followed it is that composition's."""
        events = tuple(events)
        name = accountant_for(list(events)).name
        if accountant.name != name:
            raise PrivacyError(f"adopt: an accountant {accountant.name!r} for events the ledger accounts with {name!r}")
        key = (owner, None, name)
        self._checked[key] = (events, copy.deepcopy(accountant))
        self._epsilons[(*key, delta)] = (events, float(epsilon))

    def _epsilon(self, key: tuple, events: tuple, acc, delta: float) -> float:
        """``acc.get_epsilon(delta)``, remembered for the last ``events`` of ``key``: the PLD's search for epsilon
        costs ~0.1 s, and a charge asks it twice over the same events (the check, then the spent after it)."""
        remembered = self._epsilons.get((*key, delta))
        if remembered is not None and remembered[0] == events:
            return remembered[1]
        epsilon = acc.get_epsilon(delta)
        self._epsilons[(*key, delta)] = (events, epsilon)
        return epsilon

    def digest(self) -> str:
        """sha256 of the canonical JSON of the merged records (stable across reloads)."""
        return hashlib.sha256(_canonical(self._records).encode("utf-8")).hexdigest()
