"""generation_config.json's sampling defaults: an unset field gets the folder's value, a set
one wins; ``vllm`` ignores the file; /v1/models says which apply."""

from __future__ import annotations

import json

import pytest

from services.router.generation_defaults import load_sampling_defaults
from services.router.openai_api import OpenAIOptions, OpenAIServer
from tests.services.router import scripted_router as scripted
from tests.services.router.scripted_router import CHAT, MODEL, call

QWEN3_LIKE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.0,  # transformers' default: no difference, not applied
    "max_new_tokens": 100,
}


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    return str(tmp_path)


def _router() -> scripted.ScriptedRouter:
    return scripted.ScriptedRouter([scripted.chunk_message("a"), scripted.complete_message()])


def _sent(server: OpenAIServer, path: str, **fields):
    """The sampling params the router got for one request with ``fields``."""
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    assert call(server, path, body).status == 200
    return server.router.requests[-1].sampling


def test_the_folders_defaults_fill_unset_fields_and_a_set_field_wins(folder):
    defaults = load_sampling_defaults(folder)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    server = OpenAIServer(_router(), CHAT, OpenAIOptions(defaults))
    for path in ("/v1/completions", "/v1/chat/completions"):
        unset = _sent(server, path)
        assert (unset.temperature, unset.top_p, unset.top_k) == pytest.approx((0.6, 0.95, 20))
        null = _sent(server, path, temperature=None)
        assert null.temperature == pytest.approx(0.6)
        mine = _sent(server, path, temperature=0, top_k=5)
        assert (mine.temperature, mine.top_p, mine.top_k) == pytest.approx((0.0, 0.95, 5))


def test_vllm_ignores_the_file_and_the_api_defaults_apply(folder):
    defaults = load_sampling_defaults(folder, "vllm")
    server = OpenAIServer(_router(), CHAT, OpenAIOptions(defaults))
    sent = _sent(server, "/v1/completions")
    assert (sent.temperature, sent.top_p, sent.top_k) == (1.0, 1.0, 0)
    card = json.loads(call(server, "/v1/models").body)["data"][0]
    assert card["sampling_defaults"] == {"source": "--generation-config vllm"}


def test_v1_models_and_the_startup_line_say_which_defaults_apply(folder):
    defaults = load_sampling_defaults(folder)
    server = OpenAIServer(_router(), CHAT, OpenAIOptions(defaults, "qwen3"))
    card = json.loads(call(server, "/v1/models").body)["data"][0]
    assert card["sampling_defaults"] == {
        "source": "generation_config.json",
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    assert card["reasoning_parser"] == "qwen3"
    assert defaults.describe() == (
        "sampling defaults for unset fields: temperature=0.6 top_p=0.95 top_k=20 "
        "(from generation_config.json); not applied: max_new_tokens"
    )


def test_a_folder_without_the_file_has_none_and_another_folder_may_give_them(tmp_path, folder):
    (tmp_path / "model").mkdir()
    assert load_sampling_defaults(str(tmp_path / "model")).values == {}
    assert load_sampling_defaults(str(tmp_path / "model"), folder).values["top_k"] == 20
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        load_sampling_defaults(folder, str(tmp_path / "model"))


@pytest.mark.parametrize(
    "config, field",
    [({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 2.5}, "top_k")],
)
def test_a_malformed_default_is_refused_at_startup_naming_it(tmp_path, config, field):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^generation_config.json: {field}: "):
        load_sampling_defaults(str(tmp_path))
