"""End-of-run samples: the trained model continues the beginnings of held-out documents.

A prompt is what a document starts with, framed as in training (``[bos] + tokens``, see
``memfit.data.dataset.encode_docs``): for plain text its first ``PROMPT_CHARS`` characters cut back to a word
boundary (the shipped stories give ``"Once upon a time"``), for a prompt/completion record its whole
prompt (the model should answer it). Starting where documents start, rather than inside a packed
chunk, shows whether the model learned the documents' structure. Sampling is seeded and at a low
temperature, so a run's samples are reproducible and still differ when prompts coincide.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from memfit.data.formats import as_dicts
from memfit.files import append_line
from memfit.memory.outside import MAX_NEW_TOKENS, PROMPT_CHARS  # the generation's KV cache is predicted there
from memfit.spec.engines import is_sharded
from memfit.training.rollback import RngState

if TYPE_CHECKING:  # the session imports what imports this module (training.finish): a type only
    from memfit.training.session import TrainSession

TEMPERATURE = 0.6


def prompt_text(example) -> str:
    """The beginning of a document that a sample continues (a conversation: its first user turn)."""
    if example.is_conversation:
        return next(turn[1] for turn in example.messages if turn[0] == "user")
    if example.is_prompt_completion:
        return example.prompt
    text = example.text.strip()
    if len(text) <= PROMPT_CHARS:
        return text
    head = text[:PROMPT_CHARS]
    if text[PROMPT_CHARS].isalnum() and " " in head:  # mid-word: cut back to the last whole word
        head = head[: head.rindex(" ")]
    return head.rstrip()


def conversation_prompt(example) -> tuple:
    """The turns before a conversation's first assistant reply (system and user turns)."""
    first = next(i for i, turn in enumerate(example.messages) if turn[0] == "assistant")
    return example.messages[:first]


def prompt_ids(tokenizer, text: str, example=None) -> list[int]:
    """``[bos] + tokens`` exactly as training frames a document start (bos only when distinct from eos);
    for a conversation, its turns before the first reply rendered by the chat template with the
    generation prompt (the assistant's header), as in training."""
    if example is not None and example.is_conversation:
        turns = as_dicts(conversation_prompt(example))
        rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head = [bos] if bos is not None and bos != eos else []
    return head + tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_samples(accelerator, net, tokenizer, examples: list, *, count: int, seed: int,
                     max_positions: int | None = None) -> list[dict[str, Any]]:
    """``count`` continuations, ``[{"prompt": ..., "completion": ...}]``, of the first ``count`` documents.

    ``examples`` are the held-out documents (the caller falls back to training documents when none were
    held out). Generation stops at eos or after ``MAX_NEW_TOKENS`` (fewer when the model has fewer
    positions left).
    """
    out = []
    torch.manual_seed(seed)
    was_training = net.training
    net.eval()
    with torch.no_grad(), accelerator.autocast():
        for example in examples[:count]:
            text = prompt_text(example)
            ids = torch.tensor([prompt_ids(tokenizer, text, example)], device=accelerator.device)  # (1, T)
            room = MAX_NEW_TOKENS if max_positions is None else min(MAX_NEW_TOKENS, max_positions - ids.shape[1])
            if room < 1:
                continue
            new = net.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=room,
                               do_sample=True, temperature=TEMPERATURE, top_k=0, use_cache=True,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            completion = tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True)
            sample = {"prompt": text, "completion": completion}
            if example.is_conversation:
                sample["reply"] = True  # the completion answers the prompt; it does not continue its text
            out.append(sample)
    net.train(was_training)
    return out


SAMPLES_FILE = "samples.jsonl"
"""Samples taken during the run (``--eval-samples``), one JSON object per sample, appended."""


def samples_at_eval(s: TrainSession) -> list[dict[str, Any]]:
    """``--eval-samples N``: after an evaluation, N samples from the same held-out prompts as the end-of-run
    samples (conversations through the chat template), appended to ``samples.jsonl`` as
    ``{"step", "prompt", "completion"}`` (and ``"reply": true`` for a conversation's answer) and shown above the progress bar; the same seed each time, so
    samples of successive evaluations differ only by what the model learned in between.

    Main process only, and only when each process holds the whole model: a sharded model's forward is
    collective, so its samples wait for the end of the run (where the gathered copy generates them).
    """
    count = s.config.cadence.eval_samples
    if count <= 0 or not s.is_main or is_sharded(s.run):
        return []

    net = s.accelerator.unwrap_model(s.model, keep_torch_compile=False)
    rng = RngState.capture()  # sampling seeds the generators; training goes on with the state it had
    try:
        out = generate_samples(s.accelerator, net, s.bundle.tokenizer, s.held_out.prompt_docs, count=count,
                               seed=s.config.seed, max_positions=getattr(net.config, "max_position_embeddings", None))
    finally:
        rng.restore()

    for sample in out:
        append_line(s.output / SAMPLES_FILE, json.dumps({"step": s.state.step, **sample}))
    for sample in out:
        s.report.bar.note(f"sample at step {s.state.step}: {sample['prompt']!r} -> {sample['completion']!r}")
    return out
