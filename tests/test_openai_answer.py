"""A reply's text as tokens come, against the tokenizer's own decode of them all: the pieces add
up to it (characters split across byte-level tokens included), and a stop string ends it at its
first occurrence, no piece holding any of it. Each token's own bytes add up to it too."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rekv_jax.model.loader import SHIPPED_MODEL, load_tokenizer
from rekv_jax.serving.openai_answer import Detokenizer, Reply, token_bytes
from rekv_jax.serving.openai_request import ModelInfo
from rekv_jax.serving.requests import Ended, ServeRequest, Token
from rekv_jax.serving.sampling import Stops

TOKENIZER = load_tokenizer(SHIPPED_MODEL)
MODEL = ModelInfo("wt2-tiny", 4096, TOKENIZER)
TEXTS = ["The tower is tall . Où est la tour ? 2010 ; – “quoted” €", "a b a b a b c"]
# ids of the texts above, and any ids at all (special token 0, halves of characters)
IDS = st.one_of(st.sampled_from([TOKENIZER.encode(t).ids for t in TEXTS]),
                st.lists(st.integers(0, TOKENIZER.get_vocab_size() - 1), min_size=1,
                         max_size=40))
SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(IDS, st.booleans())
def test_the_detokenized_pieces_add_up_to_the_tokenizers_text(ids, skip):
    d = Detokenizer(TOKENIZER, skip)
    pieces = [d.add(t) for t in ids] + [d.flush()]
    text = TOKENIZER.decode(ids, skip)
    assert "".join(pieces) == text
    if "\ufffd" not in text:  # no character was ever sent in halves
        assert all("\ufffd" not in p for p in pieces)


def _replay(ids, stops, ended):
    """Every piece of a reply to `ids`, then `ended` (unless it finished first)."""
    reply = Reply(MODEL, ServeRequest(0, (1,), len(ids), stops=stops))
    pieces = []
    for i, t in enumerate(ids):
        piece = reply.add(Token(0, i, t, 0.0))
        pieces += [piece] if piece else []
        if reply.finish:
            return pieces
    return pieces + [reply.add(ended)]


@SETTINGS
@given(IDS, st.data())
def test_a_stop_string_cuts_the_text_at_its_first_occurrence(ids, data):
    ids = ids + TOKENIZER.encode(" end").ids  # some text to cut, whatever the drawn ids hold
    text = TOKENIZER.decode(ids)
    assert text.endswith("end")
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 6))]
    pieces = _replay(ids, Stops((stop,)), Ended("length"))
    # pieces only add text, so the sent text is at every step a prefix of the cut text: no
    # piece ever held a character of the stop string
    assert "".join(p.text for p in pieces) == text[:text.find(stop)]
    assert pieces[-1].finish == "stop"


@SETTINGS
@given(IDS)
def test_without_a_stop_the_text_is_all_of_it_and_the_end_is_the_backends(ids):
    pieces = _replay(ids, Stops(("\x00never",)), Ended("stop", 0))
    assert "".join(p.text for p in pieces) == TOKENIZER.decode(ids)
    assert [p.finish for p in pieces] == [None] * (len(pieces) - 1) + ["stop"]
    assert sum(len(p.tokens) for p in pieces) == len(ids) == len(pieces)  # a token a piece


@SETTINGS
@given(IDS)
def test_the_tokens_bytes_add_up_to_the_tokenizers_text(ids):
    """The tokens' bytes, joined, are the bytes the tokenizer decodes (special tokens
    included): a token that ends inside a character holds that character's first bytes."""
    joined = bytes(b for t in ids for b in token_bytes(TOKENIZER, t))
    assert joined.decode("utf-8", "replace") == TOKENIZER.decode(ids, False)


def test_a_token_inside_a_character_holds_its_bytes():
    ids = TOKENIZER.encode("Où €").ids
    assert [TOKENIZER.decode([t]) for t in ids[1:3]] == ["\ufffd"] * 2  # ù split in two
    assert [token_bytes(TOKENIZER, t) for t in ids[1:3]] == [[0xC3], [0xB9]]
    assert bytes(b for t in ids for b in token_bytes(TOKENIZER, t)) == "Où €".encode()
