"""Scoring as public benchmarks define it, and readers of their files in the formats they ship.

- GSM8K: the final answer after ``####``; a completion scores by *strict* match (its own
  ``#### N`` line) or *flexible* extraction (its last number), both compared as
  lm-evaluation-harness's ``gsm8k`` task compares them (commas, ``$``, everything up to
  the ``####`` marker and a final period ignored, case ignored).
- CoQA: exact match and token F1 after the official evaluation script's normalisation (lower
  case, no punctuation, no articles, single spaces), each the mean over the gold answers of the
  best score against the others when there are several (the script's leave-one-out), the score
  against the one gold answer otherwise.

The readers take local files (no network): GSM8K's JSON lines (``{"question", "answer"}`` a
line, as in its ``test.jsonl``) and CoQA's JSON (``{"data": [{"story", "questions",
"answers", "additional_answers"}]}``, as in ``coqa-dev-v1.0.json``).
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CoQATurn",
    "GSM8KProblem",
    "coqa_exact_match",
    "coqa_f1",
    "coqa_normalize",
    "gsm8k_flexible",
    "gsm8k_strict",
    "gsm8k_target",
    "read_coqa",
    "read_gsm8k",
]

#: GSM8K's strict answer: the completion's own ``#### N``.
GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
#: GSM8K's flexible answer: the completion's last number.
GSM8K_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_GSM8K_IGNORE = tuple(re.compile(p) for p in (r",", r"\$", r"(?s).*#### ", r"\.$"))
_INVALID = "[invalid]"


def _gsm8k_normalize(text: str) -> str:
    for pattern in _GSM8K_IGNORE:
        text = pattern.sub("", text)
    return text.strip().lower()


def _check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def gsm8k_target(answer: str) -> str:
    """The final answer of a GSM8K ``answer`` field (its worked solution ending in ``#### N``),
    as the scorers compare it: ``"#### 1,200."`` gives ``"1200"``."""
    return _gsm8k_normalize(_check_str("answer", answer))


def gsm8k_strict(completion: str, answer: str) -> float:
    """1.0 when the completion's first ``#### N`` is the answer (strict match), else 0.0."""
    m = GSM8K_STRICT.search(_check_str("completion", completion))
    pred = m.group(1) if m else _INVALID
    return float(_gsm8k_normalize(pred) == gsm8k_target(answer))


def gsm8k_flexible(completion: str, answer: str) -> float:
    """1.0 when the completion's last number is the answer (flexible extraction), else 0.0."""
    found = GSM8K_FLEXIBLE.findall(_check_str("completion", completion))
    pred = next((g for g in found[-1] if g), _INVALID) if found else _INVALID
    return float(_gsm8k_normalize(pred) == gsm8k_target(answer))


def coqa_normalize(text: str) -> str:
    """CoQA's (and SQuAD's) answer normalisation: lower case, punctuation and the articles
    *a*, *an*, *the* removed, whitespace collapsed."""
    text = _check_str("text", text).lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _exact(gold: str, pred: str) -> float:
    return float(coqa_normalize(gold) == coqa_normalize(pred))


def _f1(gold: str, pred: str) -> float:
    g, p = coqa_normalize(gold).split(), coqa_normalize(pred).split()
    if not g or not p:  # an empty answer ("unknown" normalises to a word, so this is rare)
        return float(g == p)
    common = sum((Counter(g) & Counter(p)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def _over_golds(fn, golds: Sequence[str], pred: str) -> float:
    golds = [_check_str("gold answer", g) for g in golds]
    if not golds:
        raise ValueError("a CoQA turn needs at least one gold answer")
    _check_str("prediction", pred)
    if len(golds) == 1:
        return fn(golds[0], pred)
    total = 0.0
    for i in range(len(golds)):  # each gold left out in turn: the best against the others
        total += max(fn(g, pred) for g in golds[:i] + golds[i + 1 :])
    return total / len(golds)


def coqa_exact_match(golds: Sequence[str], pred: str) -> float:
    """CoQA's exact match of ``pred`` against a turn's gold answers."""
    return _over_golds(_exact, golds, pred)


def coqa_f1(golds: Sequence[str], pred: str) -> float:
    """CoQA's token F1 of ``pred`` against a turn's gold answers."""
    return _over_golds(_f1, golds, pred)


@dataclass(frozen=True)
class GSM8KProblem:
    """One GSM8K problem: the question, the worked answer, and its final answer (``target``)."""

    question: str
    answer: str
    target: str


@dataclass(frozen=True)
class CoQATurn:
    """One CoQA question: the story it is about, the conversation before it (question, answer)
    pairs, the question, and its gold answers (the main one first)."""

    story_id: str
    story: str
    history: tuple[tuple[str, str], ...]
    question: str
    answers: tuple[str, ...]


def _read(path: str | os.PathLike[str], what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no file at {p}")
    return p.read_text(encoding="utf-8")


def read_gsm8k(path: str | os.PathLike[str]) -> list[GSM8KProblem]:
    """GSM8K problems from a JSON-lines file of ``{"question": ..., "answer": ...}`` objects
    (GSM8K's ``train.jsonl`` / ``test.jsonl``). Raises ``ValueError`` naming the line of a
    malformed record."""
    out = []
    for n, line in enumerate(_read(path, "GSM8K").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            q, a = rec["question"], rec["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}, line {n}: expected a JSON object with 'question' and 'answer' ({e})"
            ) from None
        if not isinstance(q, str) or not isinstance(a, str) or "####" not in a:
            raise ValueError(f"{path}, line {n}: 'answer' must be a string ending in '#### N'")
        out.append(GSM8KProblem(q, a, gsm8k_target(a)))
    return out


def read_coqa(path: str | os.PathLike[str]) -> list[CoQATurn]:
    """Every question of a CoQA file (``{"data": [story, ...]}``, each story with ``id``,
    ``story``, ``questions`` and ``answers`` lists of ``{"turn_id", "input_text"}`` and, in the
    dev set, ``additional_answers``: three more answer lists), in story and turn order."""
    try:
        data = json.loads(_read(path, "CoQA"))["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected a JSON object with a 'data' list ({e})") from None
    out = []
    for s, story in enumerate(data):
        try:
            qs = sorted(story["questions"], key=lambda t: t["turn_id"])
            ans = {t["turn_id"]: t["input_text"] for t in story["answers"]}
            extra = [
                {t["turn_id"]: t["input_text"] for t in lst}
                for lst in story.get("additional_answers", {}).values()
            ]
            history: list[tuple[str, str]] = []
            for t in qs:
                tid = t["turn_id"]
                golds = (ans[tid], *(e[tid] for e in extra if tid in e))
                turn = CoQATurn(
                    str(story["id"]), story["story"], tuple(history), t["input_text"], golds
                )
                out.append(turn)
                history.append((t["input_text"], ans[tid]))
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"{path}, story {s}: expected 'id', 'story', 'questions' and 'answers' with "
                f"'turn_id' and 'input_text' ({type(e).__name__}: {e})"
            ) from None
    return out
