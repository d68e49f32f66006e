"""When a served request ends: the one rule the decode engine applies after each of its tokens.

A request ends after token n (its n-th generated, the handoff's first included) with
  * "stop", when n >= `Stops.min_tokens` and the token is one of the model's EOS ids (unless
    `Stops.ignore_eos`; `stop` is the id), else one of `Stops.stop_token_ids` (`stop` is the id),
    else the text of its tokens newly holds a string of `Stops.stop` (`stop` is the string;
    caught also when the string is split across tokens);
  * else "length", when n is its `max_new_tokens`.
Stop strings are matched in the generated ids' text as the model's tokenizer decodes them (its
special tokens skipped), only where that text grew since the token before: an occurrence that
lay wholly in the text of fewer than `min_tokens` tokens ends nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rekv_jax.serving.sampling import Stops

if TYPE_CHECKING:
    from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder shows for the bytes of a character not yet complete


@dataclasses.dataclass(frozen=True)
class End:
    """How a request ended (`requests.FINISH_REASONS`) and the stop that ended it."""

    reason: str  # "length" or "stop"
    stop: str | int | None = None  # the matched stop string or token id ("stop")


class Ending:
    """One request's end rule (the module's docstring), fed its tokens as they come."""

    def __init__(self, stops: Stops, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 tokenizer: Tokenizer | None = None) -> None:
        if stops.stop and tokenizer is None:
            raise ValueError(f"stop strings {list(stops.stop)} need the model's tokenizer; "
                             f"this model has none (stop token ids work without one)")
        self._stops, self._max, self._tokenizer = stops, max_new_tokens, tokenizer
        self._ids = set(stops.stop_token_ids)
        self._eos = set() if stops.ignore_eos else set(eos_ids)
        self._text = ""  # the text of the tokens before the latest (stop strings only)

    def after(self, tokens: Sequence[int]) -> End | None:
        """Whether the request ends with its latest token (None: it goes on)."""
        n, token = len(tokens), tokens[-1]
        string = self._stop_string(tokens) if self._stops.stop else None  # the text kept
        if n >= self._stops.min_tokens and (token in self._eos or token in self._ids):
            return End("stop", token)
        if n >= self._stops.min_tokens and string is not None:
            return End("stop", string)
        return End("length") if n >= self._max else None

    def _stop_string(self, tokens: Sequence[int]) -> str | None:
        """The stop string the text newly holds (the earliest, if several), else None."""
        text = self._tokenizer.decode(list(tokens))
        # the text before grew at its end only, but for a character it had not completed
        settled, self._text = len(self._text.rstrip(REPLACEMENT)), text
        found = first_stop(text, settled, self._stops.stop)
        return found[1] if found else None


def first_stop(text: str, settled: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """(where, which) of the earliest stop string in `text` that ends past its first `settled`
    characters (an occurrence wholly inside them was judged before), else None."""
    found = [(at, s) for s in stops if (at := text.find(s, max(0, settled - len(s) + 1))) >= 0]
    return min(found) if found else None
