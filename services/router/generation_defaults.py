"""The model's sampling defaults from its generation_config.json, applied as vLLM applies them.

``--generation-config`` (vLLM's flag and spellings):

- ``auto`` (default): the model folder's generation_config.json, if it has one;
- ``vllm``: no file; a request's unset fields get the API's neutral defaults (temperature 1,
  top_p 1, no top_k, min_p or repetition penalty);
- any other value: a folder holding a generation_config.json.

Of the file, ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` are
read; each becomes the value of an OpenAI request that leaves the field unset (absent or
null); a request that sets it wins. A value equal to transformers' own GenerationConfig
default (temperature 1, top_p 1, top_k 50, repetition_penalty 1) is no difference from it
and is not applied, as vLLM reads the file (``to_diff_dict``). The file's other keys are not
sampling defaults (token ids, ``do_sample``, lengths); ``max_new_tokens`` is not applied
(``--default-max-tokens`` is the server's default) and ``describe`` says so. The gRPC API's
fields have proto3 defaults (0 = greedy) and get none of these.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

GENERATION_CONFIG = "generation_config.json"
MODES = ("auto", "vllm")
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# the fields read, with the values a request may set (openai_protocol's rules)
_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (1e-9, 1.0),
    "top_k": (-1, 2**31),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (1e-9, math.inf),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """OpenAI field -> its default for requests that leave it unset; ``source``: where they
    come from ("" = none); ``unapplied``: the file's keys that look like defaults but are not."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str = ""
    unapplied: tuple[str, ...] = ()

    def fill(self, body):
        """``body`` with the defaults in the fields it leaves unset (a new dict); a body that
        is not an object is returned as it is (the parser refuses it)."""
        if not self.values or not isinstance(body, dict):
            return body
        return {**body, **{k: v for k, v in self.values.items() if body.get(k) is None}}

    def describe(self) -> str:
        """One line for the router's log: which defaults apply."""
        if not self.values:
            return f"sampling defaults: none ({self.source or 'the API neutral ones'})"
        values = " ".join(f"{k}={v}" for k, v in self.values.items())
        skipped = f"; not applied: {', '.join(self.unapplied)}" if self.unapplied else ""
        return f"sampling defaults for unset fields: {values} (from {self.source}){skipped}"

    def as_json(self) -> dict:
        return {"source": self.source or None, **self.values}


def load_sampling_defaults(model_dir: str, mode: str = "auto") -> SamplingDefaults:
    """The defaults ``mode`` (see the module doc) gives for the model in ``model_dir``.
    Raises ValueError naming the file and field that is malformed."""
    if mode == "vllm":
        return SamplingDefaults(source="--generation-config vllm")
    folder = model_dir if mode == "auto" else mode
    path = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.isfile(path):
        if mode != "auto":
            raise ValueError(f"generation_config: {folder!r} holds no {GENERATION_CONFIG}")
        return SamplingDefaults(source=f"no {GENERATION_CONFIG}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{GENERATION_CONFIG}: unreadable: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{GENERATION_CONFIG}: expected an object")
    values = {k: _checked(k, config[k]) for k in _RANGES if config.get(k) is not None}
    values = {k: v for k, v in values.items() if TRANSFORMERS_DEFAULTS.get(k) != v}
    unapplied = tuple(k for k in ("max_new_tokens",) if config.get(k) is not None)
    return SamplingDefaults(values, GENERATION_CONFIG, unapplied)


def _checked(name: str, value) -> float | int:
    low, high = _RANGES[name]
    integer = name == "top_k"
    kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not kind_ok or not low <= value <= high:
        raise ValueError(f"{GENERATION_CONFIG}: {name}: {value!r} is not a value a request may set")
    return value
