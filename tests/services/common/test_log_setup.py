"""services/common/log_setup.py: the text line carries the bound request's id, the JSON one
is an object per line with the standard keys, the request id and a record's fields."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from services.common.log_setup import configure_logging
from services.common.request_context import REQUEST_ID, bind_request, client_request_id


@pytest.fixture(autouse=True)
def restore_root():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_a_text_line_names_the_request_it_is_about(capsys):
    configure_logging("INFO", "decode-1")
    log = logging.getLogger("services.test")

    async def about(rid: str) -> None:
        bind_request(rid)
        log.info("about it")

    asyncio.run(about("cmpl-7#ab12.1"))
    log.info("about nothing")
    first, second = lines(capsys)
    assert first.endswith(" INFO decode-1 services.test [cmpl-7]: about it")
    assert second.endswith(" INFO decode-1 services.test: about nothing")


def test_a_json_line_is_one_object_with_the_request_id_and_the_fields(capsys):
    configure_logging("INFO", "router", "json")
    log = logging.getLogger("services.test")
    token = REQUEST_ID.set("req-1")
    try:
        log.warning("failed %s", "once", extra={"fields": {"status": "error", "message": "not this one"}})
    finally:
        REQUEST_ID.reset(token)
    log.info("idle")
    first, second = map(json.loads, lines(capsys))
    assert first["level"] == "WARNING" and first["process"] == "router" and first["logger"] == "services.test"
    assert first["message"] == "failed once" and first["request_id"] == "req-1" and first["status"] == "error"
    assert first["time"].endswith("+00:00")
    assert "request_id" not in second and second["message"] == "idle"


def test_a_traceback_stays_inside_its_json_line(capsys):
    configure_logging("INFO", "router", "json")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("t").exception("it broke")
    (line,) = lines(capsys)
    assert "ValueError: boom" in json.loads(line)["exception"]


def test_unknown_levels_and_formats_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^log_format: must be text or json, got 'xml'"):
        configure_logging("INFO", "router", "xml")
    with pytest.raises(ValueError, match=r"^log_level: must be DEBUG, INFO, WARNING or ERROR"):
        configure_logging("LOUD", "router")


def test_a_workers_attempt_id_is_cut_to_the_clients_request_id():
    assert client_request_id("cmpl-abc#9f3e1a7.2") == "cmpl-abc"
    assert client_request_id("a#b#c0.1") == "a#b"
    assert client_request_id("plain") == "plain"
    assert client_request_id("no#suffix") == "no#suffix"
