"""Tokenizer, WikiText-2 loading and NIAH prompt construction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rekv_jax.quality import data, niah

TEXT = (" = Lobster = \n The lobster has 10 legs and weighs 5 @.@ 4 kg . It lives in the sea ,"
        " where 2 of them met in 1987 . The pass key is 12345 . Remember it .\n") * 40


@pytest.fixture(scope="module")
def tok():
    return data.train_tokenizer(TEXT, 320)


def test_tokenizer_round_trips_and_splits_digits(tok):
    text = " The pass key is 90817 . What is it ?"
    ids = data.encode(tok, text)
    assert ids.dtype == np.int32
    assert tok.decode(ids.tolist()) == text
    digits = [t for t in tok.encode(" 4444 20718").tokens if t.strip("Ġ")]
    assert digits == list("444420718")  # one token per digit, however often "44" occurs


def test_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer(TEXT, 100)


def test_wikitext_path_option_env_and_missing(tmp_path, monkeypatch):
    (tmp_path / "valid.txt").write_text("hello world\n")
    assert data.read_split("valid", tmp_path) == "hello world\n"
    monkeypatch.setenv(data.WIKITEXT_ENV, str(tmp_path))
    assert data.wikitext_dir() == tmp_path
    with pytest.raises(ValueError, match="test split not found"):
        data.read_split("test")
    with pytest.raises(ValueError, match="split must be"):
        data.read_split("train")


def test_shipped_wikitext_is_package_data(monkeypatch):
    monkeypatch.delenv(data.WIKITEXT_ENV, raising=False)
    folder = data.wikitext_dir()
    assert folder == Path(data.__file__).parents[1] / "assets" / "wikitext-2"
    assert (folder / "LICENSE").is_file() and "Attribution-ShareAlike" in (
        folder / "LICENSE").read_text()
    valid, test = data.read_split("valid"), data.read_split("test")
    assert (len(valid.encode()), len(test.encode())) == (1121681, 1256449)  # the full splits
    assert valid.startswith(" \n = Homarus gammarus = \n")


def test_windows_are_consecutive_and_checked():
    ids = np.arange(100, dtype=np.int32)
    w = data.windows(ids, 30, 3)
    assert np.array_equal(w.reshape(-1), ids[:90])
    with pytest.raises(ValueError, match="need 120 tokens"):
        data.windows(ids, 30, 4)


@settings(max_examples=25, deadline=None)
@given(depth=st.floats(0.0, 1.0), seq_len=st.integers(64, 300), seed=st.integers(0, 2**31))
def test_needle_sits_at_requested_depth(tok, depth, seq_len, seed):
    filler = np.arange(1000, 1000 + seq_len, dtype=np.int32)  # ids no needle token can equal
    key = niah.random_key(np.random.default_rng(seed))
    p = niah.niah_prompt(tok, filler, seq_len, depth, key)
    needle = data.encode(tok, niah.NEEDLE.format(key=key))
    question = data.encode(tok, niah.QUESTION)
    n_fill = seq_len - needle.size - question.size
    assert p.tokens.size == seq_len
    assert p.needle_start == round(depth * n_fill)
    assert np.array_equal(p.tokens[p.needle_start:p.needle_start + needle.size], needle)
    assert np.array_equal(np.delete(p.tokens[:-question.size],  # the rest is the filler, in order
                                    np.arange(p.needle_start, p.needle_start + needle.size)),
                          filler[:n_fill])
    assert np.array_equal(p.tokens[-question.size:], question)
    assert tok.decode(p.answer.tolist()) == " " + key
    assert len(set(key)) == len(key) == niah.KEY_DIGITS and key[0] != "0"


def test_niah_prompt_rejects_bad_input(tok):
    filler = np.zeros(100, np.int32)
    with pytest.raises(ValueError, match="depth"):
        niah.niah_prompt(tok, filler, 80, 1.5, "12345")
    with pytest.raises(ValueError, match="shorter than needle"):
        niah.niah_prompt(tok, filler, 10, 0.5, "12345")
    with pytest.raises(ValueError, match="filler has"):
        niah.niah_prompt(tok, filler, 200, 0.5, "12345")
    with pytest.raises(ValueError, match="digits"):
        niah.niah_prompt(tok, filler, 80, 0.5, "12a45")


def test_passkey_example_ends_with_masked_answer(tok):
    text = data.encode(tok, TEXT)
    tokens, mask = niah.passkey_example(tok, text, 128, np.random.default_rng(0))
    assert tokens.shape == mask.shape == (128,)
    answer = tokens[mask]
    assert tok.decode(answer.tolist()).strip().isdigit()
    assert np.array_equal(np.flatnonzero(mask), np.arange(128 - answer.size, 128))
    question = data.encode(tok, niah.QUESTION)
    assert np.array_equal(tokens[~mask][-question.size:], question)
