"""What TRL's ``SFTTrainer`` holds for its LM head and loss (``--loss trl``): read by estimate, ``--from`` a TRL
file, ``plan --emit trl`` and the Trainer callback alike.

Since TRL 1.14 ``SFTTrainer`` patches the model with a fused LM head (``trl.trainer.utils.add_fused_lm_head``)
and its ``compute_loss`` calls ``model(**inputs, fused_lm_head=True)``: the backbone runs, its last hidden
state is cut to the ``B (T - 1)`` positions that have a next token (``[:, :-1]``, copied when flattened; on
CUDA ``hidden[mask]`` keeps only the labelled ones) and ``trl.kernels.ChunkedLogProbFunction`` computes the
per-token log-probabilities, the entropy and whether the label is the top-1 token (the ``entropy`` and
``mean_token_accuracy`` metrics) without the (B, T, V) logits. What it does hold, read off TRL 1.16
(``trl/kernels/chunked_logprob.py``):

- **One projection buffer** ``mm_buf`` of ``min(N, 4096) x 32768`` elements in the compute dtype, in forward and
  again in backward: 32,768 columns whatever the vocabulary (a 384-token vocabulary gets the same buffer as a
  32,768-token one, of which it uses 384 columns). This is the "vocabulary-sized buffer": at 4,096 tokens it
  is 256 MiB in bf16, 512 MiB in fp32, alive beside every saved activation at the start of backward.
- **Backward's fp32 gradient accumulators**: the hidden states' (``N x H``) and, when the head is trained, the
  head weight's (``V x H``), always fp32 (``_addmm_fp32``), cast to the parameter's dtype when returned.
- **The fold's temporaries, CPU only**: without Triton each tile is folded by torch ops
  (``_forward_tile``/``_backward_tile``), each making tile-sized fp32 tensors: 13 bytes per tile element at
  forward's peak (the scaled logits, ``exp``, ``exp * z``, the top-1 masks), 29 at backward's (the logits,
  their log-softmax, softmax, the gradient, the one-hot and its products). On CUDA the Triton kernels fold
  each tile in place: none.
- per token: seven fp32 running statistics in forward; the int64 targets, the log-normaliser and the entropy
  saved for backward.

Known error: the per-token terms count every one of the ``B (T - 1)`` positions (CUDA scores only labelled
ones: an upper bound with prompt masking); bias and soft-capping (Gemma 2) add tile-sized terms not counted
here. Measured on CPU against memfit's tensor counter with a real ``trl.SFTTrainer`` (tests/test_interop_trl.py):
within 3% in full fine-tuning, LoRA and gradient checkpointing.
"""

from __future__ import annotations

from memfit.settings.config import RunConfig

#: ``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``: tokens per projection tile (TRL 1.16).
TOKEN_TILE = 4096
#: ``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``: the buffer's columns, the vocabulary per tile (TRL 1.16).
VOCAB_TILE = 32768
#: Bytes per tile element of the torch fold's temporaries at their peak (CPU; read off ``_forward_tile`` and
#: ``_backward_tile``: see the module docstring).
FORWARD_FOLD, BACKWARD_FOLD = 13, 29
FP32 = 4


def scored_tokens(run: RunConfig) -> int:
    """Positions the fused head scores per micro-batch: every position with a next token, ``B (T - 1)``."""
    return run.micro_batch * max(run.seq_len - 1, 1)


def trl_logits_terms(spec, run: RunConfig, prec, device: str) -> tuple[int, int]:
    """Bytes of SFTTrainer's fused LM head and loss at forward's peak and backward's start (``activations``
    makes them its ``LogitsTerms``).

    ``N`` scored tokens, ``n = min(N, 4096)`` per tile, ``v = min(V, 32768)`` columns used per tile, ``c`` the
    compute dtype (autocast's, else the weights'). Forward: the backbone's last hidden state (alive until the
    fused forward returns), the buffer ``n x 32768 x c``, 28 N of running statistics, the head weight's tile
    cast to ``c`` under autocast, and on CPU the fold's ``13 n v``. Backward start: the saved targets,
    log-normaliser and entropy (16 N), the fp32 gradient of the hidden states (``4 N H``) and of a trained head
    (``4 V H``), the buffer again, the weight tile's cast, and on CPU the larger of the fold's ``29 n v`` and,
    with 16-bit compute, ``_addmm_fp32``'s fp32 copies of a tile and a weight tile (``4 n v + 4 v H``).
    Source and known error: the module docstring.
    """
    tokens, hidden, vocab = scored_tokens(run), spec.hidden_size, spec.vocab_size
    rows, cols = min(tokens, TOKEN_TILE), min(vocab, VOCAB_TILE)
    buffer = rows * VOCAB_TILE * prec.c
    weight_cast = cols * hidden * prec.c if prec.c != prec.w else 0
    cpu = device == "cpu"
    last_hidden = prec.w * run.micro_batch * run.seq_len * hidden
    forward = last_hidden + buffer + 7 * FP32 * tokens + weight_cast + (FORWARD_FOLD * rows * cols if cpu else 0)
    grads = FP32 * tokens * hidden + (FP32 * vocab * hidden if not run.is_lora() else 0)
    copies = FP32 * rows * cols + FP32 * cols * hidden if prec.c != FP32 else 0
    fold = max(BACKWARD_FOLD * rows * cols, copies) if cpu else 0
    backward = 16 * tokens + grads + buffer + weight_cast + fold
    return int(forward), int(backward)
