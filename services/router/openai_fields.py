"""Typed getters for OpenAI JSON bodies: a missing field reads as its default, a bad value
is a 400 whose message and ``param`` name the field (OpenAI's error shape)."""

from __future__ import annotations

import math

from services.router.http import HttpError

MAX_UINT32 = 2**32 - 1  # the protos' integer fields; an integer without its own bound stops here


def invalid(param: str, message: str, status: int = 400, code: str | None = None) -> HttpError:
    """An OpenAI-style error naming ``param``; the message starts with it."""
    return HttpError(
        status,
        {
            "error": {
                "message": f"{param}: {message}",
                "type": "invalid_request_error",
                "param": param,
                "code": code,
            }
        },
    )


def served_model(body: dict, model_id: str, required: bool = True) -> str:
    """The body's ``model``: the served id (404 ``model_not_found`` for another); absent is
    a 400 when ``required``, else reads as the served id."""
    model = body.get("model")
    if model is None and not required:
        return model_id
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the served model's id (see /v1/models)")
    if model != model_id:
        raise not_found(model, model_id)
    return model


def not_found(model: str, model_id: str) -> HttpError:
    return invalid(
        "model",
        f"the model {model!r} does not exist; this server serves {model_id!r}",
        status=404,
        code="model_not_found",
    )


def as_object(body) -> dict:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    return body


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise invalid(name, f"must be a number, got {value!r}")
    if not low <= value <= high:
        raise invalid(name, f"must be in [{low:g}, {high:g}], got {value}")
    return float(value)


def integer(body: dict, name: str, default, low: int, high: int = MAX_UINT32):
    """The integer field ``name`` in [low, high] (high: MAX_UINT32 unless given)."""
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise invalid(name, f"must be an integer, got {_short(value)}")
    if not low <= value <= high:
        raise invalid(name, f"must be in [{low}, {high}], got {_short(value)}")
    return value


def _short(value) -> str:
    """A client's value for a message, cut to 40 characters (it may be 4,000 digits)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def boolean(body: dict, name: str, default: bool, param: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(param or name, f"must be true or false, got {value!r}")
    return value
