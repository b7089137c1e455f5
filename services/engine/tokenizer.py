"""Byte-level tokenizer: ids 0..255 are bytes, then a few specials.

Decoding skips specials and replaces invalid UTF-8 with U+FFFD, so a text built from a
prefix of the ids is a prefix of the full text except possibly for its last character.
"""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
NUM_BYTES = 256
VOCAB_SIZE = 264  # bytes + specials, rounded up to a multiple of 8


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str | bytes, add_bos: bool = True) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([BOS_ID] if add_bos else []) + list(data)

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        return bytes(t for t in token_ids if 0 <= t < NUM_BYTES)

    def decode(self, token_ids: list[int]) -> str:
        return self.decode_bytes(token_ids).decode("utf-8", errors="replace")
