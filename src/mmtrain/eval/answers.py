"""Scoring a generated answer against a reference: exact match and token F1 (SQuAD-style).

Both compare normalised answers: lower case, punctuation removed, the English articles "a",
"an" and "the" removed, whitespace collapsed. Token F1 is the harmonic mean of precision and
recall of the answer's whitespace tokens, counted as a multiset (a word said twice counts
twice), so "a grey cat" against "the cat is grey" scores 0.8 where exact match scores 0.
Two empty answers match (1.0); an empty answer against a non-empty one scores 0.

Document and video benchmarks score differently, and each metric here is the one its
benchmark defines:
- `anls` (DocVQA, Biten et al. 2019, "Scene Text Visual Question Answering"): 1 - the
  normalised Levenshtein distance between the lower-cased, whitespace-collapsed answer and the
  closest reference, 0 where that distance is 0.5 or more (the threshold tau of the paper);
- `relaxed_accuracy` (ChartQA, Masry et al. 2022): a numeric answer is right within 5 % of a
  numeric reference (a trailing "%" ignored), any other answer by exact lower-cased match;
- `character_edits` (transcription): the Levenshtein distance in characters and the reference's
  length, summed over a set and divided to give its character error rate (CER);
- `choice_accuracy` (Video-MME-style multiple choice): the first option letter (A-E) the answer
  gives against the reference's; None when the reference is no option letter.
Edit distances come from rapidfuzz (C++, exact Levenshtein: insertions, deletions and
substitutions of cost 1).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence

from rapidfuzz.distance import Levenshtein

__all__ = [
    "normalize_answer",
    "answer_tokens",
    "exact_match",
    "token_f1",
    "anls",
    "relaxed_accuracy",
    "character_edits",
    "choice_accuracy",
]

ANLS_THRESHOLD = 0.5  # DocVQA's tau: a distance this large scores 0, not partial credit
RELAXED_TOLERANCE = 0.05  # ChartQA: numbers within 5 % of the reference count as right
# An option letter on its own: "B", "(B)", "B.", "B)", "answer: B", "The best answer is B"
_CHOICE = re.compile(r"(?:^|[\s(\[:])([A-E])(?:$|[\s).\],:])")

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


def _docvqa_normal(text: str) -> str:
    return " ".join(text.strip().lower().split())


def anls(prediction: str, references: str | Sequence[str]) -> float:
    """Average normalised Levenshtein similarity of one answer: its best score over the
    references (DocVQA lists several per question)."""
    answer = _docvqa_normal(prediction)
    refs = [references] if isinstance(references, str) else list(references)
    best = 0.0
    for ref in map(_docvqa_normal, refs):
        longest = max(len(answer), len(ref))
        distance = Levenshtein.distance(answer, ref) / longest if longest else 0.0
        best = max(best, 1.0 - distance if distance < ANLS_THRESHOLD else 0.0)
    return best


def _number(text: str) -> float | None:
    try:
        return float(text.strip().rstrip("%").replace(",", ""))
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, reference: str) -> float:
    """1.0 when a numeric answer is within 5 % of the numeric reference (equal when it is 0),
    or a non-numeric one equals it lower-cased; else 0.0."""
    got, want = _number(prediction), _number(reference)
    if got is not None and want is not None:
        if want == 0:
            return float(got == 0)
        return float(abs(got - want) / abs(want) <= RELAXED_TOLERANCE)
    return float(prediction.strip().lower() == reference.strip().lower())


def character_edits(prediction: str, reference: str) -> tuple[int, int]:
    """(character edits from the answer to the reference, the reference's characters): a
    set's CER is the sum of the first over the sum of the second."""
    return Levenshtein.distance(prediction.strip(), reference.strip()), len(reference.strip())


def _choice(text: str) -> str | None:
    found = _CHOICE.search(text.strip())
    return found.group(1) if found else None


def choice_accuracy(prediction: str, reference: str) -> float | None:
    """1.0 / 0.0 when the answer's first option letter is / is not the reference's; None when
    the reference is no option letter (the sample is not multiple choice)."""
    want = _choice(reference) if len(reference.strip()) <= 3 else None
    if want is None:
        return None
    return float(_choice(prediction) == want)
