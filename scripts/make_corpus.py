#!/usr/bin/env python3
"""Generate memfit's shipped demo corpus (``src/memfit/data/corpus/``), deterministically.

The corpus is what ``memfit train`` (no arguments) trains the ``tiny`` preset on in a few CPU
minutes, so it must be learnable from ~100k-300k byte tokens and the learning must be visible:

* ``stories.txt``: short templated stories and fact paragraphs, documents separated by blank
  lines. Small word lists in fixed sentence frames, with names and pronouns that agree within
  a story, so a byte-level model first learns the words, then the frames, then the agreement.
* ``qa.jsonl``: prompt/completion records (days, months, opposites, colours, counting) whose
  answers follow from the question; the loss is taken on the completion only.

Same seed, same bytes: ``python scripts/make_corpus.py`` rewrites the files identically (a test
checks this). Standard library only, so it runs without the package installed.

Usage:
    python scripts/make_corpus.py [--out DIR] [--stories N] [--qa N] [--seed S]
    python scripts/make_corpus.py --bytes 2e9 --out /tmp/big   # a large stories.txt only, streamed

``--bytes B`` writes only ``stories.txt``, the same kind of documents until it holds at least B bytes,
written a document at a time (memory stays flat whatever B): the corpus-larger-than-RAM measurement
(``bench/data_scale.py``). Put it outside the repository (``/tmp``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "src" / "memfit" / "corpus"
N_STORIES, N_QA, SEED = 1200, 500, 0
"""The shipped corpus' settings (a test regenerates it with these and compares bytes)."""

NAMES = {  # name -> (subject, object, possessive) pronouns
    **{n: ("she", "her", "her") for n in ("Lily", "Mia", "Anna", "Sara", "Emma", "Rosa", "Nina", "Lucy")},
    **{n: ("he", "him", "his") for n in ("Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Finn", "Oscar")},
}
ANIMALS = ("cat", "dog", "rabbit", "fox", "bear", "mouse", "duck", "frog", "owl", "pig")
ADJECTIVES = ("little", "small", "happy", "brave", "kind", "curious", "sleepy", "clever")
HOMES = ("small house", "big tree", "cozy hole", "old barn", "warm nest", "blue boat")
PLACES = ("river", "forest", "lake", "hill", "sea", "garden", "village", "farm")
ACTIVITIES = (
    "play in the sun",
    "sing songs",
    "read books",
    "run in the grass",
    "eat apples",
    "look at the clouds",
    "dig in the sand",
    "swim in the water",
)
COLORS = ("red", "blue", "green", "yellow", "white", "black", "pink", "orange")
OBJECTS = ("ball", "box", "hat", "key", "kite", "shell", "cup", "book")
SPOTS = ("a tree", "a rock", "the bed", "a big leaf", "the table", "a bush")
FEELINGS = ("happy", "surprised", "excited", "proud", "glad")
ENDINGS = (
    "played with the {obj} all day",
    "shared the {obj} and laughed",
    "put the {obj} on a shelf and went to sleep",
    "took the {obj} to the {place} and had fun",
)
WEATHER = ("sunny", "rainy", "windy", "cold", "warm", "cloudy")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "day": "night",
    "fast": "slow",
    "happy": "sad",
    "old": "new",
    "open": "closed",
    "wet": "dry",
    "light": "dark",
}
THINGS_COLORS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "sun": "yellow",
    "night": "black",
    "apple": "red",
    "orange": "orange",
    "sea": "blue",
}


def a(word: str) -> str:
    """The word with its indefinite article: ``a kite``, ``an orange kite``."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("x", "s", "sh", "ch")) else "s")


def story(rng: random.Random) -> str:
    """One templated story; the hero's name and pronouns agree throughout."""
    name, friend = rng.sample(sorted(NAMES), 2)
    he, him, his = NAMES[name]
    animal, friend_animal = rng.sample(ANIMALS, 2)
    obj, color, place = rng.choice(OBJECTS), rng.choice(COLORS), rng.choice(PLACES)
    ending = rng.choice(ENDINGS).format(obj=obj, place=place)
    return (
        f"Once upon a time, there was {a(rng.choice(ADJECTIVES))} {animal} named {name}. "
        f"{name} lived in {a(rng.choice(HOMES))} near the {place}. "
        f"Every day, {he} liked to {rng.choice(ACTIVITIES)}. "
        f"One {rng.choice(WEATHER)} morning, {name} found {a(color)} {obj} under {rng.choice(SPOTS)}. "
        f"{he.capitalize()} was very {rng.choice(FEELINGS)}. "
        f"{name} showed the {color} {obj} to {his} friend {friend} the {friend_animal}. "
        f"{friend} smiled at {him}. Together they {ending}. The end."
    )


def facts(rng: random.Random) -> str:
    """A paragraph of small facts about one character: counts, a day, a month, the weather."""
    name = rng.choice(sorted(NAMES))
    he, _, his = NAMES[name]
    count, day = rng.randrange(2, 10), rng.randrange(7)
    month = rng.randrange(12)
    obj = rng.choice(OBJECTS)
    return (
        f"{name} has {NUMBERS[count]} {plural(obj)}. {he.capitalize()} gives one {obj} away. "
        f"Now {name} has {NUMBERS[count - 1]} {plural(obj)}.\n"
        f"Today is {DAYS[day]}. Tomorrow is {DAYS[(day + 1) % 7]}.\n"
        f"{name}'s birthday is in {MONTHS[month]}. The month after {MONTHS[month]} is {MONTHS[(month + 1) % 12]}.\n"
        f"The weather is {rng.choice(WEATHER)}, so {name} wears {his} {rng.choice(COLORS)} hat."
    )


def qa(rng: random.Random) -> dict[str, str]:
    """A question whose answer is a fixed fact (a prompt/completion record)."""
    kind = rng.randrange(5)
    if kind == 0:
        d = rng.randrange(7)
        return {"prompt": f"Q: What day comes after {DAYS[d]}?\nA:", "completion": f" {DAYS[(d + 1) % 7]}."}
    if kind == 1:
        m = rng.randrange(12)
        return {
            "prompt": f"Q: What month comes after {MONTHS[m]}?\nA:",
            "completion": f" {MONTHS[(m + 1) % 12]}.",
        }
    if kind == 2:
        word = rng.choice(sorted(OPPOSITES))
        return {
            "prompt": f"Q: What is the opposite of {word}?\nA:",
            "completion": f" The opposite of {word} is {OPPOSITES[word]}.",
        }
    if kind == 3:
        thing = rng.choice(sorted(THINGS_COLORS))
        return {
            "prompt": f"Q: What color is the {thing}?\nA:",
            "completion": f" The {thing} is {THINGS_COLORS[thing]}.",
        }
    n = rng.randrange(9)
    return {
        "prompt": f"Q: What number comes after {NUMBERS[n]}?\nA:",
        "completion": f" {NUMBERS[n + 1].capitalize()}.",
    }


def generate(n_stories: int, n_qa: int, seed: int) -> tuple[str, str]:
    """The text of ``stories.txt`` and ``qa.jsonl``; three stories for every fact paragraph."""
    rng = random.Random(seed)
    docs = [facts(rng) if i % 4 == 3 else story(rng) for i in range(n_stories)]
    records = [qa(rng) for _ in range(n_qa)]
    return "\n\n".join(docs) + "\n", "".join(json.dumps(r) + "\n" for r in records)


def write_large(out: Path, n_bytes: int, seed: int) -> int:
    """``stories.txt`` of at least ``n_bytes`` bytes (three stories for every fact paragraph, as ``generate``),
    streamed to disk; returns the bytes written."""
    rng = random.Random(seed)
    written, i = 0, 0
    out.mkdir(parents=True, exist_ok=True)
    with (out / "stories.txt").open("w", encoding="utf-8") as fh:
        while written < n_bytes:
            doc = (facts(rng) if i % 4 == 3 else story(rng)) + "\n\n"
            fh.write(doc)
            written += len(doc.encode())
            i += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: the package's)"
    )
    parser.add_argument("--stories", type=int, default=N_STORIES, help="documents in stories.txt")
    parser.add_argument("--qa", type=int, default=N_QA, help="records in qa.jsonl")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--bytes", type=float, default=None,
                        help="write only stories.txt, at least this many bytes, streamed (e.g. 2e9)")
    args = parser.parse_args()
    if args.bytes is not None:
        if args.out == DEFAULT_OUT:
            parser.error("--bytes needs --out DIR outside the package (e.g. /tmp/big)")
        n = write_large(args.out, int(args.bytes), args.seed)
        print(f"wrote {args.out}: stories.txt {n:,} bytes")
        return
    stories, qa_lines = generate(args.stories, args.qa, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stories.txt").write_text(stories, encoding="utf-8")
    (args.out / "qa.jsonl").write_text(qa_lines, encoding="utf-8")
    print(
        f"wrote {args.out}: stories.txt {len(stories.encode()):,} bytes, qa.jsonl {len(qa_lines.encode()):,} bytes"
    )


if __name__ == "__main__":
    main()
