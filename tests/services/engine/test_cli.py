"""``generate --offline`` over the bundled pair."""

from __future__ import annotations

import json

import pytest

from services.engine.cli import BUNDLED, main

pytestmark = pytest.mark.skipif(
    not (BUNDLED / "tiny-drafter" / "model.safetensors").is_file(),
    reason="the bundled tiny pair is not present",
)


def generate(capsys, *extra: str) -> tuple[int, str, str]:
    rc = main(["generate", "--offline", "--prompt", "def fib(n):", "--max-tokens", "12", *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_json_output_with_and_without_speculation(capsys):
    rc, out, _ = generate(capsys, "--json")
    spec = json.loads(out)
    assert rc == 0 and set(spec) == {"text", "token_ids", "finish_reason", "usage"}
    assert spec["finish_reason"] in ("length", "stop")
    assert spec["usage"]["prompt_tokens"] == len(b"def fib(n):") + 1
    assert spec["usage"]["completion_tokens"] == len(spec["token_ids"])
    rc, out, _ = generate(capsys, "--json", "--no-spec")
    plain = json.loads(out)
    assert plain["token_ids"] == spec["token_ids"]  # greedy: lossless
    assert plain["usage"]["acceptance_length"] == 1.0


def test_bad_temperature_exits_with_the_field_named(capsys):
    rc, _, err = generate(capsys, "--temperature", "-1")
    assert rc == 2 and "temperature" in err


def test_forced_acceptance_is_announced_and_forces_the_acceptance_length(capsys):
    rc, out, err = generate(capsys, "--json", "--unsafe-forced-acceptance", "2")
    assert rc == 0 and err.startswith("WARNING: UNSAFE FORCED ACCEPTANCE (--unsafe-forced-acceptance 2)")
    assert "the acceptance length is forced to 3 and the outputs are NOT the target model's" in err
    assert json.loads(out)["usage"]["acceptance_length"] == 3.0
    _, _, err = generate(capsys, "--json")
    assert "FORCED" not in err
