"""The demo's preference pairs, made from the shipped question/answer records (``qa.jsonl``).

Each record of ``qa.jsonl`` ("Q: What day comes after Wednesday?\\nA:" -> " Thursday.") becomes a pair
whose chosen answer is its own and whose rejected answer has the wrong form: the answer of a question of
another type (" The opposite of big is small.", " April."), so both sides are fluent answers from the
corpus and what differs is whether the answer fits the question. ``memfit train --method dpo`` without
``--data`` trains on these (on the SFT demo model: ``--model runs/<demo run>``), and reward accuracy and
margin rise within a few dozen steps (docs/train.md gives a measured run).

Why the form and not the fact: pairs whose rejected answer was the right form of a wrong fact (" Saturday."
for the day after Wednesday) left reward accuracy at chance after 30 DPO steps. The 300-step SFT demo
model prefers the right fact in only 42% of those pairs (it has not learnt the facts), so DPO would have to
teach about 50 facts from one bit per pair; whether an answer fits its question's type it learns within
a demo's steps (held-out pairs: 42% -> 82% in 30 steps of 4 pairs, lr 1e-4, beta 0.1).
Deterministic: the same seed gives the same pairs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QA = Path(__file__).resolve().parent / "qa.jsonl"


def question_type(prompt: str) -> str:
    """The prompt without its last word ("Q: What day comes after"): questions whose answers share a form."""
    return prompt.rsplit("?", 1)[0].rsplit(" ", 1)[0]


def demo_pairs(seed: int = 0) -> list[dict[str, str]]:
    """``{"prompt", "chosen", "rejected"}`` for every ``qa.jsonl`` record whose rejected answer is the
    answer of a question of another type (module docstring)."""
    records = [json.loads(line) for line in QA.read_text(encoding="utf-8").splitlines() if line.strip()]
    answers: dict[str, list[str]] = {}
    for r in records:
        forms = answers.setdefault(question_type(r["prompt"]), [])
        if r["completion"] not in forms:
            forms.append(r["completion"])
    rng = random.Random(seed)
    pairs = []
    for r in records:
        kind = question_type(r["prompt"])
        wrong = [a for other, forms in answers.items() if other != kind for a in forms]
        if wrong:
            pairs.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": rng.choice(wrong)})
    return pairs
