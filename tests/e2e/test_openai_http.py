"""The router's OpenAI-compatible HTTP API, driven by the official ``openai`` client
against a running local cluster (router, one prefill and one decode worker)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from models.byte_tokenizer import byte_ids
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from tests.e2e.conftest import assert_no_request_holds_pages, metric_sample, start_cluster

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "A loop, please."},
]


@pytest.fixture(scope="module")
def cluster(byte_pair):
    cluster = start_cluster(byte_pair, ["prefill", "decode"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(
        base_url=cluster.http_address + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _grpc_text(address: str, prompt: str, max_tokens: int, stop: tuple[str, ...] = ()) -> str:
    """The same greedy request through the gRPC client API."""
    request = cpb.GenerateRequest(
        text=prompt,
        sampling=cpb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=stop),
    )
    with grpc.insecure_channel(address) as channel:
        return "".join(
            m.chunk.text
            for m in cpb_grpc.TandemStub(channel).Generate(request, timeout=60)
            if m.WhichOneof("payload") == "chunk"
        )


def test_models_lists_the_served_target(client, cluster):
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [("target", "model", "tandem")]
    assert models[0].model_extra["tandem"]["num_spec_tokens"] == 3


def test_a_completion_equals_the_grpc_answer_and_reports_usage(client, cluster, model):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, **GREEDY)
    choice = completion.choices[0]
    assert choice.text == _grpc_text(cluster.router_address, PROMPT, 10)
    assert choice.finish_reason == "length" and completion.object == "text_completion"
    prompt_tokens = len(byte_ids(PROMPT))
    assert (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
        completion.usage.total_tokens,
    ) == (prompt_tokens, 10, prompt_tokens + 10)
    tandem = completion.usage.model_extra["tandem"]
    assert tandem["transfer_bytes"]["target"] > 0 and tandem["transfer_bytes"]["draft"] > 0
    assert tandem["acceptance_length"] >= 1


def test_special_token_text_a_client_types_is_counted_as_plain_text(client, model):
    """``<eos>``, ``<bos>``, ``<pad>`` typed in a prompt or a chat message are the bytes they
    are (until 2026-12-04 they became the model's control tokens: 24 prompt tokens for
    text of 28 bytes)."""
    typed, plain = "a<eos>b<bos>c<pad>d", "a<xyz>b<xyz>c<xyz>d"
    counts = [
        client.completions.create(model=model, prompt=p, max_tokens=1, **GREEDY).usage.prompt_tokens
        for p in (typed, plain)
    ]
    assert counts == [len(byte_ids(plain))] * 2
    chats = [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=1, **GREEDY
        ).usage.prompt_tokens
        for p in (typed, plain)
    ]
    assert chats[0] == chats[1]


def test_a_streamed_completion_joins_to_the_same_text(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, **GREEDY)
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_a_token_id_prompt_is_served(client, model):
    ids = byte_ids(PROMPT)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, **GREEDY)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_renders_the_models_template_and_answers_as_the_assistant(client, model):
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **GREEDY)
    rendered = byte_ids("".join(f"{m['role']}: {m['content']}\n" for m in MESSAGES) + "assistant: ")
    same = client.completions.create(model=model, prompt=rendered, max_tokens=8, **GREEDY)
    message = chat.choices[0].message
    assert (message.role, message.content) == ("assistant", same.choices[0].text)
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len(rendered)
    assert chat.usage.completion_tokens == 8


def test_a_streamed_chat_joins_to_the_same_reply(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **GREEDY)
    chunks = list(
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_text_stops_before_the_first_stop_string(client, model, cluster):
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, **GREEDY)
    text = free.choices[0].text
    stop = next(ch for ch in text[len(text) // 2 :] if ch.isascii())  # not U+FFFD: a partial
    expected = text[: text.index(stop)]  # character decodes to it before it is complete
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY)
    streamed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, stop=stop, stream=True, **GREEDY
    )
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (expected, "stop")
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert _grpc_text(cluster.router_address, PROMPT, 12, (stop,)) == expected  # gRPC too


def test_a_seeded_sample_repeats(client, model):
    texts = {
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=8,
            temperature=1.0,
            seed=11,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_logprobs_with_and_without_speculation_agree_and_top_k_one_is_greedy(client, model):
    """Float32 noise between a verify block and single-token decode on the bundled pair is
    about 2e-5 (the engine tests pin 1e-5 on a calmer model), hence 1e-4 here."""
    runs = [
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            logprobs=2,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        for extra in ({}, {"num_spec_tokens": 0})
    ]
    spec, plain = (r.choices[0] for r in runs)
    assert spec.text == plain.text and "".join(spec.logprobs.tokens) == spec.text
    assert len(spec.logprobs.token_logprobs) == 12
    assert runs[1].usage.model_extra["tandem"]["acceptance_length"] == 1.0
    for a, b in zip(spec.logprobs.token_logprobs, plain.logprobs.token_logprobs, strict=True):
        assert abs(a - b) < 1e-4
    for token, lp, top in zip(
        spec.logprobs.tokens, spec.logprobs.token_logprobs, spec.logprobs.top_logprobs, strict=True
    ):
        assert top[token] == lp and all(v <= 0 for v in top.values())
    top1 = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=1, extra_body={"ignore_eos": True, "top_k": 1}
    )
    assert top1.choices[0].text == plain.text
    stop = plain.text[1]  # inside the first 4 tokens' text (byte-level: a token per char)
    late = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "min_tokens": 4},
    )
    cut = plain.text.find(stop, 4)
    assert late.choices[0].text == (plain.text[:cut] if cut >= 0 else plain.text)
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def _token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_a_stop_token_id_ends_the_answer_and_frees_the_workers_request(cluster, client, model):
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    free = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, logprobs=0, temperature=0, extra_body=as_ids
    ).choices[0]
    ids = _token_ids(free)
    cut = ids.index(ids[5])  # the stop token's first place
    stopped = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=64,
        logprobs=0,
        temperature=0,
        extra_body={**as_ids, "stop_token_ids": [ids[5]]},
    )
    choice = stopped.choices[0]
    assert (choice.finish_reason, _token_ids(choice), stopped.usage.completion_tokens) == (
        "stop",
        ids[: cut + 1],
        cut + 1,
    )
    assert free.text.startswith(choice.text) and stopped.usage.prompt_tokens == len(byte_ids(PROMPT))
    deadline = time.monotonic() + 10  # the decode worker frees the pages once it sees the cancel
    while time.monotonic() < deadline:
        try:
            return assert_no_request_holds_pages(cluster)
        except AssertionError:
            time.sleep(0.05)
    assert_no_request_holds_pages(cluster)


def test_tokenize_detokenize_and_the_model_by_id(cluster, client, model):
    def post(path: str, payload: dict) -> dict:
        request = urllib.request.Request(
            cluster.http_address + path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    tokens = post("/tokenize", {"model": model, "prompt": PROMPT})["tokens"]
    usage = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, **GREEDY).usage
    assert len(tokens) == usage.prompt_tokens
    assert post("/detokenize", {"model": model, "tokens": tokens})["prompt"].endswith(PROMPT)
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(n=17), "n"),  # more choices than a request may ask (16)
        (dict(temperature=3), "temperature"),
        (dict(max_tokens=100000), "max_tokens"),
        (dict(extra_body={"num_spec_tokens": 9}), "num_spec_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.type == "invalid_request_error"


def test_bad_chat_input_names_the_message_field(client, model):
    with pytest.raises(openai.BadRequestError) as e:  # any string role reaches the template
        client.chat.completions.create(model=model, messages=[{"role": 7, "content": "x"}])
    assert e.value.param == "messages[0].role"


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found"


def test_health_and_metrics_are_served_over_http(cluster, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2, **GREEDY)
    with urllib.request.urlopen(cluster.http_address + "/health", timeout=5) as response:
        health = json.loads(response.read())
    assert health["status"] == "serving" and health["num_ready_pairs"] == 1
    with urllib.request.urlopen(cluster.http_address + "/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'tandem_requests_total{model_name="target",role="router",status="length"}' in text
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(cluster.http_address + "/v1/nothing", timeout=5)
    assert e.value.code == 404


def _running(cluster) -> float:
    with urllib.request.urlopen(cluster.http_address + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return metric_sample(text, "tandem_requests_running", role="router")


def _finished(cluster, status: str) -> float:
    """The router's requests that ended with ``status`` so far (0 before the first)."""
    with urllib.request.urlopen(cluster.http_address + "/metrics", timeout=5) as response:
        text = response.read().decode()
    if f'status="{status}"' not in text:
        return 0.0
    return metric_sample(text, "tandem_requests_total", role="router", status=status)


def test_a_non_streaming_client_that_disconnects_ends_its_generation(cluster, model):
    """The request ends because its client left, not because it ran its course: no request
    finishes by length meanwhile (a behaviour, not a timing: the deadline is generous)."""
    body = json.dumps({"model": model, "prompt": "x", "max_tokens": 200, "ignore_eos": True}).encode()
    by_length = _finished(cluster, "length")
    host, port = cluster.http_address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        sent = time.monotonic()
        while not _running(cluster) and time.monotonic() - sent < 30:
            time.sleep(0.005)
        assert _running(cluster) == 1
    left = time.monotonic()
    while _running(cluster) and time.monotonic() - left < 60:
        time.sleep(0.02)
    assert _running(cluster) == 0
    assert _finished(cluster, "length") == by_length  # it did not run its 200 tokens out
    assert_no_request_holds_pages(cluster)


def _tandem_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", *args], capture_output=True, text=True, timeout=120
    )


def test_the_cli_client_streams_what_the_grpc_api_gives(cluster):
    request = cpb.GenerateRequest(text=PROMPT, sampling=cpb.SamplingParams(max_tokens=12))
    with grpc.insecure_channel(cluster.router_address) as channel:
        messages = list(cpb_grpc.TandemStub(channel).Generate(request, timeout=60))
    expected_ids = [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]
    expected_text = "".join(m.chunk.text for m in messages if m.HasField("chunk"))
    common = ["--endpoint", cluster.router_address, "--prompt", PROMPT, "--max-tokens", "12"]
    as_json = _tandem_generate(*common, "--json")
    as_text = _tandem_generate(*common)
    record = json.loads(as_json.stdout)
    assert (as_json.returncode, as_text.returncode) == (0, 0)
    assert record["token_ids"] == expected_ids and record["text"] == expected_text
    assert record["finish_reason"] in ("length", "stop")
    assert record["usage"]["completion_tokens"] == len(expected_ids)
    assert as_text.stdout == expected_text + "\n"


def test_the_cli_client_refuses_engine_flags_and_names_a_refused_request(cluster):
    with_engine_flag = _tandem_generate("--endpoint", cluster.router_address, "--prompt", "x", "-k", "2")
    assert with_engine_flag.returncode != 0
    assert "--num-spec-tokens: an engine option" in with_engine_flag.stderr
    too_long = _tandem_generate(
        "--endpoint", cluster.router_address, "--prompt", "x", "--max-tokens", "99999"
    )
    assert too_long.returncode == 2 and "INVALID_ARGUMENT: sampling.max_tokens" in too_long.stderr
