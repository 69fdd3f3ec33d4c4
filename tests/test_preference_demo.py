"""The demo of preference tuning (issue 26): the SFT demo model, then a short DPO run on the demo's pairs
(``memfit.data.corpus.pairs``: the right answer against the answer of a question of another type); reward
accuracy and reward margin rise, and the summary shows them."""

from __future__ import annotations

import pytest

from memfit.report.summary import summary_table
from memfit.settings.config import RunConfig, TrainConfig
from memfit.training.loop import run_training


def test_demo_pairs_reject_the_answer_of_another_question_type():
    import json

    from memfit.data.corpus.pairs import QA, demo_pairs, question_type

    pairs = demo_pairs()
    answers = {}  # each answer's question type, from the records
    for line in QA.read_text().splitlines():
        record = json.loads(line)
        answers[record["completion"]] = question_type(record["prompt"])
    assert len(pairs) == 500
    for p in pairs:
        assert answers[p["chosen"]] == question_type(p["prompt"]) != answers[p["rejected"]]
    assert demo_pairs() == pairs  # deterministic


@pytest.mark.slow
def test_dpo_on_an_sft_model_raises_reward_accuracy_and_margin(tmp_path):
    """The documented demo (docs/train.md: the 300-step SFT demo, then 30 DPO steps), shortened: 60 SFT steps on
    the question/answer records alone (the demo's 60 steps of mostly stories leave a model that has not met the
    answers' forms: 54% over the last steps at lr 3e-4), then the documented DPO run. At step 1 the policy is its
    reference (every reward 0); over the last quarter of the steps most pairs rank right."""
    from memfit.data.corpus.pairs import QA

    sft = TrainConfig.of(model="tiny", data=str(QA), max_steps=60, lr=2e-3, warmup_steps=5, samples=0,
                      eval_every=0, output=str(tmp_path / "sft"))
    run_training(sft, show=False)
    dpo = TrainConfig.of(model=str(tmp_path / "sft"), run=RunConfig.of(method="dpo", seq_len=48, micro_batch=4),
                      max_steps=30, lr=1e-4, samples=0, eval_every=0, output=str(tmp_path / "dpo"))
    summary = run_training(dpo, show=False).summary.to_dict()
    first, last = summary["preference"]["first"], summary["preference"]["last"]
    assert first["steps"] == [1, 1] and last["steps"] == [24, 30] and last["pairs"] == 28
    assert first["reward_accuracy"] == 0 and first["reward_margin"] == 0  # the policy is the reference
    assert last["reward_accuracy"] >= 0.6 and last["reward_margin"] > 0.4  # measured: 68%, +0.767
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(summary_table(summary))
    assert "0% at step 1 -> 68% over steps 24-30 (28 pairs)" in console.export_text()
