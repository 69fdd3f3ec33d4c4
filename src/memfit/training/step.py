"""One optimizer step with exact loss normalisation (issue 6), and held-out evaluation.

**Normalisation.** Let micro-batch ``i`` (on any rank) hold loss sum ``S_i`` (sum of per-token
cross-entropies) over ``n_i`` target tokens. The big-batch loss is ``L = sum_i S_i / N`` with
``N = sum_i n_i`` over all micro-batches of the step and all ranks. Each micro-batch therefore
back-propagates ``S_i / N`` (the model's own loss with ``num_items_in_batch=N``), never its own
mean ``S_i / n_i``: with a per-micro-batch mean the sum is the big-batch gradient only when every
``n_i`` is equal (the bug transformers fixed in PR 34191). Two scalings undo what the stack does:
Accelerate's ``backward`` divides by ``gradient_accumulation_steps`` and DDP averages gradients over
the ``P`` ranks, so the loss is multiplied by ``k * P`` before ``backward``. The logged loss is
``sum_i S_i / N``: the true mean per target token of the step, whatever the split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers.loss.loss_utils import ForCausalLMLoss

from memfit.builder import preference
from memfit.data.dataset import collate, count_target_tokens
from memfit.settings.config import Loss
from memfit.spec.batch import model_inputs
from memfit.spec.losses import chunked_micro_loss
from memfit.training.oom import is_oom
from memfit.training.rollback import OptimizerSnapshot
from memfit.training.sharding import reshard_all

#: The parts of a step, in order; an out-of-memory error names the one that raised it.
PHASES = ("forward", "backward", "clip", "optimizer")


class StepOutOfMemory(Exception):
    """An out-of-memory error inside ``train_step``, with the phase that raised it.

    When it leaves ``train_step`` the optimizer state and parameters are as before the step (restored
    from the snapshot if the optimizer step had begun), unless ``restored`` is False: the host had no
    room for the snapshot, so an optimizer-phase OOM could not be undone.
    """

    def __init__(self, phase: str, error: BaseException, restored: bool = True) -> None:
        super().__init__(f"out of memory in the {phase} phase: {error}")
        self.phase, self.error, self.restored = phase, error, restored


@contextmanager
def phase(name: str, snapshot: OptimizerSnapshot | None = None, restorable: bool = True) -> Iterator[None]:
    """Label an out-of-memory error raised inside with the phase ``name``; other errors pass through.

    ``restorable=False``: parameters may have changed inside (optimizer-in-backward), so it cannot be undone."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if not is_oom(err):
            raise
        raise StepOutOfMemory(name, err, restored=restorable and (snapshot is None or snapshot.available)) from err


@dataclass
class StepResult:
    loss: float
    """Mean loss per target token over the whole step (all micro-batches, all ranks)."""
    target_tokens: int
    tokens: int
    """Real (non-pad) input tokens processed by all ranks."""
    skipped: bool
    """fp16: the loss scaler found inf/NaN gradients and skipped the update."""
    grad_norm: float | None
    preference: dict | None = None
    """Preference methods: ``pairs``, ``reward_accuracy``, ``reward_margin``, ``chosen_reward``,
    ``rejected_reward`` of the step's pairs (``memfit.builder.preference.micro_loss``), else None."""


def preference_window(total_steps: int) -> int:
    """How many last steps the summary's closing reward accuracy and margin pool: a quarter of the run, at
    most 20 (one step of a few pairs says little: with 4 pairs its accuracy is 0, 25, 50, 75 or 100%)."""
    return max(1, min(20, total_steps // 4))


def pool_preference(results: list[dict]) -> dict:
    """The reward metrics of several steps' ``StepResult.preference``, each weighted by its pairs (the mean
    over all their pairs), with ``steps``: the first and last step they cover (each result's ``step``)."""
    pairs = sum(r["pairs"] for r in results)
    pooled = {k: sum(r[k] * r["pairs"] for r in results) / max(pairs, 1)
              for k in ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")}
    return {"pairs": pairs, **pooled, "steps": [results[0]["step"], results[-1]["step"]]}


def micro_loss(model, batch: dict, num_items: torch.Tensor, uses_model_loss: bool, vocab_size: int,
               loss: Loss = Loss.STANDARD, autocast=None):
    """``S_i / N`` for one micro-batch: the model's loss with ``num_items_in_batch``, or the same
    function applied to its logits for models whose forward does not take loss kwargs, or (``loss`` not
    standard) the same sum over target tokens divided by ``N`` without the full logits (``memfit.spec.losses``)."""
    if loss is not Loss.STANDARD:
        return chunked_micro_loss(model, batch, num_items, autocast, loss)
    if uses_model_loss:
        return model(**model_inputs(batch), num_items_in_batch=num_items).loss

    inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
    logits = model(**inputs).logits  # (B, T, V)
    return ForCausalLMLoss(logits, batch["labels"], vocab_size, num_items_in_batch=num_items)


@dataclass
class TokenLoss:
    """The next-token loss of ``--method sft``: each micro-batch's ``S_i / N`` (``micro_loss``), ``N`` the step's
    target tokens on all ranks (the module docstring)."""

    uses_model_loss: bool
    """The model's forward takes ``num_items_in_batch`` (transformers' loss kwargs); else its logits are scored."""
    vocab_size: int
    loss: Loss = Loss.STANDARD
    activations_on_cpu: bool = False
    """``--offload activations`` (CUDA): forward's saved tensors go to pinned CPU memory (torch's ``save_on_cpu``)
    and come back when backward needs them."""

    def norms(self, batches: list[dict], n_targets: int, reduce) -> torch.Tensor:  # noqa: ARG002 - one signature
        return torch.tensor(max(n_targets, 1), device=batches[0]["labels"].device)

    def forward(self, model, batch: dict, num_items: torch.Tensor, autocast) -> tuple[torch.Tensor, None]:
        with _saved_tensors_place(self.activations_on_cpu):
            return micro_loss(model, batch, num_items, self.uses_model_loss, self.vocab_size, self.loss, autocast), None

    def metrics(self, stats) -> None:  # noqa: ARG002 - one signature
        return None


@dataclass
class PreferenceRun:
    """The loss of ``--method dpo|orpo|simpo`` on pairs (``memfit.builder.preference``): each micro-batch's share of
    ``sum_p l_p / P`` over the step's real pairs (and ORPO's chosen target tokens), with the reference policy."""

    spec: object
    """``memfit.builder.preference.PreferenceLoss``."""
    reference: object = None
    """A frozen copy of the base (full fine-tune), or None: the LoRA adapter switched off, or precomputed."""

    def norms(self, batches: list[dict], n_targets: int, reduce):  # noqa: ARG002 - one signature
        return preference.step_norms(batches, reduce)

    def forward(self, model, batch: dict, norms, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss share, stats)``: stats are the micro-batch's pairs, correct rankings and reward sums."""
        ref = (preference.reference_sums(batch, model=model, reference=self.reference, autocast=autocast)
               if self.spec.needs_reference else None)
        inputs = {k: v for k, v in model_inputs(batch).items() if k not in ("labels", "ref_logps")}
        logits = model(**inputs, use_cache=False).logits  # (2B, T, V)
        return preference.micro_loss(self.spec, logits, batch["labels"], norms, ref)

    def metrics(self, stats: torch.Tensor) -> dict:
        """``StepResult.preference`` from the step's summed stats (all ranks)."""
        pairs, correct, margin, chosen, rejected = stats.tolist()
        per = max(pairs, 1.0)
        return {"pairs": int(pairs), "reward_accuracy": correct / per, "reward_margin": margin / per,
                "chosen_reward": chosen / per, "rejected_reward": rejected / per}


def train_step(accelerator, model, optimizer, batches: list[dict], step_loss: TokenLoss | PreferenceRun, *,
               max_grad_norm: float, snapshot: OptimizerSnapshot | None = None, in_backward=None) -> StepResult:
    """One optimizer step: accumulate the step's micro-batches (already fetched, so the normalisers are known up
    front) under ``step_loss`` (``TokenLoss`` for sft, ``PreferenceRun`` for dpo/orpo/simpo), clip, step.

    ``in_backward``: an ``OptimizerInBackward`` (``memfit/builder/optim_in_backward.py``) that already stepped
    every parameter during ``backward``; then there is no clipping, and ``optimizer.step()`` does nothing.

    Raises:
        StepOutOfMemory: out of memory in one of ``PHASES``; with ``snapshot``, an OOM inside the
            optimizer step leaves the optimizer and parameters as they were before it. With
            ``in_backward`` an OOM in backward may follow parameter updates: it is marked not restored.
    """
    def reduce(t):
        return accelerator.reduce(t, reduction="sum")

    local = torch.tensor([sum(count_target_tokens(b["labels"]) for b in batches),
                          sum(int(b["attention_mask"].sum()) for b in batches)], device=accelerator.device)
    n_targets, n_tokens = reduce(local).tolist()
    norms = step_loss.norms(batches, n_targets, reduce)
    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes  # undoes Accelerate's and DDP's
    loss_sum, stats = torch.zeros((), device=accelerator.device), None
    snapshot = snapshot or OptimizerSnapshot()
    for batch in batches:
        with accelerator.accumulate(model):
            with phase("forward"):
                value, micro_stats = step_loss.forward(model, batch, norms, accelerator.autocast)
            with phase("backward", restorable=in_backward is None):
                accelerator.backward(value * scale)
            loss_sum += value.detach().float()
            if micro_stats is not None:
                stats = micro_stats.float() if stats is None else stats + micro_stats.float()
            # Drop the graph now, not when the next micro-batch's forward returns: an 8-bit base's autograd
            # functions keep their inputs as ctx attributes until the graph is freed
            # (memory.quantized.int8_input_groups), through the optimizer step and the next forward otherwise.
            del value
    grad_norm = None
    if max_grad_norm > 0 and in_backward is None:  # the optimizer stepped inside backward: nothing to clip
        with phase("clip"):
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))
    with phase("optimizer", snapshot), snapshot.guard(optimizer):
        optimizer.step()
    optimizer.zero_grad(set_to_none=not _grads_in_ddp_buckets(model))
    return StepResult(loss=float(reduce(loss_sum)), target_tokens=int(n_targets), tokens=int(n_tokens),
                      skipped=bool(optimizer.step_was_skipped), grad_norm=grad_norm,
                      preference=step_loss.metrics(reduce(stats)) if stats is not None else None)


def _grads_in_ddp_buckets(model) -> bool:
    """Whether ``model`` is DDP with gradient bucket views (``sharding.accelerator_kwargs``): its gradients are
    then zeroed in place, not set to None. A None gradient is re-pointed into its bucket only when DDP
    all-reduces it, so the micro-batches before the last (``no_sync``) would accumulate into fresh tensors
    beside the resident buckets: a second copy of every gradient until the last micro-batch's backward."""
    return isinstance(model, DistributedDataParallel) and bool(model.gradient_as_bucket_view)


def _saved_tensors_place(on_cpu: bool):
    """Where forward's saved tensors live: the device, or pinned CPU memory (copied back in backward)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True) if on_cpu else contextlib.nullcontext()


@torch.no_grad()
def evaluate(accelerator, model, rows: list[dict], *, pad_id: int, batch_size: int, vocab_size: int) -> float:
    """Mean loss per target token over the held-out rows (each rank takes every P-th row; sums reduced)."""
    if not len(rows):
        return float("nan")
    net = accelerator.unwrap_model(model)  # no DDP: ranks may hold different numbers of eval batches
    was_training = net.training
    net.eval()
    # Row indices, not rows: held-out rows on disk (memfit.data.arrow) are read a batch at a time.
    mine = range(accelerator.process_index, len(rows), accelerator.num_processes)
    # Every rank runs the same number of batches (FSDP2's forward is collective): a rank with fewer rows
    # pads with a copy of a row whose labels are all ignored (it adds no loss and no target token).
    per_rank = -(-len(rows) // accelerator.num_processes)
    filler = {**rows[0], "labels": [-100] * len(rows[0]["labels"])}
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (loss sum, targets)
    one = torch.tensor(1, device=accelerator.device)
    for start in range(0, per_rank, batch_size):
        chunk = [rows[i] for i in mine[start : start + batch_size]]
        chunk += [filler] * (min(batch_size, per_rank - start) - len(chunk))
        batch = {k: v.to(accelerator.device) for k, v in collate(chunk, pad_id).items()}
        with accelerator.autocast():
            logits = net(**{k: v for k, v in model_inputs(batch).items() if k != "labels"}).logits
        sums[0] += ForCausalLMLoss(logits, batch["labels"], vocab_size, num_items_in_batch=one).double()
        sums[1] += count_target_tokens(batch["labels"])
        del logits  # else this batch's logits live through the next batch's forward (+B T V; measured: phase_peaks)
    net.train(was_training)

    reshard_all(net)  # ZeRO-2 keeps every layer gathered through a no-grad forward: free them now
    loss_sum, n = accelerator.reduce(sums, reduction="sum").tolist()
    return loss_sum / n if n else float("nan")
