"""A deterministic agentic multi-turn workload: conversations and subagent branches.

Every conversation starts from one of a few shared preambles (a "system + tools" text every
conversation of that preamble repeats), then runs 4-8 turns. Turn t's prompt is turn t-1's
prompt, plus the answer the server gave to it, plus a new segment (a user message or a tool
result). Some conversations spawn subagent branches: after turn f, several branches fork from
the conversation's prompt + answer of turn f, each adding its own task and running a few turns
of its own. Answers come from the server, so the turns of one thread run one after another.

Units: tokens of the byte-level tokenizer (one byte = one token; BOS opens each preamble).
Text is held-out standard-library source (``models.data.split_files``), so the workload is the
same for a given seed and Python installation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache

from models.byte_tokenizer import BOS_ID
from models.data import split_files

Tokens = tuple[int, ...]
ROLE_HEADERS = {
    "system": b"# system: you are a coding agent; tools follow.\n",
    "user": b"\n# user:\n",
    "tool": b"\n# tool result:\n",
    "task": b"\n# subagent task:\n",
}


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Sizes are in tokens; ``(lo, hi)`` pairs are inclusive ranges drawn per segment.

    Invariant checked by ``validate``: a thread of ``min_turns`` turns of the largest segments
    fits ``max_context`` with its answers, so every conversation keeps at least ``min_turns``.
    """

    seed: int = 0
    conversations: int = 8
    min_turns: int = 4
    max_turns: int = 8
    answer_tokens: int = 64
    preambles: int = 2
    preamble_tokens: int = 1024
    first_tokens: tuple[int, int] = (128, 384)
    turn_tokens: tuple[int, int] = (64, 256)
    branch_probability: float = 0.5
    branches: tuple[int, int] = (2, 3)  # subagents per fork
    branch_turns: int = 2
    branch_task_tokens: tuple[int, int] = (64, 192)
    max_context: int = 4096  # prompt + answer, the model's context

    def validate(self) -> None:
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError(f"min_turns/max_turns: need 1 <= {self.min_turns} <= {self.max_turns}")
        if self.conversations < 1 or self.preambles < 1 or self.answer_tokens < 1:
            raise ValueError("conversations, preambles and answer_tokens must be >= 1")
        worst = (
            self.preamble_tokens
            + self.first_tokens[1]
            + (self.min_turns - 1) * self.turn_tokens[1]
            + self.min_turns * self.answer_tokens
        )
        if worst > self.max_context:
            raise ValueError(
                f"max_context: {self.min_turns} turns may need {worst} tokens "
                f"> {self.max_context}; shrink the segments or the turns"
            )


@dataclass(frozen=True, slots=True)
class Thread:
    """A conversation (``parent`` is "") or a subagent branch of one.

    ``head``: the tokens before the first segment; a conversation's preamble, empty for a
    branch (whose head is its parent's prompt + answer at ``fork_turn``, known only at replay).
    ``segments[t]``: what turn t appends after the previous turn's prompt and answer.
    """

    name: str
    head: Tokens
    segments: tuple[Tokens, ...]
    parent: str = ""
    fork_turn: int = -1

    @property
    def is_branch(self) -> bool:
        return bool(self.parent)

    @property
    def turns(self) -> int:
        return len(self.segments)


@dataclass(frozen=True, slots=True)
class Workload:
    config: WorkloadConfig
    threads: tuple[Thread, ...]  # conversations first, in order, then their branches

    def conversations(self) -> list[Thread]:
        return [t for t in self.threads if not t.is_branch]

    def branches_of(self, name: str, after_turn: int) -> list[Thread]:
        """The branches that fork from ``name`` once its turn ``after_turn`` has an answer."""
        return [t for t in self.threads if t.parent == name and t.fork_turn == after_turn]

    def num_requests(self) -> int:
        return sum(t.turns for t in self.threads)


@dataclass(slots=True)
class ThreadState:
    """Builds a thread's prompts as its answers arrive: prompt(t) = prompt(t-1) + answer(t-1)
    + segment(t), and prompt(0) = base + segment(0)."""

    thread: Thread
    base: Tokens
    prompts: list[Tokens] = field(default_factory=list)
    answers: list[Tokens] = field(default_factory=list)

    def next_prompt(self) -> Tokens:
        turn = len(self.answers)
        previous = self.prompts[-1] + self.answers[-1] if turn else self.base
        prompt = previous + self.thread.segments[turn]
        self.prompts.append(prompt)
        return prompt

    def record(self, answer: Tokens) -> None:
        if len(self.answers) + 1 != len(self.prompts):
            raise RuntimeError(f"{self.thread.name}: an answer without a prompt")
        self.answers.append(tuple(answer))

    def fork_base(self, turn: int) -> Tokens:
        """The prefix a branch forking after ``turn`` starts from."""
        return self.prompts[turn] + self.answers[turn]

    @property
    def done(self) -> bool:
        return len(self.answers) == self.thread.turns


@lru_cache(maxsize=1)
def corpus() -> bytes:
    """Held-out standard-library source, concatenated in path order."""
    _, held = split_files()
    return b"\n".join(p.read_bytes() for p in sorted(held))


def text_segment(rng: random.Random, role: str, size: int) -> Tokens:
    """``size`` tokens: a role header, then source text from a random offset."""
    header = ROLE_HEADERS[role]
    body_size = max(0, size - len(header))
    text = corpus()
    start = rng.randrange(0, len(text) - body_size)
    return tuple((header + text[start : start + body_size])[:size])


def generate(config: WorkloadConfig) -> Workload:
    """The workload of ``config``; the same config gives the same workload."""
    config.validate()
    rng = random.Random(config.seed)
    preambles = [
        (BOS_ID, *text_segment(rng, "system", config.preamble_tokens - 1)) for _ in range(config.preambles)
    ]
    conversations, branches = [], []
    for i in range(config.conversations):
        conversation = _conversation(rng, config, f"c{i}", preambles[i % config.preambles])
        conversations.append(conversation)
        branches += _branches(rng, config, conversation)
    return Workload(config, tuple(conversations + branches))


def _conversation(rng: random.Random, config: WorkloadConfig, name: str, head: Tokens) -> Thread:
    turns = rng.randint(config.min_turns, config.max_turns)
    segments = [text_segment(rng, "user", rng.randint(*config.first_tokens))]
    segments += [
        text_segment(rng, rng.choice(("tool", "user")), rng.randint(*config.turn_tokens))
        for _ in range(turns - 1)
    ]
    return Thread(name, head, tuple(_fit(segments, len(head), config)))


def _branches(rng: random.Random, config: WorkloadConfig, parent: Thread) -> list[Thread]:
    """Subagents forking together after one turn of ``parent`` (none for a 1-turn parent)."""
    if parent.turns < 2 or rng.random() >= config.branch_probability:
        return []
    fork = rng.randrange(0, parent.turns - 1)
    base = _prompt_length(parent.head, parent.segments[: fork + 1], config) + config.answer_tokens
    out = []
    for j in range(rng.randint(*config.branches)):
        segments = [text_segment(rng, "task", rng.randint(*config.branch_task_tokens))]
        segments += [
            text_segment(rng, "tool", rng.randint(*config.turn_tokens))
            for _ in range(config.branch_turns - 1)
        ]
        fitted = _fit(segments, base, config, minimum=1)
        if fitted:
            out.append(Thread(f"{parent.name}.b{j}", (), tuple(fitted), parent.name, fork))
    return out


def _prompt_length(head: Tokens, segments: tuple[Tokens, ...] | list[Tokens], config: WorkloadConfig) -> int:
    """Length of the prompt of the turn that appends the last of ``segments``."""
    return len(head) + sum(map(len, segments)) + (len(segments) - 1) * config.answer_tokens


def _fit(
    segments: list[Tokens], base: int, config: WorkloadConfig, minimum: int | None = None
) -> list[Tokens]:
    """The longest leading run of ``segments`` whose every turn fits the context."""
    minimum = config.min_turns if minimum is None else minimum
    kept: list[Tokens] = []
    for segment in segments:
        length = base + sum(map(len, kept + [segment])) + len(kept) * config.answer_tokens
        if length + config.answer_tokens > config.max_context:
            break
        kept.append(segment)
    return kept if len(kept) >= minimum else kept[:0]
