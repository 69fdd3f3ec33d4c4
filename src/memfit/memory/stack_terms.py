"""What another trainer's stack holds beside what memfit's own recipe prices (``memfit.settings.stack``).

``estimate`` prices memfit's stack (Accelerate + transformers + PEFT on the installed versions). A run of
another trainer differs where that trainer's source says so; each difference is one function here, with
its source, read by ``memory.estimate`` once the stack is resolved:

- ``precisions``: LoRA adapters in the model's dtype (litgpt, torchtune, fsdp_qlora's bf16 cast), not PEFT's fp32;
- ``adapter_states``: their weights, gradients and AdamW moments in that dtype too;
- ``quantized_head``: litgpt's 4-bit base quantizes the head, dequantized at every call;
- ``sharded_quant_state``: torchao's NF4 base (torchtune) shards its quantization state with its weights;
- ``rope_caches``: an older transformers release's per-layer rotary caches, resident like the weights;
- ``logits``: litgpt's chunked head, or an older transformers release's head and loss (``memory.transformers_loss``);
- ``gathered_in_compute_dtype``: FSDP2's ``MixedPrecisionPolicy`` gathers half parameters (torchtitan), not fp32;
- ``root_unit_kept``: torchtitan's root unit (embedding, final norm, head) gathered from forward to backward's end;
- the outputs torchtitan's per-op checkpointing keeps are priced by ``memory.activations`` (``memory.selective_ac``);
- the layers' kept 4-bit inputs (bitsandbytes < 0.43.2) are priced by ``memory.activations`` through
  ``memory.quantized.int8_input_groups``, the same ``ctx.tensors`` mechanism as an 8-bit base.
"""

from __future__ import annotations

import dataclasses

from memfit.memory import transformers_loss
from memfit.memory.activations import LogitsTerms, Precisions
from memfit.memory.quantized import nf4_bytes
from memfit.memory.states import ModelStates, model_states, quant_state_bytes, unquantized_param_bytes
from memfit.settings.config import Optimizer, Quantize, RunConfig, Sharding
from memfit.settings.stack import ROPE_CACHE_MODEL_TYPES, Stack
from memfit.spec.engines import shard_group_size
from memfit.spec.model import ModelSpec

FP32 = 4


def precisions(prec: Precisions, run: RunConfig, stack: Stack) -> Precisions:
    """``prec`` with the adapters' dtype of ``stack``: the compute dtype where the trainer builds its LoRA modules
    in the model's dtype (litgpt's ``lora.py`` L125: ``nn.Parameter(torch.empty(...))`` under Fabric's
    ``bf16-true``; torchtune's ``set_default_dtype``), else PEFT's fp32 (``autocast_adapter_dtype=True``)."""
    if run.is_lora() and stack.traits.adapters_in_compute_dtype:
        return dataclasses.replace(prec, adapter=prec.c)
    if computes_in_param_dtype(run, prec, stack):
        return dataclasses.replace(prec, w=prec.c, amp=False)  # no autocast: bf16 parameters, a bf16 stream
    return prec


def computes_in_param_dtype(run: RunConfig, prec: Precisions, stack: Stack) -> bool:
    """Whether FSDP2's ``MixedPrecisionPolicy(param_dtype=c, reduce_dtype=fp32)`` runs the step in place of autocast
    (``Trainer.gathers_compute_dtype``): a sharded full fine-tune of fp32 weights under bf16/fp16 mixed precision.

    FSDP2 casts each fp32 shard to ``param_dtype`` before its all-gather (torch 2.13 ``_fully_shard/_fsdp_param.py``
    L901 ``_to_dtype_if_needed(sharded_param_data, self.param_dtype)``), so the layers compute on half parameters
    with no autocast (torchtitan 9dec370 ``train.py`` L301-308 runs ``model(input_ids)`` under no autocast context;
    ``parallelize_llama.py`` L320 builds the policy): the residual stream and every activation are half
    (``Precisions.w = c``), autocast keeps no weight copies, and the unsharded gradients are half; the fp32 shards,
    their gradients (``reduce_dtype``) and AdamW's moments are as memfit prices them. torchtitan applies the policy
    only when it shards (``--training.mixed_precision_param``: "only takes effect when data_parallel_shard_degree
    > 1", config_manager.py L379-386); unsharded, memfit's autocast pricing stays (not checked against torchtitan).
    """
    sharded = run.num_processes > 1 and run.sharding is not Sharding.DDP
    return (stack.traits.gathers_compute_dtype and sharded and prec.amp and not run.is_lora()
            and run.quantize is Quantize.NONE)


def gathered_in_compute_dtype(spec: ModelSpec, run: RunConfig, states: ModelStates, stack: Stack, device: str,
                              engine: str, rank: int | None) -> ModelStates:
    """``states`` with FSDP2's unsharded terms as ``MixedPrecisionPolicy`` holds them (``computes_in_param_dtype``):
    the gathered parameters and their unsharded gradients in the compute dtype, read off ``memory.states.model_states``
    of the same run with half weights; the rest (fp32 shards, their fp32 gradients, AdamW's moments) kept.

    The reduce-scatter input stays fp32 (``reduce_dtype``: torch 2.13 ``_fsdp_collectives.py`` L597-603 allocates it
    in ``reduce_dtype`` and copies the half gradients in): the layer above's, held while a layer computes its
    backward (``reducing``), is one layer's parameters x 4 B (1.63 GiB on Llama 3.1 8B, 0.41 GiB more than at half).
    """
    if not computes_in_param_dtype(run, Precisions.of(run), stack):
        return states
    half = model_states(spec, run.replace(dtype=str(run.mixed_precision)), device, engine, rank)
    fields = ("gathered", "gathered_end", "gathered_forward", "gathered_layer", "gathered_entry",
              "gathered_first_entry", "gathered_start", "released_per_layer")
    return dataclasses.replace(states, **{name: getattr(half, name) for name in fields})


def root_unit_kept(spec: ModelSpec, run: RunConfig, states: ModelStates, stack: Stack, engine: str) -> ModelStates:
    """``states`` with FSDP2's root unit as torchtitan wraps it (``Trainer.root_unit_holds_ends``): the embedding, the
    final norm and the head in one unit, gathered at the model's forward start and kept until the final
    post-backward callback (the root's forward input, token ids, needs no gradient, so no earlier hook fires:
    torch ``_fsdp_state.py`` ``_root_post_backward_final_callback``). ``R`` = (embedding + norm + head) x the gathered
    dtype's bytes.

    Against Accelerate's units (``memory.states.fsdp2_gathered``: the [norm, head] unit kept from the head's forward,
    the embedding resharded after its forward):

    - while forward and backward compute (``gathered``, ``gathered_start``): the embedding's gathered copy beside the
      tail, ``R`` in all (1.96 GiB on Llama 3.1 8B in bf16);
    - while a layer computes and as a layer enters its forward (``gathered_layer``, ``gathered_entry``): ``R``, which
      Accelerate's units do not hold there;
    - as the first layer enters its forward: ``R`` and the root's all-gather output, still held as the previous
      unit's (``prev_all_gather_state``), in place of the embedding unit's;
    - at backward's end: ``R``, the root's unsharded gradients and its reduce-scatter input (fp32 under
      ``MixedPrecisionPolicy(reduce_dtype=fp32)``; none with a frozen base).

    Tied embeddings are left as they are (Accelerate's tail unit already holds the embedding from forward's start).
    Known error: the last block, which torchtitan does not reshard after forward (L333), is priced as Accelerate's
    two gathered layers at backward's start.
    """
    sharded = run.num_processes > 1 and run.sharding is Sharding.FSDP and engine == "fsdp2"
    if not (stack.traits.root_unit_holds_ends and sharded) or spec.tie_word_embeddings:
        return states
    prec = Precisions.of(run)
    half = computes_in_param_dtype(run, prec, stack)
    u = prec.c if half else unquantized_param_bytes(run)
    embed = spec.embedding_params or spec.vocab_size * spec.hidden_size
    head = spec.lm_head_params or spec.vocab_size * spec.hidden_size
    root_params = embed + head + spec.hidden_size
    root = root_params * u
    previous_embed = embed * u  # Accelerate's previous unit at the first layer's entry: the embedding's all-gather
    grads = 0 if run.is_lora() else root_params * (u + (FP32 if half else u))
    return dataclasses.replace(
        states,
        gathered=states.gathered + embed * u,
        gathered_start=None if states.gathered_start is None else states.gathered_start + embed * u,
        gathered_layer=None if states.gathered_layer is None else states.gathered_layer + root,
        gathered_entry=states.gathered_entry + root if states.gathered_entry else 0,
        gathered_first_entry=(states.gathered_first_entry - previous_embed + 2 * root
                               if states.gathered_first_entry else 0),
        gathered_end=max(states.gathered_end, root + grads))


def adapter_states(spec: ModelSpec, run: RunConfig, prec: Precisions, states: ModelStates,
                   stack: Stack) -> ModelStates:
    """``states`` with the adapters' weights, gradients and optimizer state at ``prec.adapter`` bytes, not fp32.

    memfit's states hold PEFT's fp32 adapters (4 B weight, 4 B gradient, AdamW's two 4 B moments: torch keeps
    a moment in its parameter's dtype). With adapters in a 2-byte dtype each term halves. An 8-bit
    optimizer's state does not depend on the parameter's dtype and is kept. Ignores: DeepSpeed's fp32 master
    partition (a DeepSpeed run's states are left as they are).
    """
    if not run.is_lora() or prec.adapter == FP32 or states.engine == "deepspeed":
        return states
    shards = run.num_processes if run.num_processes > 1 and run.sharding is not Sharding.DDP else 1
    saved_weights = spec.lora_params(run) * (FP32 - prec.adapter) // shards
    scale = prec.adapter / FP32
    keep_optimizer = run.optimizer is Optimizer.ADAMW_8BIT
    return dataclasses.replace(
        states, weights=states.weights - saved_weights, gradients=int(states.gradients * scale),
        optimizer=states.optimizer if keep_optimizer else int(states.optimizer * scale),
        step_temporary=int(states.step_temporary * scale), buckets=int(states.buckets * scale))


@dataclasses.dataclass(frozen=True)
class HeadTerms:
    """A quantized head's bytes against the unquantized head memfit prices (``quantized_head``)."""

    weights: int = 0
    """Change of the resident weights (negative: NF4 instead of the stored dtype)."""
    held: int = 0
    """The head's input kept by ``MatMul4Bit`` (bitsandbytes < 0.43.2) until the graph is freed."""
    transient: int = 0
    """The dequantized head, alive while the head runs forward and while its backward starts."""


def quantized_head(spec: ModelSpec, run: RunConfig, prec: Precisions, stack: Stack) -> HeadTerms:
    """litgpt's 4-bit head: Fabric's ``BitsandbytesPrecision`` swaps every ``nn.Linear`` for a 4-bit one, the
    output head (``lm_head``, untied: ``litgpt/model.py`` L25) included.

    - weights: the head in NF4 (``memory.quantized.nf4_bytes``) instead of ``--dtype``;
    - every call (litgpt's ``lm_head_chunk_size=128`` calls it once per chunk) dequantizes the whole head:
      ``MatMul4Bit.forward`` runs ``F.dequantize_4bit(B, quant_state).to(A.dtype)``, a half copy from the
      quantization dtype and one in the input's: 2 x 2 bytes per head weight (issue 35: 1.9 GiB on Llama 3
      8B), alive while the head runs forward and again in its backward (``MatMul4Bit.backward``);
    - bitsandbytes < 0.43.2 keeps each chunk's input (views of the final norm's output: ``w * H`` per token)
      in ``ctx.tensors`` until the graph is freed.

    Ignores: the chunks run one after another, so one dequantized copy exists at a time (charged once).
    Source: bitsandbytes 0.42.0 ``autograd/_functions.py`` L494-540, Lightning Fabric's bitsandbytes plugin.
    """
    if run.quantize is not Quantize.Q4 or not stack.traits.quantizes_head:
        return HeadTerms()
    numel = spec.lm_head_params or spec.vocab_size * spec.hidden_size
    nf4 = nf4_bytes(numel, stack.double_quant)
    weights = nf4 - numel * prec.w if spec.lm_head_params else nf4
    held = prec.w * spec.hidden_size * run.micro_batch * run.seq_len if stack.keeps_4bit_input() else 0
    return HeadTerms(weights=weights, held=held, transient=numel * (2 + 2))


def notes(stack: Stack, derived: bool = False, traced: bool = False) -> list[str]:
    """What an estimate says about its stack: which one it priced, and what of it memfit does not price
    (``derived``: a recipe traced on memfit's own stack, which prices none of this module's terms; ``traced``:
    the exact trace itself, which runs memfit's own stack)."""
    if not stack.changes_terms() and not stack.unpriced():
        return []  # a trainer that holds what memfit's own does (transformers' Trainer with PEFT)
    if derived and stack.changes_terms():
        what = "the exact trace runs" if traced else "this derived recipe prices"
        return [f"stack: {stack.describe()}: its terms (memory/stack_terms.py) are priced by the analytic "
                f"estimate's hand-written recipes only; {what} memfit's own stack."] + list(stack.unpriced())
    return [f"stack: {stack.describe()} (memory/stack_terms.py)."] + list(stack.unpriced())


def sharded_quant_state(spec: ModelSpec, run: RunConfig, states: ModelStates, stack: Stack) -> ModelStates:
    """``states`` with a sharded 4-bit base's quantization state divided over the shard group, as the packed
    weights are, where the stack's 4-bit tensor shards it (``Trainer.shards_quant_state``: torchao's
    ``NF4Tensor`` under FSDP2, torchtune's distributed QLoRA recipes).

    memfit's states keep the quantization state whole on every rank (bitsandbytes' ``quant_state``, a module
    attribute FSDP2 never sees: ``memory.states.model_states``), ``Q = packed - storage`` bytes; sharded over ``N``
    ranks it is ``Q / N``. On Llama 3.1 405B (401.6 B quantized weights, one 8-bit scaler per 64) ``Q`` is 6.3 GB:
    5.5 GB less per rank over 8 ranks. Known error: torchao's per-256-scaler factors (2 bytes per 256 x 64 weights)
    and the padding of each tensor to a multiple of ``N`` rows are within memfit's NF4 bytes (``nf4_bytes``) by
    under 0.1%.
    """
    shards = shard_group_size(run)
    if (run.quantize is not Quantize.Q4 or not stack.traits.shards_quant_state or shards < 2
            or states.engine == "deepspeed"):
        return states
    whole = quant_state_bytes(spec, run)
    return dataclasses.replace(states, weights=states.weights - whole + whole // shards)


def single_quant_bytes(spec: ModelSpec, run: RunConfig, stack: Stack) -> int:
    """How many more bytes a 4-bit base holds without double quantization (``stack.double_quant`` False: fp32
    absmax per 64 weights, ``memory.quantized.nf4_bytes``) than memfit's double-quantized one, on every rank (the
    quantization state is an attribute of the module, never sharded: ``memory.quantized.storage_bytes``)."""
    if run.quantize is not Quantize.Q4 or stack.double_quant:
        return 0
    return sum(lin.count * (nf4_bytes(lin.in_features * lin.out_features, False)
                            - nf4_bytes(lin.in_features * lin.out_features)) for lin in spec.linears)


def rope_caches(spec: ModelSpec, run: RunConfig, prec: Precisions, stack: Stack) -> int:
    """Bytes of the rotary caches an older transformers release keeps in every attention layer
    (``settings.stack.TRANSFORMERS_ROPE_CACHES``, Llama only: ``ROPE_CACHE_MODEL_TYPES``): a cos and a sin table of
    (``max_position_embeddings``, ``head_dim``) per layer, whole on every rank (buffers: FSDP and ZeRO-3 shard
    parameters only), in the dtype the model is built under: fp32 where the trainer builds its 4-bit model with no
    ``torch_dtype`` (``Trainer.builds_4bit_model_in_fp32``), else the model's dtype. Llama-2 7B: 32 x 2 x 4,096 x 128
    x 4 B = 128 MiB in fp32. Known error: each layer's forward copies its table's first ``seq_len`` rows to the
    compute dtype and indexes them by position (``seq_len x head_dim`` and ``B x seq_len x head_dim`` elements, a
    layer at a time), left out; so is a trainer that casts its buffers after building (``model.to(dtype)``)."""
    if not stack.keeps_rope_caches() or spec.model_type not in ROPE_CACHE_MODEL_TYPES:
        return 0
    built_fp32 = run.quantize is Quantize.Q4 and stack.traits.builds_4bit_model_in_fp32
    return spec.num_layers * 2 * spec.max_position_embeddings * spec.head_dim * (FP32 if built_fp32 else prec.w)


def chunked_head_tokens(run: RunConfig, stack: Stack) -> int:
    """Tokens per chunk of the head where the stack's script runs it in chunks (``Trainer.head_chunk_tokens``:
    litgpt's LoRA fine-tune, SFT with the standard loss), else 0. litgpt's full fine-tune (finetune/full.py L255)
    runs the whole head and slices its fp32 output: priced as transformers' loss."""
    if not run.is_lora() or str(run.method) != "sft" or str(run.loss) != "standard":
        return 0
    return stack.traits.head_chunk_tokens


def logits(spec: ModelSpec, run: RunConfig, prec: Precisions, stack: Stack) -> LogitsTerms | None:
    """The head and loss of ``stack`` where they differ from memfit's own (None: ``memory.activations.logits_terms``):
    a transformers release before 4.49 (``memory.transformers_loss``), or a trainer that runs its head in chunks
    handed back in fp32 (``head_chunk_tokens``: litgpt's LoRA fine-tune). ``N = B * T * V`` logits, ``n`` of a chunk.

    - forward's end: the fp32 logits (Fabric's ``convert_output`` copies each bf16 chunk to fp32 and the bf16
      one dies with it) and ``log_softmax``'s saved fp32 output: 8 N bytes;
    - backward's start: the same, and one chunk's gradients (the engine runs the chunks' branches one after the
      other): of ``log_softmax``'s output and of the logits (fp32), and the logits' gradient cast back to the
      head's bf16: 10 n;
    - after the loss' backward the caller still holds the fp32 logits (``logits`` in litgpt's loop): 4 N.

    Ignores: the last chunk's copy made by ``logits[-1][..., :-1, :]`` then ``reshape`` (4 n); a half-precision
    copy of a chunk alive while it is converted (2 n). Source: litgpt 00af8b0 ``lora.py`` L550-552,
    ``finetune/lora.py`` L303-308, ``utils.py`` L293-322; Lightning Fabric ``HalfPrecision.convert_output``.
    """
    if stack.chunked_output_loss and str(run.loss) == "chunked":
        return chunked_output_logits(spec, run, prec, compiled=run.compile or stack.compiled_loss)
    chunk = chunked_head_tokens(run, stack)
    if not chunk:
        return transformers_loss.logits_terms(spec, run, prec, stack)
    n = run.micro_batch * run.seq_len * spec.vocab_size
    n_chunk = run.micro_batch * min(chunk, run.seq_len) * spec.vocab_size
    return LogitsTerms(forward=8 * n, backward=8 * n + 10 * n_chunk, retained=4 * n)


#: ``CEWithChunkedOutputLoss``'s default ``num_output_chunks`` (torchtune 0031bfb ``ce_chunked_output_loss.py``).
OUTPUT_CHUNKS = 8


def chunked_output_logits(spec: ModelSpec, run: RunConfig, prec: Precisions, compiled: bool = False) -> LogitsTerms:
    """torchtune's ``CEWithChunkedOutputLoss`` (``Stack.chunked_output_loss``): the model returns its head's output as
    ``OUTPUT_CHUNKS`` chunks of the sequence, all in the compute dtype (``c`` N bytes, ``N = B * T * V``), and the loss
    scores them one after the other with ``F.cross_entropy(chunk.float(), ...)`` (torchtune 0031bfb
    ``ce_chunked_output_loss.py``); the recipe deletes its list of chunks after the loss (``del logits``,
    full_finetune_single_device.py L578). What each chunk's graph keeps for backward depends on ``compute_cross_entropy``
    being ``compiled`` (``training.compile_loss`` with ``compile: True``: ``Stack.compiled_loss``, or ``--compile``),
    measured on CPU tensors (tests/test_chunked_output_loss.py):

    - eager: ``log_softmax``'s fp32 output of every chunk (4 N) is saved; forward peaks at the last chunk with the
      chunks, the saved outputs and that chunk's fp32 copy: ``c`` N + 4 N + 4 n (``n = N / OUTPUT_CHUNKS``; no copy
      when ``c`` is fp32);
      backward starts with the saved outputs and one chunk's two fp32 gradients: 4 N + 8 n;
    - compiled: the fused kernel saves each chunk's input, the ``c``-byte logits, and a per-row statistic (small):
      ``c`` N through forward and backward, + one chunk's ``c``-byte gradient in backward.
    Not memfit's chunked loss, which never holds the whole logits (torchtune's ``LinearCrossEntropyLoss`` does not).
    """
    n_all = run.micro_batch * run.seq_len * spec.vocab_size
    n_chunk = n_all // OUTPUT_CHUNKS
    if compiled:
        return LogitsTerms(forward=prec.c * n_all, backward=prec.c * (n_all + n_chunk))
    upcast = FP32 * n_chunk if prec.c != FP32 else 0  # ``.float()`` of an fp32 chunk returns the chunk itself
    return LogitsTerms(forward=(prec.c + FP32) * n_all + upcast, backward=FP32 * n_all + 2 * FP32 * n_chunk)
