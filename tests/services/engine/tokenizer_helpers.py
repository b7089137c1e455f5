"""Small Hugging Face tokenizer folders built on the fly with ``tokenizers`` (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "héllo wörld, the quick brown fox jumps over the lazy dog",
    "日本語のテキスト and emoji 😀🎉 mixed with ascii text",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café résumé — “quotes” and ‘more’ € £ ¥",
] * 20
SPECIALS = ("<s>", "</s>", "<pad>")


def trained_bpe(vocab_size: int = 400) -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama-3 style) with merges over multi-byte characters;
    ``<s>`` is prepended by the post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def trained_metaspace(vocab_size: int = 300) -> Tokenizer:
    """A sentencepiece-style BPE (Llama 2 / Mistral style): Metaspace, byte fallback for
    characters outside the trained pieces (the emoji)."""
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator([line for line in CORPUS if "😀" not in line], trainer)
    trained = json.loads(base.to_str())["model"]
    pieces = ["<unk>", *SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *trained["vocab"]]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", *SPECIALS)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def write_folder(folder: Path, tok: Tokenizer, chat_template: str | list | None = None, **config) -> Path:
    """tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    data = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        **config,
    }
    if chat_template is not None:
        data["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    return folder
