"""How the model values reach the pods: weights from an image copied by init containers,
and the tokenizer, chat template and served name passed to the roles that use them."""

from __future__ import annotations

from tests.helm.chart import deployment, effective_args, flag, render
from tests.helm.test_value_sets import WORKERS


def test_model_image_is_copied_by_an_init_container():
    m = render(
        {
            "model": {
                "source": "image",
                "image": {"repository": "registry.example/llama-8b", "tag": "v1", "path": "/weights"},
            }
        }
    )
    (init,) = deployment(m, "decode")["spec"]["template"]["spec"]["initContainers"]
    assert init["image"] == "registry.example/llama-8b:v1"
    assert init["command"] == ["sh", "-c", "cp -a /weights/. /model-volume/"]
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/model-volume"}]
    (router_init,) = deployment(m, "router")["spec"]["template"]["spec"]["initContainers"]
    assert router_init["command"][-1] == (
        "mkdir -p /model-volume/tiny-target && "
        "cp /weights/tiny-target/config.json /model-volume/tiny-target/ && "
        "for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do "
        "if [ -f /weights/tiny-target/$f ]; then cp /weights/tiny-target/$f /model-volume/tiny-target/; fi; "
        "done"
    )
    volumes = deployment(m, "decode")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "64Gi"}} in volumes


def test_tokenizer_chat_template_and_served_name_reach_the_roles_that_use_them():
    m = render(
        {
            "model": {
                "tokenizer": "tokenizers/llama3",
                "chatTemplate": "templates/chat.jinja",
                "servedModelName": "llama-3.1-8b",
            }
        }
    )
    router = effective_args(m, "router")
    assert flag(router, "--tokenizer") == "/opt/tandem/models/tokenizers/llama3"
    assert flag(router, "--chat-template") == "/opt/tandem/models/templates/chat.jinja"
    assert flag(router, "--served-model-name") == "llama-3.1-8b"
    for role in WORKERS:  # workers decode text for stop strings and label their metrics
        args = effective_args(m, role)
        assert flag(args, "--tokenizer") == "/opt/tandem/models/tokenizers/llama3"
        assert flag(args, "--served-model-name") == "llama-3.1-8b"
        assert flag(args, "--chat-template") is None
    defaults = effective_args(render(), "router")
    assert [flag(defaults, f) for f in ("--tokenizer", "--chat-template", "--served-model-name")] == [
        None,
        None,
        None,
    ]


def test_a_model_image_copies_the_tokenizer_and_template_overrides_for_the_router():
    m = render(
        {
            "model": {
                "source": "image",
                "tokenizer": "tok/llama3",
                "chatTemplate": "chat.jinja",
                "image": {"repository": "registry.example/llama-8b", "path": "/weights"},
            }
        }
    )
    (router_init,) = deployment(m, "router")["spec"]["template"]["spec"]["initContainers"]
    script = router_init["command"][-1]
    assert script.endswith(
        " && mkdir -p /model-volume/tok && cp -a /weights/tok/llama3 "
        "/model-volume/tok/llama3 && mkdir -p /model-volume/. && "
        "cp -a /weights/chat.jinja /model-volume/chat.jinja"
    )
    assert flag(effective_args(m, "router"), "--tokenizer") == "/models/tok/llama3"


def test_prompt_special_tokens_reaches_the_router_only():
    m = render({"model": {"promptSpecialTokens": "parse"}})
    assert flag(effective_args(m, "router"), "--prompt-special-tokens") == "parse"
    for role in WORKERS:
        assert flag(effective_args(m, role), "--prompt-special-tokens") is None
    assert flag(effective_args(render(), "router"), "--prompt-special-tokens") is None  # text: the default
