"""The model's own tokenizer: a Hugging Face ``tokenizer.json`` through ``tokenizers``.

    tok = load_tokenizer("models/tiny-target")       # or load_tokenizer(model, "--tokenizer PATH")
    ids = tok.encode("def fib(n):")                   # == AutoTokenizer(...)(text)["input_ids"]
    text = tok.decode(ids)                            # == tok.decode(ids, skip_special_tokens=True)

Behaviour follows ``transformers`` 5 loading the same folder (the reference the tests
compare with): the ``tokenizer.json`` post-processor adds special tokens as written (with
a ``tokenizer.json`` present, transformers ignores ``add_bos_token`` / ``add_eos_token`` of
``tokenizer_config.json``, and so do we); the named special tokens of
``tokenizer_config.json`` (bos, eos, unk, pad) are added as special tokens when the vocabulary
lacks them; special-token text is parsed as the special token by ``encode`` (the model's
own text: templates) but encoded as plain text by ``encode_text`` (what users type), unless
``special_in_text`` says users may write special tokens; padding and truncation stored in
``tokenizer.json`` are off. Nothing is downloaded: a folder without
``tokenizer.json`` is refused. Decoding skips special tokens and never applies
``clean_up_tokenization_spaces`` (transformers skips it for BPE; for other models it is
refused, since it rewrites text across tokens and streamed text could then not equal the
decoded text).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(slots=True)
class Tokenizer:
    """``backend``: the ``tokenizers`` pipeline; ``folder``: where its files were read
    (the chat template lives there too); ``config``: ``tokenizer_config.json`` (may be
    empty); ``special_tokens``: name (``bos_token``, ...) -> token text, for those set."""

    backend: HFTokenizer
    folder: str
    config: dict = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)
    byte_piece_ids: frozenset[int] = frozenset()  # see _byte_pieces
    special_in_text: bool = False  # encode_text parses special-token text as the token

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (added tokens included); may be below the model's."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def bos_id(self) -> int | None:
        return self.token_id("bos_token")

    def token_id(self, name: str) -> int | None:
        """The id of a named special token (``eos_token``, ...), None when unset."""
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Trusted text (a chat template's own): special-token text becomes the token."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A user's text: special-token text in it (``<|im_start|>``, ``</s>``) is encoded
        as the plain text it is, so no user forges a control token, unless
        ``special_in_text``. ``add_special_tokens``: the model's own (a BOS) are added."""
        if self.special_in_text:
            return self.encode(text, add_special_tokens)
        self.backend.encode_special_tokens = True
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self.backend.encode_special_tokens = False

    def special_texts(self) -> list[str]:
        """The texts of the special tokens, longest first (one may contain another)."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return sorted(texts, key=len, reverse=True)

    def decode(self, token_ids: list[int]) -> str:
        """Special tokens skipped; invalid byte sequences become U+FFFD."""
        return self.backend.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str, tokenizer_path: str = "") -> Tokenizer:
    """The tokenizer of ``model_dir``, or of ``tokenizer_path`` (a folder, or a
    ``tokenizer.json`` whose folder may hold ``tokenizer_config.json``) when given.
    Raises ValueError naming what is missing or unsupported."""
    path = tokenizer_path or model_dir
    file = path if os.path.isfile(path) else os.path.join(path, TOKENIZER_FILE)
    where = "tokenizer" if tokenizer_path else "model"
    if not os.path.exists(path):
        raise ValueError(f"{where}: {path!r} does not exist")
    if not os.path.isfile(file):
        raise ValueError(f"{where}: {path!r} has no {TOKENIZER_FILE}" + _missing_hint(path))
    folder = os.path.dirname(os.path.abspath(file))
    try:
        backend = HFTokenizer.from_file(file)
    except Exception as e:  # the library raises a bare Exception on a malformed file
        raise ValueError(f"{where}: {file!r} is not a valid {TOKENIZER_FILE}: {e}") from None
    config = _read_json(os.path.join(folder, CONFIG_FILE))
    special = _special_tokens(config)
    _check_cleanup(config, backend, folder)
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = False
    missing = [t for t in special.values() if backend.token_to_id(t) is None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    return Tokenizer(backend, folder, config, special, _byte_pieces(backend))


def _byte_pieces(backend: HFTokenizer) -> frozenset[int]:
    """Ids of the ``<0xXX>`` pieces when the decoder has ByteFallback: it decodes a run of
    them together, all as U+FFFD if the run is not valid UTF-8, so text ending in one may
    still change (the detokenizer holds it back). The special tokens count too: skipped
    before decoding, they do not end a run."""
    if "ByteFallback" not in repr(backend.decoder):
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    specials = (i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return frozenset(i for i in (*ids, *specials) if i is not None)


def _missing_hint(path: str) -> str:
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
        return (
            " (a sentencepiece tokenizer.model alone is not supported: convert it with "
            "transformers' save_pretrained, or pass --tokenizer with a tokenizer.json)"
        )
    return "; pass --tokenizer with a folder or file that has one"


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"tokenizer: {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer: {path!r} must hold a JSON object")
    return data


def _special_tokens(config: dict) -> dict[str, str]:
    """Token texts of the named specials; a value may be a string or an AddedToken dict."""
    out = {}
    for name in SPECIAL_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{CONFIG_FILE}: {name}: expected a string, got {value!r}")
        if value:
            out[name] = value
    return out


def _check_cleanup(config: dict, backend: HFTokenizer, folder: str) -> None:
    model = type(backend.model).__name__
    if config.get("clean_up_tokenization_spaces") and model != "BPE":
        raise ValueError(
            f"{CONFIG_FILE}: clean_up_tokenization_spaces: true is not supported "
            f"for a {model or 'non-BPE'} tokenizer (in {folder!r}); supported: "
            "false"
        )
