"""Structured outputs through running clusters and the openai SDK, with the bundled pair and
its drafter: ``response_format`` json_schema gives the same greedy text aggregated and
disaggregated (1P+1D), the text parses as JSON and matches the schema, vLLM's
``guided_choice`` holds, and an invalid schema is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.conftest import start_cluster
from tests.services.engine.test_lossless import TINY
from tests.services.engine.test_structured_outputs import SCHEMAS

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (TINY / "tiny-drafter" / "model.safetensors").is_file(),
        reason="the bundled tiny pair is not present",
    ),
]

PAIR = (TINY / "tiny-target", TINY / "tiny-drafter")
SCHEMA = SCHEMAS[1]
FORMAT = {"type": "json_schema", "json_schema": {"name": "imports", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "import json\nconfig = "}]


def answers(roles) -> dict[str, object]:
    """What one cluster of ``roles`` answers to each request of the test."""
    cluster = start_cluster(PAIR, roles, worker_extra=("--max-model-len", "1024", "--kv-cache-mb", "64"))
    try:
        with openai.OpenAI(
            base_url=cluster.http_address + "/v1", api_key="unused", max_retries=0, timeout=60
        ) as client:
            model = client.models.list().data[0].id
            common = dict(model=model, messages=MESSAGES, max_tokens=300, temperature=0)
            chat = client.chat.completions.create(**common, response_format=FORMAT)
            choice = client.completions.create(
                model=model,
                prompt="import ",
                max_tokens=16,
                temperature=0,
                extra_body={"guided_choice": ["os", "sys", "json"]},
            )
            with pytest.raises(openai.BadRequestError) as bad:
                client.chat.completions.create(
                    **common,
                    response_format={**FORMAT, "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                )
            return {
                "chat": (chat.choices[0].message.content, chat.choices[0].finish_reason),
                "al": chat.usage.model_extra["tandem"]["acceptance_length"],
                "choice": choice.choices[0].text,
                "bad": (bad.value.status_code, bad.value.body["param"]),
            }
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def aggregated():
    return answers(["both"])


@pytest.fixture(scope="module")
def disaggregated():
    return answers(["prefill", "decode"])


def test_json_schema_text_is_the_same_aggregated_and_disaggregated_and_valid(aggregated, disaggregated):
    text, reason = aggregated["chat"]
    assert disaggregated["chat"] == (text, reason) and reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert min(aggregated["al"], disaggregated["al"]) > 1.5  # the drafter still pays


def test_guided_choice_holds_both_ways(aggregated, disaggregated):
    assert aggregated["choice"] == disaggregated["choice"] and aggregated["choice"] in ("os", "sys", "json")


def test_an_invalid_schema_is_a_400_naming_the_field(aggregated, disaggregated):
    assert aggregated["bad"] == disaggregated["bad"] == (400, "response_format")
