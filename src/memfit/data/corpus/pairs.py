"""The demo's preference pairs, made from the shipped question/answer records (``qa.jsonl``).

Each record of ``qa.jsonl`` ("Q: What day comes after Wednesday?\\nA:" -> " Thursday.") becomes a pair
whose chosen answer is its own and whose rejected answer is the right form of a wrong answer: the answer
of another question of the same type ("What day comes after"), so both sides are fluent and only the
fact differs. ``memfit train --method dpo`` without ``--data`` trains on these (on the SFT demo model:
``--model runs/<demo run>``), and reward accuracy and margin rise within a few dozen steps.
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
    """``{"prompt", "chosen", "rejected"}`` for every ``qa.jsonl`` record whose type has another answer."""
    records = [json.loads(line) for line in QA.read_text(encoding="utf-8").splitlines() if line.strip()]
    answers: dict[str, list[str]] = {}
    for r in records:
        forms = answers.setdefault(question_type(r["prompt"]), [])
        if r["completion"] not in forms:
            forms.append(r["completion"])
    rng = random.Random(seed)
    pairs = []
    for r in records:
        wrong = [a for a in answers[question_type(r["prompt"])] if a != r["completion"]]
        if wrong:
            pairs.append({"prompt": r["prompt"], "chosen": r["completion"], "rejected": rng.choice(wrong)})
    return pairs
