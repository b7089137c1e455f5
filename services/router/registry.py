"""The router's view of the cluster: registered workers, prefill/decode pairs, and choice.

Invariants: a request goes only to a pair in state READY (both sides accepted each other's
RankInfo and the test transfer between them succeeded) whose workers are healthy; a
refused pair keeps its mismatches for Health/ModelInfo and gets no traffic. A READY pair
whose transfer failed is DEGRADED, with the failure as its reason: it gets no traffic until
a new pairing test passes (``HealthMonitor`` re-runs it) and makes it READY again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from proto.tandem.v1 import rank_info_pb2 as rpb
from services.router.prefix_index import PrefixIndex, page_hashes


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
    missed: int = 0  # consecutive Stats polls without an answer
    identity: str = ""  # the credential it registered with (services/common/access.py); "" = none

    @property
    def id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> int:
        return self.info.role


@dataclass(slots=True)
class Pair:
    state: PairState = PairState.PENDING
    reason: str = ""  # mismatches or the failure, for humans


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

    def set_pair(self, prefill_id: str, decode_id: str, state: PairState, reason: str = "") -> None:
        if (prefill_id, decode_id) in self.pairs:
            self.pairs[(prefill_id, decode_id)] = Pair(state, reason)

    def degrade(self, prefill_id: str, decode_id: str, reason: str) -> bool:
        """Mark a READY pair DEGRADED for ``reason``; True if it was READY."""
        pair = self.pairs.get((prefill_id, decode_id))
        if pair is None or pair.state != PairState.READY:
            return False
        self.pairs[(prefill_id, decode_id)] = Pair(PairState.DEGRADED, reason)
        return True

    def degraded_pairs(self) -> list[tuple[str, str]]:
        return [k for k, p in self.pairs.items() if p.state == PairState.DEGRADED]

    def ready_pairs(self) -> list[tuple[str, str]]:
        return [
            k
            for k, p in self.pairs.items()
            if p.state == PairState.READY and self.workers[k[0]].healthy and self.workers[k[1]].healthy
        ]

    def is_serving(self) -> bool:
        return bool(self.ready_pairs()) or bool(self._aggregated())

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
        return [w for w in self.workers.values() if w.role == rpb.ROLE_BOTH and w.healthy]
