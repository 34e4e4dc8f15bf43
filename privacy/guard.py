"""Budget guard: refuse a release that would take any owner past its budget, before data is touched.

Mechanism flow (docs/ARCHITECTURE.md): ``guard.charge(owners, event, release_id)`` → add noise → release.
``check`` computes, for every owner, ε of (ledger events + the new event) with the accountant the ledger
would pick, and raises :class:`BudgetExceeded` without writing anything if one would exceed its budget.

For adaptively chosen events (``event.adaptive``, e.g. σ_t of the validation-driven DP-SGD schedule) the
ledger picks a filter-valid accountant (``privacy.accountants.accountant_for``), and this refusal *is* the
privacy filter's stopping rule (Rogers et al. 2016; Feldman & Zrnic 2021, Sec. 3): the run as a whole is
then (budget, δ)-DP even though its parameters were chosen from its own outputs.
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

from privacy.accountants import accountant_for, epsilon_spent, make_accountant
from privacy.errors import BudgetExceeded, PrivacyError
from privacy.events import Event, RepeatAndSelectEvent, SampledGaussianEvent
from privacy.ledger import Ledger
from privacy.validation import positive_number, probability


def _format_delta(delta: float) -> str:
    return f"{delta:.3g}"


class BudgetGuard:
    """Per-owner (ε, δ) budget over a :class:`Ledger`.

    ``budget`` is one ε for every owner or a dict owner → ε (the key ``"*"`` is the default for owners not
    listed; an owner with no budget at all is refused).
    """

    def __init__(self, ledger: Ledger, budget: float | Mapping[str, float], delta: float) -> None:
        if not isinstance(ledger, Ledger):
            raise PrivacyError(f"BudgetGuard needs a Ledger, got {type(ledger).__name__}")
        self.ledger = ledger
        if isinstance(budget, Mapping):
            self.budget = {str(k): self._check_budget(v, str(k)) for k, v in budget.items()}
        else:
            self.budget = {"*": self._check_budget(budget, "*")}
        self.delta = probability("delta", delta)
        self._plans: dict[str, tuple[Event, ...]] = {}   # owner -> a plan verified to fit (see expect)

    @staticmethod
    def _check_budget(value, owner: str) -> float:
        # an infinite budget is allowed: an owner whose releases are only recorded, never refused
        return positive_number(f"budget for owner {owner!r}", value, finite=False)

    def budget_of(self, owner: str) -> float:
        if owner in self.budget:
            return self.budget[owner]
        if "*" in self.budget:
            return self.budget["*"]
        raise PrivacyError(f"no privacy budget for owner {owner!r} (budget dict has {sorted(self.budget)})")

    def remaining(self, owner: str) -> float:
        """Budget minus what the ledger says ``owner`` has spent (may be 0, never negative)."""
        return max(0.0, self.budget_of(owner) - self.ledger.spent(owner, self.delta).epsilon)

    def expect(self, owners: Sequence[str], plan: Sequence[Event]) -> list[str]:
        """Verify a run's whole plan once, so that charging it event by event composes nothing.

        ``plan``: every event the run will charge, in order (a DP-SGD run calibrated to its budget: its epochs).
        For each owner whose ledger holds a prefix of the plan and nothing else (a fresh run, or one resumed), the
        plan is composed once with the accountant the ledger picks for it; if its ε fits the owner's budget, the
        plan is remembered, and :meth:`check` of an event that extends the ledger along the plan passes at once:
        any prefix of a composition is post-processing of the whole (drop the later outputs), so its true ε is at
        most the whole plan's, which the accountant bounds. The composed accountant is handed to the ledger
        (:meth:`privacy.ledger.Ledger.adopt`), so the ε it reports once the plan is spent is that composition's.

        An owner whose ledger holds anything else, or whose budget the plan exceeds, gets no plan: its checks
        compose as always (and refuse where the budget ends). Returns the owners whose plan was verified."""
        if isinstance(owners, str):
            raise PrivacyError(f"owners must be a list of owner names, got the string {owners!r}")
        plan = tuple(plan)
        if not plan or not all(isinstance(event, Event) for event in plan):
            raise PrivacyError("expect: the plan must be a non-empty sequence of privacy events")
        verified, composed = [], None
        for owner in owners:
            known = self._plans.get(owner)
            if known is not None and plan == known[:len(plan)]:   # already verified, as part of a longer plan
                verified.append(owner)
                continue
            held = tuple(self.ledger.events(owner))
            if held != plan[:len(held)]:
                continue
            if composed is None:
                accountant = make_accountant(accountant_for(list(plan)).name)
                accountant.compose_all(plan)
                composed = (accountant, float(accountant.get_epsilon(self.delta)))
            accountant, epsilon = composed
            if epsilon > self.budget_of(owner):
                continue
            self._plans[owner] = plan
            self.ledger.adopt(owner, plan, accountant, self.delta, epsilon)
            verified.append(owner)
        return verified

    def plan_of(self, owner: str) -> tuple[Event, ...] | None:
        """The verified plan ``owner``'s charges follow (:meth:`expect`), or None."""
        return self._plans.get(owner)

    def _follows_plan(self, owner: str, event: Event, count: int) -> bool:
        """True when ``owner``'s ledger plus ``count`` x ``event`` is still a prefix of its verified plan."""
        plan = self._plans.get(owner)
        if plan is None:
            return False
        after = tuple(self.ledger.events(owner)) + (event,) * int(count)
        return len(after) <= len(plan) and after == plan[:len(after)]

    def check(self, owners: Sequence[str], event: Event, count: int = 1) -> None:
        """Raise BudgetExceeded if adding ``count`` x ``event`` would take any owner past its budget; writes
        nothing. (A check alone decides nothing another writer cannot change: :meth:`charge` holds the lock.)
        An owner whose verified plan (:meth:`expect`) this event follows passes without a composition."""
        if isinstance(owners, str):
            raise PrivacyError(f"owners must be a list of owner names, got the string {owners!r}")
        if not isinstance(event, Event):
            raise PrivacyError(f"check expects a privacy event, got {event!r}")
        alone = None
        for owner in owners:
            if self._follows_plan(owner, event, count):
                continue
            budget = self.budget_of(owner)
            after = self.ledger.spent(owner, self.delta, extra=[event] * int(count))
            if after.epsilon > budget:
                before = self.ledger.spent(owner, self.delta)
                if alone is None:
                    alone = epsilon_spent([event] * int(count), self.delta)[0]
                digits = 2 if f"{after.epsilon:.2f}" != f"{budget:.2f}" else 6
                raise BudgetExceeded(
                    f"owner {owner!r} would spend ε={after.epsilon:.{digits}f} > budget {budget:.{digits}f} "
                    f"(already spent {before.epsilon:.{digits}f} over {before.releases} release(s), this release "
                    f"ε={alone:.2f} alone; δ={_format_delta(self.delta)}, {after.relation}, "
                    f"accountant {after.accountant}); nothing was recorded or released"
                )

    def charge(self, owners: Sequence[str], event: Event, release_id: str, note: dict | None = None) -> None:
        """``check`` then ``ledger.record`` (durable before returning). Call before adding noise/releasing.

        Re-charging an identical, already recorded ``release_id`` (a retry) is a no-op: callers must only
        repeat an id whose mechanism does not draw fresh noise again (see ``privacy.ledger``).
        """
        self.charge_all(owners, event, [release_id], note)

    def charge_all(self, owners: Sequence[str], event: Event, release_ids: Sequence[str],
                   note: dict | None = None) -> None:
        """Charge ``event`` once per release id, all or none: the batch is checked as a whole and recorded
        under one hold of the ledger's lock (a hospital's query batch: one release per public scan)."""
        with self.ledger.exclusive():
            self._charge_locked(owners, event, release_ids, note)

    def _charge_locked(self, owners, event, release_ids, note, check: bool = True) -> None:
        fresh = [r for r in release_ids if not self.ledger.has_release(r)]
        if fresh and check:
            self.check(owners, event, count=len(fresh))
        for release_id in release_ids:   # repeats validate they are identical and write nothing
            self.ledger.record(owners, event, release_id, note)


class GuardChain:
    """Several budgets over one release: a run's own budget and each data owner's lifetime budget.

    ``lifetime`` pairs a guard with the owners it accounts for (a hospital's own ledger knows only that
    hospital): ``GuardChain(run_guard, [(hospital_guard, ["h0"]), ...])``. ``check`` asks every guard
    (nothing is written if any refuses); ``charge`` then records in the lifetime ledgers first and the
    run's ledger last, each durably, so a crash in between leaves a lifetime ledger counting a release that
    never happened (safe), never the reverse. Same interface as :class:`BudgetGuard` (``ledger`` and
    ``delta`` are the run's), so DP-SGD and PATE take either.
    """

    def __init__(self, primary: BudgetGuard, lifetime: Sequence[tuple[BudgetGuard, Sequence[str]]] = ()) -> None:
        if not isinstance(primary, BudgetGuard):
            raise PrivacyError(f"GuardChain needs BudgetGuards, got {type(primary).__name__}")
        pairs = []
        for guard, owners in lifetime:
            if not isinstance(guard, BudgetGuard) or isinstance(owners, str) or not owners:
                raise PrivacyError("GuardChain: lifetime entries must be (BudgetGuard, [owner, ...]) pairs")
            pairs.append((guard, [str(o) for o in owners]))
        self.primary = primary
        self.lifetime = tuple(pairs)
        self.ledger = primary.ledger
        self.delta = primary.delta

    def _targets(self, owners: Sequence[str]) -> list[tuple[BudgetGuard, list[str]]]:
        wanted = set(owners)
        pairs = [(guard, [o for o in mine if o in wanted]) for guard, mine in self.lifetime]
        return [(guard, mine) for guard, mine in pairs if mine] + [(self.primary, list(owners))]

    def budget_of(self, owner: str) -> float:
        return self.primary.budget_of(owner)

    def expect(self, owners: Sequence[str], plan: Sequence[Event]) -> list[str]:
        """The run's own guard verifies the plan (:meth:`BudgetGuard.expect`); the lifetime ledgers, which hold
        other runs' releases too, still compose at every charge."""
        return self.primary.expect(owners, plan)

    def plan_of(self, owner: str) -> tuple[Event, ...] | None:
        return self.primary.plan_of(owner)

    def remaining(self, owner: str) -> float:
        return min(guard.remaining(owner) for guard, mine in self._targets([owner]))

    def check(self, owners: Sequence[str], event: Event) -> None:
        for guard, mine in self._targets(owners):
            guard.check(mine, event)

    def charge(self, owners: Sequence[str], event: Event, release_id: str, note: dict | None = None) -> None:
        self.charge_all(owners, event, [release_id], note)

    def charge_all(self, owners: Sequence[str], event: Event, release_ids: Sequence[str],
                   note: dict | None = None) -> None:
        """Every guard checks, then every ledger records, all under every ledger's lock.

        The locks are taken in one fixed order, by file identity (the lock file's folder's device and inode, and
        its name; ``Ledger.lock_identity``), not by path: two processes may name one file by different paths, and
        ordering by path would let them take
        the same two locks in opposite orders and deadlock. Two ledgers of the chain over one file (two paths,
        or two Ledger objects) take its lock once: the first takes it, the others only re-enter it to merge
        what is on disk (``Ledger.exclusive`` shares one file's lock within a process), so the chain cannot
        wait for itself."""
        targets = self._targets(owners)
        ledgers = {id(guard.ledger): guard.ledger for guard, _ in targets}
        # ("file", dev, inode) or ("memory", id): same-kind identities compare field by field
        order = sorted(((ledger.lock_identity(), ledger) for ledger in ledgers.values()), key=lambda pair: pair[0])
        with contextlib.ExitStack() as held:
            for _identity, ledger in order:
                held.enter_context(ledger.exclusive())
            for guard, mine in targets:
                fresh = [r for r in release_ids if not guard.ledger.has_release(r)]
                if fresh:
                    guard.check(mine, event, count=len(fresh))
            for guard, mine in targets:
                guard._charge_locked(mine, event, release_ids, note, check=False)


class CoveredGuard:
    """Stands in for a guard inside a mechanism that was charged as a whole, up front.

    Private selection (``privacy.events.RepeatAndSelectEvent``) repeats a base mechanism a random number of
    times; the whole event is charged once, *before* the first repetition (the guard refuses it, and nothing
    is trained or noised, when the budget would not allow it). The DP-SGD epochs of each repetition are part
    of that event and must not be charged again; this object takes their ``charge`` calls instead of the
    real guard. It writes nothing, but it refuses (PrivacyError) a step the charged event does not cover:

    * before the cover is recorded in the ledger (the up-front charge must come first);
    * for owners the cover was not charged to;
    * for an event that is not one of the covered Poisson-sampled Gaussians (same q, z and relation), or
      that would take the current repetition past the covered steps.

    Call :meth:`next_repetition` before each repetition (each repetition may use the covered steps once).
    Same ``ledger`` / ``delta`` / ``charge`` interface as :class:`BudgetGuard` (the ledger is the real one:
    what a session reports as spent is the whole selection event).
    """

    def __init__(self, guard, cover_release_id: str, cover: Event, owners: Sequence[str]) -> None:
        if not isinstance(cover, RepeatAndSelectEvent):
            raise PrivacyError(f"CoveredGuard covers a RepeatAndSelectEvent, got {type(cover).__name__}")
        self.guard = guard
        self.ledger = guard.ledger
        self.delta = guard.delta
        self.cover_release_id = str(cover_release_id)
        self.cover = cover
        self.owners = tuple(owners)
        self._budget = {}
        for leaf in cover.inner.leaves():
            if isinstance(leaf, SampledGaussianEvent):
                key = (leaf.sampling_rate, leaf.noise_multiplier, leaf.relation)
                self._budget[key] = self._budget.get(key, 0) + leaf.steps
        self._used: dict = {}
        self.repetitions = 0

    def next_repetition(self) -> None:
        self._used = {}
        self.repetitions += 1

    def budget_of(self, owner: str) -> float:
        return self.guard.budget_of(owner)

    def remaining(self, owner: str) -> float:
        return self.guard.remaining(owner)

    def check(self, owners: Sequence[str], event: Event, count: int = 1) -> None:
        if not self.ledger.has_release(self.cover_release_id):
            raise PrivacyError(f"CoveredGuard: the covering release {self.cover_release_id!r} was not charged first")
        missing = set(owners) - set(self.owners)
        if missing:
            raise PrivacyError(f"CoveredGuard: owners {sorted(missing)} are not covered by {self.cover_release_id!r}")
        if self.repetitions == 0:
            raise PrivacyError("CoveredGuard: next_repetition() must open a repetition before its steps")
        for key, steps in self._steps(event, count).items():
            if key not in self._budget:
                raise PrivacyError(f"CoveredGuard: steps at q={key[0]:.6g}, z={key[1]:.6g} ({key[2]}) are not covered by "
                                   f"{self.cover_release_id!r}")
            if self._used.get(key, 0) + steps > self._budget.get(key, 0):
                raise PrivacyError(
                    f"CoveredGuard: {steps} step(s) at q={key[0]:.6g}, z={key[1]:.6g} ({key[2]}) are beyond what "
                    f"{self.cover_release_id!r} covers in one repetition ({self._budget.get(key, 0)} step(s), "
                    f"{self._used.get(key, 0)} used)")

    def charge(self, owners: Sequence[str], event: Event, release_id: str, note: dict | None = None) -> None:
        self.charge_all(owners, event, [release_id], note)

    def charge_all(self, owners: Sequence[str], event: Event, release_ids: Sequence[str],
                   note: dict | None = None) -> None:
        """Check that the steps are covered, count them against this repetition, record nothing."""
        self.check(owners, event, count=len(release_ids))
        for key, steps in self._steps(event, len(release_ids)).items():
            self._used[key] = self._used.get(key, 0) + steps

    @staticmethod
    def _steps(event: Event, count: int) -> dict:
        """(q, z, relation) -> the Poisson-sampled Gaussian steps ``count`` copies of ``event`` take; refuses
        any other kind of leaf (only such steps are covered)."""
        wanted: dict = {}
        for leaf in event.leaves():
            if not isinstance(leaf, SampledGaussianEvent) or leaf.adaptive:
                raise PrivacyError(f"CoveredGuard: {type(leaf).__name__} is not covered by the selection event")
            key = (leaf.sampling_rate, leaf.noise_multiplier, leaf.relation)
            wanted[key] = wanted.get(key, 0) + leaf.steps * int(count)
        return wanted
