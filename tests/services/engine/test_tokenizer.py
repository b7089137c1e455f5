"""The model's own tokenizer: the bundled byte vocabulary, trained BPEs, transformers as the
reference, incremental detokenization, and what is refused at load."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, byte_ids
from services.engine.checks import eos_ids
from services.tokenization.detokenizer import REPLACEMENT, Detokenizer
from services.tokenization.tokenizer import load_tokenizer
from tests.services.engine.tokenizer_helpers import trained_bpe, trained_metaspace, write_folder

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny-target"
SPECIAL_TEXT = ("<bos>", "<eos>", "<pad>")
FAST = settings(max_examples=60, deadline=None)

no_special_text = st.text(max_size=40).filter(lambda s: not any(t in s for t in SPECIAL_TEXT))


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(str(TINY))


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TINY))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, tandem Tokenizer, transformers tokenizer) for the trained BPEs."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for name, build in (("bpe", trained_bpe), ("metaspace", trained_metaspace)):
        folder = write_folder(tmp_path_factory.mktemp(name), build())
        out[name] = (
            folder,
            load_tokenizer(str(folder)),
            transformers.AutoTokenizer.from_pretrained(str(folder)),
        )
    return out


# ---------------------------------------------------------------------- the bundled vocabulary


@FAST
@given(no_special_text)
def test_the_bundled_tokenizer_is_the_byte_vocabulary(tiny, text):
    ids = tiny.encode(text)
    assert ids == byte_ids(text)
    assert tiny.decode(ids) == text


@FAST
@given(st.lists(st.integers(0, PAD_ID), max_size=30))
def test_bundled_decoding_skips_specials_and_replaces_invalid_utf8(tiny, ids):
    expected = bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
    assert tiny.decode(ids) == expected


@FAST
@given(no_special_text)
def test_transformers_reads_the_bundled_folder_the_same_way(tiny, reference, text):
    ids = reference(text)["input_ids"]
    assert ids == tiny.encode(text)
    assert reference.decode(ids, skip_special_tokens=True) == tiny.decode(ids)


def test_the_bundled_specials_and_eos(tiny):
    assert (tiny.bos_id, tiny.eos_id, tiny.token_id("pad_token")) == (BOS_ID, EOS_ID, PAD_ID)
    config = SimpleNamespace(eos_token_id=EOS_ID)
    assert eos_ids(str(TINY), config, tiny) == {EOS_ID}


# ---------------------------------------------------------------------- trained BPEs


@FAST
@given(st.text(max_size=50))
def test_trained_tokenizers_encode_and_decode_as_transformers_does(folders, text):
    for _, tok, ref in folders.values():
        ids = ref(text)["input_ids"]
        assert tok.encode(text) == ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


@FAST
@given(st.data())
def test_streamed_text_is_the_decoded_text_and_no_chunk_splits_a_character(folders, data):
    for _, tok, _ in folders.values():
        ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
        sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
        detok, chunks, i = Detokenizer(tok), [], 0
        for n in sizes:
            if i >= len(ids):
                break
            chunks.append(detok.push(ids[i : i + n]))
            i += n
        assert not any(c.endswith(REPLACEMENT) for c in chunks)
        assert "".join(chunks) + detok.flush() == tok.decode(ids)


@FAST
@given(st.text(max_size=60))
def test_streaming_an_encoded_text_gives_it_back(folders, text):
    for name, (_, tok, _) in folders.items():
        detok = Detokenizer(tok)
        ids = tok.encode(text)
        streamed = "".join(detok.push([t]) for t in ids) + detok.flush()
        assert streamed == tok.decode(ids)
        if name == "bpe":  # sentencepiece-style decoding drops a leading space
            assert streamed == text


def test_the_detokenizer_holds_back_an_incomplete_character(folders):
    _, tok, _ = folders["metaspace"]
    emoji = tok.encode("😀", add_special_tokens=False)[1:]  # four byte-fallback pieces
    detok = Detokenizer(tok)
    pushed = [detok.push([t]) for t in tok.encode("ab", add_special_tokens=False) + emoji]
    assert "".join(pushed) == "ab" and pushed[-4:] == [""] * 4  # a later piece could spoil it
    assert detok.push(tok.encode("c", add_special_tokens=False)) == "😀 c"


# ---------------------------------------------------------------------- loading


def test_a_tokenizer_override_may_be_a_folder_or_a_file(folders, tmp_path):
    folder, tok, _ = folders["bpe"]
    by_folder = load_tokenizer(str(tmp_path), str(folder))
    by_file = load_tokenizer(str(tmp_path), str(folder / "tokenizer.json"))
    for other in (by_folder, by_file):
        assert other.encode("héllo") == tok.encode("héllo") and other.eos_id == tok.eos_id


def test_a_folder_without_tokenizer_json_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^model: .* has no tokenizer.json; pass --tokenizer"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(ValueError, match="a sentencepiece tokenizer.model alone is not supported"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=r"^tokenizer: '/nonexistent' does not exist"):
        load_tokenizer(str(tmp_path), "/nonexistent")


def test_cleanup_of_tokenization_spaces_is_refused_outside_bpe(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    write_folder(tmp_path, tok, clean_up_tokenization_spaces=True)
    with pytest.raises(
        ValueError, match="clean_up_tokenization_spaces: true is not supported for a WordLevel tokenizer"
    ):
        load_tokenizer(str(tmp_path))


def test_eos_ids_are_the_union_of_config_and_generation_config(folders, tmp_path):
    _, tok, _ = folders["bpe"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_ids(str(tmp_path), SimpleNamespace(eos_token_id=5), tok) == {5, 7, 9}
    assert eos_ids(str(tmp_path / "none"), SimpleNamespace(eos_token_id=None), tok) == {tok.eos_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="^generation_config.json: eos_token_id:"):
        eos_ids(str(tmp_path), SimpleNamespace(eos_token_id=None), tok)
