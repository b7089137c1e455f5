"""``n`` > 1 through a 1P+1D cluster of the bundled pair and the openai SDK: seeded choices
are the single requests of seeds seed, seed + 1, ...; choices after the first reuse the
prompt's pages from the prefill worker's prefix cache; a stream's choices join to the
whole answer's."""

from __future__ import annotations

import urllib.request

import pytest

from tests.e2e.conftest import metric_sample, start_cluster
from tests.services.engine.test_lossless import TINY

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (TINY / "tiny-drafter" / "model.safetensors").is_file(),
        reason="the bundled tiny pair is not present",
    ),
]


@pytest.fixture(scope="module")
def served():
    pair = (TINY / "tiny-target", TINY / "tiny-drafter")
    cluster = start_cluster(
        pair, ["prefill", "decode"], worker_extra=("--max-model-len", "1024", "--kv-cache-mb", "64")
    )
    try:
        with openai.OpenAI(
            base_url=cluster.http_address + "/v1", api_key="unused", max_retries=0, timeout=60
        ) as client:
            yield cluster, client, client.models.list().data[0].id
    finally:
        cluster.stop()


def test_seeded_choices_are_the_single_requests_of_the_next_seeds(served):
    _, client, model = served
    args = dict(model=model, prompt="def parse(line):\n", max_tokens=24, temperature=1.0)
    many = client.completions.create(**args, n=3, seed=7)
    singles = [client.completions.create(**args, seed=7 + i).choices[0].text for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1
    assert many.usage.completion_tokens == 3 * 24


def test_later_choices_reuse_the_prompt_from_the_prefix_cache(served):
    cluster, client, model = served
    prefill = next(p for p in cluster.processes if p.name.startswith("prefill"))

    def hits() -> float:
        text = urllib.request.urlopen(prefill.metrics, timeout=5).read().decode()
        return metric_sample(text, "tandem_prefix_cache_hits_total", group="target")

    before = hits()
    prompt = "class Registry:\n    def __init__(self, names):\n        self.names = list(names)\n" * 2
    client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, n=3)
    assert hits() - before >= 2 * 64  # choices 1 and 2: most of the prompt's pages each


def test_a_stream_of_choices_joins_to_the_whole_answer(served):
    _, client, model = served
    messages = [{"role": "user", "content": "a loop"}]
    args = dict(model=model, messages=messages, max_tokens=16, temperature=0, n=2)
    whole = client.chat.completions.create(**args)
    joined = ["", ""]
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            joined[c.index] += c.delta.content or ""
    assert joined == [c.message.content for c in whole.choices]
    assert joined[0] == joined[1]  # greedy choices are one answer
