"""Scoring a generated answer against a reference: exact match and token F1 (SQuAD-style).

Both compare normalised answers: lower case, punctuation removed, the English articles "a",
"an" and "the" removed, whitespace collapsed. Token F1 is the harmonic mean of precision and
recall of the answer's whitespace tokens, counted as a multiset (a word said twice counts
twice), so "a grey cat" against "the cat is grey" scores 0.8 where exact match scores 0.
Two empty answers match (1.0); an empty answer against a non-empty one scores 0.
"""

from __future__ import annotations

import string
import unicodedata
from collections import Counter

__all__ = ["normalize_answer", "answer_tokens", "exact_match", "token_f1"]

ARTICLES = frozenset({"a", "an", "the"})
_PUNCTUATION = set(string.punctuation)


def _is_punctuation(ch: str) -> bool:
    # ASCII punctuation and every Unicode punctuation category (curly quotes, dashes, ...).
    return ch in _PUNCTUATION or unicodedata.category(ch).startswith("P")


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    # Deleted, not replaced by a space, as SQuAD's script does ("don't" -> "dont"), so the
    # numbers compare with those other tools report.
    kept = "".join(ch for ch in text.lower() if not _is_punctuation(ch))
    return " ".join(word for word in kept.split() if word not in ARTICLES)


def answer_tokens(text: str) -> list[str]:
    """The whitespace tokens of the normalised answer."""
    return normalize_answer(text).split()


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised answers are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """Harmonic mean of token precision and recall (multiset overlap of normalised tokens)."""
    predicted, expected = answer_tokens(prediction), answer_tokens(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
