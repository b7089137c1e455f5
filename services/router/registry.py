"""The router's view of the cluster: registered workers, prefill/decode pairs, and choice.

Invariants: a request goes only to a pair in state READY (both sides accepted each other's
RankInfo and the test transfer between them succeeded) whose workers are healthy; a
refused pair keeps its mismatches for Health/ModelInfo and gets no traffic. A READY pair
whose transfer failed is DEGRADED, with the failure as its reason: it gets no traffic until
a new pairing test passes (``HealthMonitor`` re-runs it) and makes it READY again. A pair
whose pairing failed for a transient reason (an RPC, the test transfer) is FAILED and
re-tried alike; only a RankInfo mismatch (REFUSED) waits for a worker to register again.

Failures in a row: every failed transfer and pairing attempt since the pair last moved a
request's pages counts; the next re-pairing waits ``retry_delay(failures)``, so a pair
whose tests pass but whose real transfers fail spends its time DEGRADED, not READY. Each
change of state is logged once, at WARNING when it is a failure or a recovery.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.router.prefix_index import PrefixIndex, page_hashes

RETRY_BASE_S = 0.5  # the first re-pairing's delay after a failure
RETRY_MAX_S = 4.0  # the longest: a pair is tried again this soon after its fault ends
log = logging.getLogger(__name__)


def retry_delay(failures: int) -> float:
    """Seconds before the next re-pairing of a pair with ``failures`` failures in a row."""
    return min(RETRY_BASE_S * 2 ** max(failures - 1, 0), RETRY_MAX_S)


class PairState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    REFUSED = "refused"  # RankInfo mismatch
    FAILED = "failed"  # the test transfer or an RPC failed
    DEGRADED = "degraded"  # was READY; a transfer failed; re-tested until it passes again


@dataclass(slots=True)
class Worker:
    info: rpb.RankInfo
    inflight: int = 0  # requests the router has in flight there
    free_pages: int = 0  # target-group pages free or only cached, at the last Stats poll
    busy_pages: int = 0  # target-group pages requests hold: the last poll's, plus reservations since
    healthy: bool = True
    draining: bool = False  # shutting down (Deregister draining): no new requests, its own finish
    missed: int = 0  # consecutive Stats polls without an answer
    identity: str = ""  # the credential it registered with (services/common/access.py); "" = none

    @property
    def id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> int:
        return self.info.role

    @property
    def serves(self) -> bool:
        """Whether it may get new requests: healthy and not draining."""
        return self.healthy and not self.draining


RETRIED = (PairState.DEGRADED, PairState.FAILED)  # re-paired in the background until READY


@dataclass(slots=True)
class Pair:
    state: PairState = PairState.PENDING
    reason: str = ""  # mismatches or the failure, for humans
    failures: int = 0  # failed transfers and pairing attempts since it last moved a request's pages
    since: float = 0.0  # monotonic seconds: when it entered this state
    retry_at: float = 0.0  # monotonic seconds: the earliest next re-pairing (RETRIED states)

    def describe(self) -> str:
        """The state's reason as Health and PairStatus show it."""
        if self.state not in RETRIED:
            return self.reason
        every = retry_delay(self.failures)
        return f"{self.reason} (failures in a row: {self.failures}; re-pairing every {every} s)"


@dataclass(slots=True)
class Registry:
    tokens_per_page: int = 16
    workers: dict[str, Worker] = field(default_factory=dict)
    pairs: dict[tuple[str, str], Pair] = field(default_factory=dict)  # (prefill id, decode id)
    index: PrefixIndex | None = None

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.tokens_per_page)

    def add(self, info: rpb.RankInfo, identity: str = "") -> list[tuple[str, str]]:
        """Register (or re-register) a worker; returns the pairs it must now be tested in."""
        self.remove(info.instance_id)
        self.workers[info.instance_id] = Worker(info, identity=identity)
        if info.role == rpb.ROLE_PREFILL:
            new = [(info.instance_id, d) for d in self.ids(rpb.ROLE_DECODE)]
        elif info.role == rpb.ROLE_DECODE:
            new = [(p, info.instance_id) for p in self.ids(rpb.ROLE_PREFILL)]
        else:
            new = []
        for key in new:
            self.pairs[key] = Pair()
        return new

    def remove(self, instance_id: str) -> bool:
        found = self.workers.pop(instance_id, None) is not None
        self.pairs = {k: v for k, v in self.pairs.items() if instance_id not in k}
        self.index.forget(instance_id)
        return found

    def ids(self, role: int) -> list[str]:
        return [w.id for w in self.workers.values() if w.role == role]

    def live_ids(self, role: int) -> list[str]:
        """The workers of ``role`` the health check has not lost."""
        return [w.id for w in self.workers.values() if w.role == role and w.serves]

    def set_pair(self, prefill_id: str, decode_id: str, state: PairState, reason: str = "") -> None:
        """A pairing attempt's outcome: READY, or a failure counted towards the next
        attempt's delay (a DEGRADED pair whose re-pairing failed stays DEGRADED)."""
        key = (prefill_id, decode_id)
        old = self.pairs.get(key)
        if old is None:
            return
        if state == PairState.FAILED and old.state == PairState.DEGRADED:
            state = PairState.DEGRADED
        failures = old.failures + (state != PairState.READY)
        self._move(
            key, old, Pair(state, reason, failures, old.since, time.monotonic() + retry_delay(failures))
        )

    def degrade(self, prefill_id: str, decode_id: str, reason: str) -> bool:
        """Mark a READY pair DEGRADED for ``reason`` (a request's transfer failed on it);
        True if it was READY."""
        key = (prefill_id, decode_id)
        old = self.pairs.get(key)
        if old is None or old.state != PairState.READY:
            return False
        failures = old.failures + 1
        self._move(
            key,
            old,
            Pair(PairState.DEGRADED, reason, failures, 0.0, time.monotonic() + retry_delay(failures)),
        )
        return True

    def transfer_ok(self, prefill_id: str, decode_id: str) -> None:
        """A request's pages moved over the pair: its failures in a row are over."""
        pair = self.pairs.get((prefill_id, decode_id))
        if pair is not None and pair.state == PairState.READY:
            pair.failures = 0

    def retried_pairs(self) -> list[tuple[str, str]]:
        """The DEGRADED and FAILED pairs, re-paired in the background until READY."""
        return [k for k, p in self.pairs.items() if p.state in RETRIED]

    def due_pairs(self, now: float) -> list[tuple[str, str]]:
        """The retried pairs whose next re-pairing is due at ``now`` (monotonic seconds)."""
        return [k for k in self.retried_pairs() if self.pairs[k].retry_at <= now]

    def _move(self, key: tuple[str, str], old: Pair, new: Pair) -> None:
        """Replace ``old`` with ``new`` (its ``since`` now if the state changed); logged once."""
        if new.state != old.state:
            new.since = time.monotonic()
        self.pairs[key] = new
        name = f"{key[0]}->{key[1]}"
        if new.state == PairState.READY and old.state in RETRIED:
            log.warning("pair %s is ready again (was %s: %s)", name, old.state.value, old.reason)
        elif new.state == PairState.READY:
            log.info("pair %s is ready", name)
        elif new.state != old.state or new.reason != old.reason:
            log.warning("pair %s is %s: %s", name, new.state.value, new.describe())

    def ready_pairs(self) -> list[tuple[str, str]]:
        return [
            k
            for k, p in self.pairs.items()
            if p.state == PairState.READY and self.workers[k[0]].serves and self.workers[k[1]].serves
        ]

    def is_serving(self) -> bool:
        return self.num_serving() > 0

    def num_serving(self) -> int:
        """READY pairs of healthy workers, plus healthy aggregated workers (one each)."""
        return len(self.ready_pairs()) + len(self._aggregated())

    # ------------------------------------------------------------------ choice

    def choose_pair(
        self, token_ids: list[int], exclude: set[str] = frozenset()
    ) -> tuple[Worker, Worker] | None:
        """Decode by least cost among those with room for the prompt (all, when none has):
        cost = pages the transfer must move (the prompt's, less the prefix the decode worker
        is believed to hold) + pages its requests hold; ties to most free pages, then least
        load. Then, among prefill workers ready with it, prefill by longest cached prefix,
        then least load."""
        pairs = [(p, d) for p, d in self.ready_pairs() if p not in exclude and d not in exclude]
        if not pairs:
            return None
        hashes = page_hashes(token_ids, self.tokens_per_page)
        decodes = [self.workers[d] for d in dict.fromkeys(d for _, d in pairs)]
        need = {w.id: self._pages_to_move(w.id, token_ids, hashes) for w in decodes}
        roomy = [w for w in decodes if w.free_pages >= need[w.id]] or decodes
        decode = min(roomy, key=lambda w: (need[w.id] + w.busy_pages, -w.free_pages, w.inflight))
        prefills = [self.workers[p] for p, d in pairs if d == decode.id]
        prefill = max(prefills, key=lambda w: (self.index.held_tokens(w.id, hashes), -w.inflight))
        return prefill, decode

    def choose_aggregated(self, token_ids: list[int], exclude: set[str] = frozenset()) -> Worker | None:
        workers = [w for w in self._aggregated() if w.id not in exclude]
        if not workers:
            return None
        return max(workers, key=lambda w: (self.index.cached_tokens(w.id, token_ids), -w.inflight))

    def _pages_to_move(self, worker_id: str, token_ids: list[int], hashes: list[int]) -> int:
        page = self.tokens_per_page
        held = min(
            self.index.held_tokens(worker_id, hashes), (len(token_ids) - 1) // page * page
        )  # the last token's page moves
        return -(-(len(token_ids) - held) // page)

    def _aggregated(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == rpb.ROLE_BOTH and w.serves]
