"""Replay an agentic workload against a router (gRPC ``tandem.v1.Tandem``) and time every turn.

``concurrency`` threads (conversations or branches) are in flight at once; a thread's turns run
one after another, since each prompt holds the previous answer. Branches become ready when
their parent's fork turn has its answer and go ahead of conversations not yet started.
Decoding is greedy with ``ignore_eos``, so every answer has ``answer_tokens`` tokens and every
configuration replays the same prompts (the engine is lossless).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field

import grpc

from bench.agentic_floor import PromptCacheFloor
from bench.agentic_workload import Thread, ThreadState, Tokens, Workload
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc

REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class TurnRecord:
    """One request. Times are seconds; ``itl_s`` are the gaps between streamed chunks (one
    chunk per decode step, as the router's ``tandem_inter_token_latency_seconds``)."""

    thread: str
    turn: int
    kind: str  # "first" (a conversation's turn 0), "branch" (a branch's turn 0), "continuation"
    prompt_tokens: int = 0
    cached_per_group: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    floor_cached: int = 0  # what an unbounded prompt cache would reuse (bench.agentic_floor)
    acceptance_length: float = 0.0
    num_drafts: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    sent_pages: dict[str, int] = field(default_factory=dict)  # per group, by the KV transfer
    held_pages: dict[str, int] = field(default_factory=dict)  # not sent: decode held them
    transfer_bytes: int = 0
    error: str = ""

    @property
    def is_first(self) -> bool:
        return self.kind == "first"


@dataclass(slots=True)
class ReplayResult:
    records: list[TurnRecord]
    wall_s: float


def turn_kind(thread: Thread, turn: int) -> str:
    if turn > 0:
        return "continuation"
    return "branch" if thread.is_branch else "first"


def generate_request(request_id: str, prompt: Tokens, answer_tokens: int) -> cpb.GenerateRequest:
    """Greedy, exactly ``answer_tokens`` tokens. The id is set by the client, so a replay can
    also address an aggregated worker directly (which assigns none)."""
    return cpb.GenerateRequest(
        request_id=request_id,
        token_ids=cpb.TokenIds(ids=list(prompt)),
        sampling=cpb.SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True),
    )


async def run_turn(
    stub: cpb_grpc.TandemStub, record: TurnRecord, prompt: Tokens, answer_tokens: int, request_id: str
) -> Tokens:
    """Send one turn, fill ``record`` from the stream; returns the answer's tokens."""
    answer: list[int] = []
    start = last = time.monotonic()
    record.prompt_tokens = len(prompt)
    call = stub.Generate(generate_request(request_id, prompt, answer_tokens), timeout=REQUEST_TIMEOUT_S)
    async for message in call:
        kind = message.WhichOneof("payload")
        now = time.monotonic()
        if kind == "chunk":
            if answer:
                record.itl_s.append(now - last)
            else:
                record.ttft_s = now - start
            answer += message.chunk.token_ids
            last = now
        elif kind == "error":
            record.error = message.error.message
        else:
            _fill_usage(record, message.complete.usage)
    record.e2e_s = time.monotonic() - start
    record.completion_tokens = len(answer)
    return tuple(answer)


def _fill_usage(record: TurnRecord, usage: cpb.Usage) -> None:
    record.cached_per_group = {g.group: g.num_tokens for g in usage.cached_tokens_per_group}
    record.cached_per_group.setdefault("target", usage.cached_tokens)
    record.acceptance_length = usage.acceptance_length
    record.num_drafts = usage.num_drafts
    for t in usage.transfers:
        record.sent_pages[t.group] = t.num_pages
        record.held_pages[t.group] = t.num_held_pages
        record.transfer_bytes += t.num_bytes


class Replay:
    """The scheduling state of one replay: ready threads, thread states, records."""

    def __init__(
        self, workload: Workload, stub: cpb_grpc.TandemStub, concurrency: int, tokens_per_page: int
    ) -> None:
        self.workload, self.stub, self.concurrency = workload, stub, concurrency
        self.floor = PromptCacheFloor(tokens_per_page)
        self.ready: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self.order = itertools.count()
        self.states: dict[str, ThreadState] = {}
        self.records: list[TurnRecord] = []
        self.remaining = len(workload.threads)
        self.id_prefix = uuid.uuid4().hex[:8]  # request ids stay unique across replays

    async def run(self) -> list[TurnRecord]:
        for thread in self.workload.conversations():
            self._push(thread, thread.head, priority=1)
        await asyncio.gather(*(self._worker() for _ in range(self.concurrency)))
        return self.records

    def _push(self, thread: Thread, base: Tokens, priority: int) -> None:
        self.states[thread.name] = ThreadState(thread, base)
        self.ready.put_nowait((priority, next(self.order), thread.name))

    async def _worker(self) -> None:
        while True:
            _, _, name = await self.ready.get()
            if not name:
                return
            await self._run_thread(self.states[name])
            self._finish(1)

    def _finish(self, threads: int) -> None:
        """Count ``threads`` as done; after the last one, wake every worker to exit."""
        self.remaining -= threads
        if self.remaining == 0:
            for _ in range(self.concurrency):
                self.ready.put_nowait((2, next(self.order), ""))

    async def _run_thread(self, state: ThreadState) -> None:
        thread = state.thread
        for turn in range(thread.turns):
            record = TurnRecord(thread.name, turn, turn_kind(thread, turn))
            self.records.append(record)
            prompt = state.next_prompt()
            record.floor_cached = self.floor.best_hit(prompt)
            try:
                answer = await run_turn(
                    self.stub,
                    record,
                    prompt,
                    self.workload.config.answer_tokens,
                    f"agentic-{self.id_prefix}-{thread.name}-t{turn}",
                )
            except grpc.aio.AioRpcError as e:
                record.error = f"{e.code().name}: {e.details()}"
            if record.error:
                self._drop_descendants(thread.name)
                return
            self.floor.add(prompt)
            state.record(answer)
            for branch in self.workload.branches_of(thread.name, turn):
                self._push(branch, state.fork_base(turn), priority=0)

    def _drop_descendants(self, name: str) -> None:
        """A failed thread's branches never become ready: count them as done."""
        self._finish(sum(1 for t in self.workload.threads if t.parent == name and t.name not in self.states))


async def replay_async(
    address: str, workload: Workload, concurrency: int, tokens_per_page: int = 16
) -> ReplayResult:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = cpb_grpc.TandemStub(channel)
        start = time.monotonic()
        records = await Replay(workload, stub, concurrency, tokens_per_page).run()
        return ReplayResult(records, time.monotonic() - start)


def replay(address: str, workload: Workload, concurrency: int, tokens_per_page: int = 16) -> ReplayResult:
    """Replay ``workload`` against the router at ``address`` (host:port); ``tokens_per_page``
    sets the page granularity of the unbounded-cache floor."""
    return asyncio.run(replay_async(address, workload, concurrency, tokens_per_page))
