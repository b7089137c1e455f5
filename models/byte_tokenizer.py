"""The tiny pair's byte-level vocabulary, written as a Hugging Face tokenizer folder.

Ids 0..255 are the bytes, 256 ``<bos>``, 257 ``<eos>``, 258 ``<pad>``; the model's
vocabulary is 264 (rounded up to a multiple of 8; ids 259..263 are never produced).
Encoding prepends ``<bos>``; decoding skips the specials and turns invalid UTF-8 into
U+FFFD. ``write_byte_tokenizer`` writes ``tokenizer.json`` (a BPE model with no merges
over the 256 ByteLevel-alphabet characters), ``tokenizer_config.json`` (with a chat
template) and ``generation_config.json``, so the serving stack loads the pair through the
same path as any Hugging Face folder:

    python -m models.byte_tokenizer models/tiny-target
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

NUM_BYTES = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 264  # bytes + specials, rounded up to a multiple of 8
BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"

# Renders messages as ``<role>: <content>`` lines after ``<bos>``, then ``assistant: ``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def byte_ids(text: str | bytes, add_bos: bool = True) -> list[int]:
    """The ids ``tokenizer.json`` gives: optional ``<bos>``, then one id per UTF-8 byte."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return ([BOS_ID] if add_bos else []) + list(data)


def byte_tokenizer() -> Tokenizer:
    """The ``tokenizers`` pipeline: ByteLevel maps byte b to one alphabet character, which
    the merge-free BPE maps to id b."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = _byte_to_char()
    vocab = {byte_char[b]: b for b in range(NUM_BYTES)}
    assert sorted(vocab) == sorted(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def write_byte_tokenizer(folder: str | Path) -> None:
    """Write the tokenizer files into a model folder (weights untouched)."""
    folder = Path(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    for name, data in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        (folder / name).write_text(json.dumps(data, indent=2) + "\n")


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


if __name__ == "__main__":
    write_byte_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-target")
