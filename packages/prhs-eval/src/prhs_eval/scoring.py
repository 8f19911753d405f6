"""Scoring as public benchmarks define it, and readers of their files in the formats they ship.

- GSM8K: the final answer after ``####``; a completion scores by *strict* match (its own
  ``#### N`` line) or *flexible* extraction (its last number), both compared as
  lm-evaluation-harness's ``gsm8k`` task compares them (commas, ``$``, everything up to
  the ``####`` marker and a final period ignored, case ignored).
- CoQA: exact match and token F1 after the official evaluation script's normalisation (lower
  case, no punctuation, no articles, single spaces), each the mean over the gold answers of the
  best score against the others when there are several (the script's leave-one-out), the score
  against the one gold answer otherwise.

- LongBench v2: the letter a completion answers ("The correct answer is (X)"), against the
  item's; the zero-shot prompt the benchmark gives.
- RULER's QA (qa_1 on SQuAD, qa_2 on HotpotQA): the gold paragraphs among seeded distractors
  up to a token budget, in RULER's template; a completion scores when it holds any gold answer.

The readers take local files (no network): GSM8K's JSON lines (``{"question", "answer"}`` a
line, as in its ``test.jsonl``), CoQA's JSON (``{"data": [{"story", "questions",
"answers", "additional_answers"}]}``, as in ``coqa-dev-v1.0.json``), LongBench v2's
``data.json``, SQuAD's and HotpotQA's JSON, and WikiText's ``wiki.test.raw``.
:func:`load_benchmark` reads the same benchmarks from the Hugging Face hub with ``datasets``
when no file is given (a user online).
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
from typing import Any

__all__ = [
    "HUB_DATASETS",
    "LONGBENCH_V2_PROMPT",
    "RULER_QA_TEMPLATE",
    "CoQATurn",
    "GSM8KProblem",
    "LongBenchV2Item",
    "QAItem",
    "coqa_answer",
    "coqa_exact_match",
    "coqa_f1",
    "coqa_normalize",
    "gsm8k_flexible",
    "gsm8k_strict",
    "gsm8k_target",
    "load_benchmark",
    "longbench_v2_choice",
    "longbench_v2_prompt",
    "longbench_v2_score",
    "read_coqa",
    "read_gsm8k",
    "read_hotpotqa",
    "read_longbench_v2",
    "read_squad",
    "read_wikitext",
    "ruler_qa_prompt",
    "ruler_qa_score",
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


def coqa_answer(completion: str) -> str:
    """The answer a completion gives to a CoQA prompt: its text up to the next turn (a blank
    line or ``Q:``, where lm-evaluation-harness stops generating), stripped."""
    text = completion.lstrip()
    for stop in ("\n\n", "Q:"):
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    return text.strip()


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


# --------------------------------------------------------------------------------------------
# LongBench v2


@dataclass(frozen=True)
class LongBenchV2Item:
    """One LongBench v2 question: four choices, one correct letter, its long context."""

    id: str
    domain: str
    sub_domain: str
    difficulty: str
    length: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str
    context: str


#: LongBench v2's zero-shot prompt (its ``0shot.txt``), and the answer format it asks for.
LONGBENCH_V2_PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n{context}\n"
    "</text>\n\nWhat is the correct answer to this question: {question}\nChoices:\n"
    "(A) {A}\n(B) {B}\n(C) {C}\n(D) {D}\n\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)
_LB_ANSWER = (re.compile(r"The correct answer is \(([A-D])\)"),
              re.compile(r"The correct answer is ([A-D])"))  # fmt: skip


def _longbench_item(rec: object, where: str) -> LongBenchV2Item:
    try:
        assert isinstance(rec, dict)
        choices = tuple(str(rec[f"choice_{c}"]) for c in "ABCD")
        answer = str(rec["answer"]).strip()
        item = LongBenchV2Item(
            str(rec["_id"]), str(rec.get("domain", "")), str(rec.get("sub_domain", "")),
            str(rec.get("difficulty", "")), str(rec.get("length", "")), str(rec["question"]),
            choices, answer, str(rec["context"]),  # type: ignore[arg-type]
        )  # fmt: skip
    except (AssertionError, KeyError, TypeError) as e:
        raise ValueError(
            f"{where}: expected an object with '_id', 'question', 'choice_A'..'choice_D', "
            f"'answer' and 'context' ({type(e).__name__}: {e})"
        ) from None
    if answer not in ("A", "B", "C", "D"):
        raise ValueError(f"{where}: 'answer' must be one of A, B, C, D, got {answer!r}")
    return item


def read_longbench_v2(path: str | os.PathLike[str]) -> list[LongBenchV2Item]:
    """LongBench v2's questions from its ``data.json`` (a JSON list) or a JSON-lines file of
    the same objects (``_id``, ``domain``, ``sub_domain``, ``difficulty``, ``length``,
    ``question``, ``choice_A`` .. ``choice_D``, ``answer``, ``context``)."""
    text = _read(path, "LongBench v2").strip()
    if text.startswith("["):
        try:
            recs = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON list ({e})") from None
        return [_longbench_item(r, f"{path}, item {i}") for i, r in enumerate(recs)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not JSON ({e})") from None
            out.append(_longbench_item(rec, f"{path}, line {n}"))
    return out


def longbench_v2_prompt(item: LongBenchV2Item) -> str:
    """The zero-shot prompt of one item (:data:`LONGBENCH_V2_PROMPT`)."""
    a, b, c, d = item.choices
    return LONGBENCH_V2_PROMPT.format(context=item.context, question=item.question,
                                      A=a, B=b, C=c, D=d)  # fmt: skip


def longbench_v2_choice(completion: str) -> str | None:
    """The letter a completion answers, as LongBench v2's evaluation extracts it ("The correct
    answer is (X)", then without the parentheses); ``None`` when it gives none."""
    text = _check_str("completion", completion).replace("*", "")
    for pattern in _LB_ANSWER:
        m = pattern.search(text)
        if m:
            return m.group(1)
    return None


def longbench_v2_score(completion: str, item: LongBenchV2Item) -> float:
    """1.0 when the completion's extracted letter is the item's answer, else 0.0."""
    return float(longbench_v2_choice(completion) == item.answer)


# --------------------------------------------------------------------------------------------
# RULER's QA tasks (qa_1 on SQuAD, qa_2 on HotpotQA)


@dataclass(frozen=True)
class QAItem:
    """A question, its gold answers, and the paragraphs that answer it (``golds``)."""

    id: str
    question: str
    answers: tuple[str, ...]
    golds: tuple[str, ...]


def read_squad(path: str | os.PathLike[str]) -> tuple[list[QAItem], list[str]]:
    """SQuAD's questions (v1.1 or v2.0 JSON: ``data`` → ``paragraphs`` → ``qas``) and every
    paragraph, the pool RULER's qa_1 draws distractors from. Unanswerable v2.0 questions are
    left out."""
    try:
        data = json.loads(_read(path, "SQuAD"))["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected a JSON object with a 'data' list ({e})") from None
    items, paragraphs = [], []
    try:
        for article in data:
            for para in article["paragraphs"]:
                paragraphs.append(para["context"])
                for qa in para["qas"]:
                    answers = tuple(dict.fromkeys(a["text"] for a in qa.get("answers", [])))
                    if qa.get("is_impossible") or not answers:
                        continue
                    items.append(QAItem(str(qa["id"]), qa["question"], answers,
                                        (para["context"],)))  # fmt: skip
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: expected articles with 'paragraphs' of 'context' and 'qas' "
            f"({type(e).__name__}: {e})"
        ) from None
    return items, paragraphs


def read_hotpotqa(path: str | os.PathLike[str]) -> tuple[list[QAItem], list[str]]:
    """HotpotQA's questions (a JSON list of ``_id``, ``question``, ``answer``, ``context``:
    ``[title, [sentences]]`` pairs, and ``supporting_facts``) and every paragraph; an item's
    golds are its supporting paragraphs (all of its context when none is marked)."""
    try:
        data = json.loads(_read(path, "HotpotQA"))
        assert isinstance(data, list)
    except (json.JSONDecodeError, AssertionError) as e:
        raise ValueError(f"{path}: expected a JSON list of questions ({e})") from None
    items, paragraphs = [], []
    try:
        for rec in data:
            paras = {title: f"{title}\n{''.join(sents)}" for title, sents in rec["context"]}
            paragraphs += list(paras.values())
            support = [t for t, _ in rec.get("supporting_facts", []) if t in paras]
            golds = tuple(paras[t] for t in dict.fromkeys(support)) or tuple(paras.values())
            items.append(QAItem(str(rec["_id"]), rec["question"], (str(rec["answer"]),), golds))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: expected '_id', 'question', 'answer' and 'context' [[title, sentences]] "
            f"({type(e).__name__}: {e})"
        ) from None
    return items, paragraphs


RULER_QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
    "question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {query} Answer:"
)


def ruler_qa_prompt(
    item: QAItem,
    pool: Sequence[str],
    *,
    max_tokens: int,
    count: Any = None,
    seed: int = 0,
) -> str:
    """RULER's QA prompt: the item's gold paragraphs among distractors drawn from ``pool``
    (seeded, the golds' own left out), shuffled and numbered ``Document i:``, as many as fit in
    ``max_tokens`` by ``count(text) -> tokens`` (default: whitespace words)."""
    import random

    count = count or (lambda t: len(t.split()))
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rng = random.Random(seed)
    others = [p for p in pool if p not in item.golds]
    rng.shuffle(others)

    def build(docs: Sequence[str]) -> str:
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return RULER_QA_TEMPLATE.format(context=context, query=item.question)

    docs = list(item.golds)
    if count(build(docs)) > max_tokens:
        raise ValueError(
            f"max_tokens={max_tokens} is too small: the question and its gold paragraphs alone "
            f"take {count(build(docs))}"
        )
    lo, hi = 0, len(others)  # the most distractors that fit: a binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(docs + others[:mid])) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    chosen = docs + others[:lo]
    rng.shuffle(chosen)
    return build(chosen)


def ruler_qa_score(completion: str, answers: Sequence[str]) -> float:
    """RULER's QA match (``string_match_part``): 1.0 when any gold answer appears in the
    completion (case-insensitive), else 0.0."""
    pred = _check_str("completion", completion).lower()
    if not answers:
        raise ValueError("a QA item needs at least one gold answer")
    return float(any(_check_str("answer", a).lower() in pred for a in answers))


# --------------------------------------------------------------------------------------------
# WikiText-2, and the public copies on the Hugging Face hub


def read_wikitext(path: str | os.PathLike[str]) -> str:
    """WikiText's raw text from ``wiki.test.raw`` (or any of its raw files), as written."""
    text = _read(path, "WikiText")
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    return text


#: Where :func:`load_benchmark` finds each benchmark with ``datasets`` (users online).
HUB_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "coqa": ("stanfordnlp/coqa", None, "validation"),
    "longbench_v2": ("THUDM/LongBench-v2", None, "train"),
    "wikitext2": ("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
}


def _hub_records(name: str) -> list[dict]:
    repo, config, split = HUB_DATASETS[name]
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"{name}: no local file given, and reading {repo} needs the datasets package "
            "(pip install datasets); or pass the path of a local copy"
        ) from e
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # offline, hub errors: one clear message
        raise OSError(
            f"{name}: could not load {repo} ({split}) with datasets ({type(e).__name__}: {e}); "
            "on a machine without the hub, pass the path of a local copy"
        ) from None
    return [dict(r) for r in ds]


def load_benchmark(name: str, path: str | os.PathLike[str] | None = None) -> Any:
    """A public benchmark from a local file (``path``) or, without one, from its copy on the
    Hugging Face hub with ``datasets`` (:data:`HUB_DATASETS`; needs the network).

    ``gsm8k`` → list of :class:`GSM8KProblem`; ``coqa`` → list of :class:`CoQATurn`;
    ``longbench_v2`` → list of :class:`LongBenchV2Item`; ``wikitext2`` → the test text.
    """
    readers = {"gsm8k": read_gsm8k, "coqa": read_coqa, "longbench_v2": read_longbench_v2,
               "wikitext2": read_wikitext}  # fmt: skip
    if name not in readers:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(readers)}")
    if path is not None:
        return readers[name](path)
    recs = _hub_records(name)
    if name == "gsm8k":
        return [GSM8KProblem(r["question"], r["answer"], gsm8k_target(r["answer"])) for r in recs]
    if name == "longbench_v2":
        return [_longbench_item(r, f"{HUB_DATASETS[name][0]} row {i}") for i, r in enumerate(recs)]
    if name == "wikitext2":
        return "".join(r["text"] for r in recs)
    out = []  # coqa: the hub's columns (questions / answers as parallel lists)
    for s, r in enumerate(recs):
        try:
            qs, ans = r["questions"], r["answers"]["input_text"]
            history: list[tuple[str, str]] = []
            for q, a in zip(qs, ans, strict=True):
                out.append(CoQATurn(str(r.get("id", s)), r["story"], tuple(history), q, (a,)))
                history.append((q, a))
        except (KeyError, TypeError, ValueError) as e:
            what = f"{type(e).__name__}: {e}"
            raise ValueError(f"coqa row {s}: unexpected columns ({what})") from None
    return out
