"""Word-level tokenisation and a frequency vocabulary, for text classification (IMDb).

Example::

    vocab = Vocabulary.build(train_texts, size=20000)
    ids = vocab.encode(batch_texts, length=256)  # (N, 256) int32, PAD-filled
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence

import numpy as np

PAD = 0
UNK = 1
_RESERVED = ("<pad>", "<unk>")

# IMDb reviews carry HTML line breaks; they separate words and are not words themselves.
_LINE_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
# Runs of letters/digits, keeping inner apostrophes so that "don't" stays one word.
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


def tokenize(text: str | bytes) -> list[str]:
    """Splits a text into lowercase words.

    Args:
      text: the raw text; bytes (as TFDS stores text) are decoded as UTF-8.

    Returns:
      The words in order, without punctuation and ``<br />`` tags.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return _WORD.findall(_LINE_BREAK.sub(" ", text.lower()))


class Vocabulary:
    """Word to id map: ``PAD`` = 0, ``UNK`` = 1, then words by decreasing frequency.

    Attributes:
      words: every token by id, the two reserved ones first.
    """

    def __init__(self, words: Sequence[str]):
        """Makes a vocabulary whose id ``i + 2`` is ``words[i]``."""
        self.words = _RESERVED + tuple(words)
        self._ids = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def build(cls, texts: Iterable[str | bytes], size: int) -> Vocabulary:
        """Keeps the ``size - 2`` most frequent words of ``texts``.

        Ties in frequency are broken by the word itself, so the result is a pure function of
        the texts (not of their order or of hash seeds).

        Args:
          texts: the corpus, e.g. the train split only, so no test word leaks into the ids.
          size: the largest vocabulary size, PAD and UNK included.

        Raises:
          ValueError: ``size`` leaves no room for a word.
        """
        if size < 3:
            raise ValueError(f"vocabulary size {size} must be at least 3 (PAD, UNK and one word)")
        counts = collections.Counter(w for t in texts for w in tokenize(t))
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([w for w, _ in ranked[: size - 2]])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, texts: Sequence[str | bytes], length: int) -> np.ndarray:
        """Token ids of each text, truncated to its first ``length`` words and padded after.

        Args:
          texts: N texts.
          length: the fixed sequence length.

        Returns:
          ``(N, length)`` int32 ids; unknown words are ``UNK``, padding is ``PAD``.
        """
        out = np.full((len(texts), length), PAD, np.int32)
        for row, t in zip(out, texts):
            ids = [self._ids.get(w, UNK) for w in tokenize(t)[:length]]
            row[: len(ids)] = ids
        return out
