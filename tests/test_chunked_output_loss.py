"""torchtune's ``CEWithChunkedOutputLoss`` (``Stack.chunked_output_loss``, ``memory.stack_terms.chunked_output_logits``),
measured on real tensors: the loss as torchtune 0031bfb writes it (``ce_chunked_output_loss.py``, quoted below), eager
and with ``compute_cross_entropy`` compiled (``training.compile_loss``), under memfit's tensor counter.

Shapes: B = 2 rows of T = 256 tokens, vocabulary V = 4,096, 8 chunks: N = 2,097,152 logits, n = 262,144 a chunk, bf16.
Beside the priced terms the loss makes the labels' reshaped chunks (int64, 2 x 256 x 8 = 4,096 B in all) and a few
scalars; compiled, each chunk's graph also saves two fp32 statistics per row (512 rows: 4,096 B). Not priced; 8,208 B
at most measured here, so the bound below is 12 KiB, under 0.3% of the smallest term checked.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from _loss_helpers import head_and_loss_peaks
from memfit.memory.activations import Precisions
from memfit.memory.measure import counted, counted_compiled
from memfit.memory.stack_terms import OUTPUT_CHUNKS, chunked_output_logits
from memfit.settings.config import RunConfig
from memfit.spec.model import load_spec

B, T, H, V = 2, 256, 64, 4096
UNPRICED = 12 * 1024


def compute_cross_entropy(logits, labels):
    """torchtune 0031bfb ``CEWithChunkedOutputLoss.compute_cross_entropy``."""
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def _measured(score, count) -> tuple[int, int]:
    """(forward's peak, backward's peak) beyond the hidden states, head and labels: the head's output in chunks
    (``TransformerDecoder``'s ``[self.output(chunk) for chunk in h.chunk(num_output_chunks, dim=1)]``), the loss's
    ``forward`` (its lines below), then the recipe's ``del logits`` and ``loss.backward()``."""

    def run_loss(hidden, head, labels):
        logits = [F.linear(chunk, head) for chunk in hidden.chunk(OUTPUT_CHUNKS, dim=1)]
        total_elements = (labels != -100).sum()
        chunk_labels = [target_chunk.reshape(-1) for target_chunk in labels.chunk(OUTPUT_CHUNKS, dim=1)]
        logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, chunk_labels, strict=True):
            total_loss += score(logits_chunk, labels_chunk)
        return total_loss / total_elements, logits

    return head_and_loss_peaks(run_loss, (B, T, H, V), count)


def _priced(compile_: bool):
    spec = dataclasses.replace(load_spec("tiny"), vocab_size=V)
    run = RunConfig.of(seq_len=T, micro_batch=B, dtype="bf16", mixed_precision="no", loss="chunked", compile=compile_)
    return chunked_output_logits(spec, run, Precisions.of(run), compiled=compile_)


def test_eager_keeps_every_chunks_fp32_log_probabilities():
    """Forward peaks at the last chunk: the bf16 chunks (2 N), the fp32 log-softmax output each chunk saved (4 N) and
    the last chunk's fp32 copy (4 n): 13,631,488 B. Backward starts with the saved outputs and one chunk's two fp32
    gradients: 4 N + 8 n = 10,485,760 B (the bf16 chunks were deleted)."""
    terms = _priced(False)
    forward, backward = _measured(compute_cross_entropy, counted)
    assert (terms.forward, terms.backward) == (13_631_488, 10_485_760)
    assert 0 <= forward - terms.forward <= UNPRICED and 0 <= backward - terms.backward <= UNPRICED


def test_compiled_keeps_every_bf16_chunk_instead():
    """``training.compile_loss``: the fused upcast and cross-entropy saves its bf16 input, not fp32 log-probabilities:
    the chunks (2 N = 4,194,304 B) live through forward and backward, + one chunk's bf16 gradient (2 n) in backward:
    4,718,592 B. The second call is measured (the first compiles, and runs backward's graph before it is cached)."""
    terms = _priced(True)
    score = torch.compile(compute_cross_entropy)
    _measured(score, counted_compiled)
    forward, backward = _measured(score, counted_compiled)
    assert (terms.forward, terms.backward) == (4_194_304, 4_718_592)
    assert 0 <= forward - terms.forward <= UNPRICED and 0 <= backward - terms.backward <= UNPRICED


def test_a_torchtune_config_names_the_loss_and_whether_it_is_compiled(tmp_path):
    """torchtune's 1B LoRA config (``loss: CEWithChunkedOutputLoss``, ``compile: False``) sets the stack's loss; with
    ``compile: True`` the recipe compiles ``compute_cross_entropy`` (``training.compile_loss``). Micro-batch 4 x 256,
    V 128,256: N = 131,334,144 logits, n = N / 8. Eager, the peak's logits are forward's at the last chunk: the bf16
    chunks, every chunk's fp32 log-probabilities and the last one's fp32 copy, 2 N + 4 N + 4 n = 853,671,936 B;
    compiled, backward's: the bf16 chunks and one chunk's bf16 gradient, 2 N + 2 n = 295,501,824 B."""
    from pathlib import Path

    from memfit.interop import read
    from memfit.memory.estimate import estimate

    source = Path(__file__).parent / "data" / "interop" / "torchtune_1B_lora_single_device.yaml"
    eager = read(source)
    compiled_file = tmp_path / "compiled.yaml"
    compiled_file.write_text(source.read_text().replace("\ncompile: False", "\ncompile: True"))
    compiled = read(compiled_file)
    assert (eager.stack.chunked_output_loss, eager.stack.compiled_loss) == (True, False)
    assert (compiled.stack.chunked_output_loss, compiled.stack.compiled_loss) == (True, True)
    assert not compiled.run.compile  # the layers stay priced eager: only the loss's term changes
    assert estimate(eager.model, eager.run, stack=eager.stack).logits == 853_671_936
    assert estimate(compiled.model, compiled.run, stack=compiled.stack).logits == 295_501_824
