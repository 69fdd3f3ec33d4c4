"""The stack a prediction is for: the trainer that runs the step and the versions it runs with.

What a training step holds depends on who runs it, not only on what it trains: the same LoRA run keeps
fp32 adapters under PEFT and bf16 ones under litgpt; bitsandbytes before 0.43.2 keeps every 4-bit layer's
input for backward. ``Stack`` names that setting once; ``estimate`` reads it (``memory.stack_terms``) and
``estimate --from`` sets it from the file it reads (``memfit.interop``). memfit's own runs are ``Stack()``:
memfit's trainer on the installed versions, which the estimator's recipes were read off.

Each trait is a fact of one trainer's source, cited where it is declared (``TRAINERS``). What a stack does
that memfit cannot price yet is said in a sentence (``Stack.unpriced``), never priced as something else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from packaging.version import InvalidVersion, Version

from memfit.errors import UserError
from memfit.settings.config import RunConfig, Sharding
from memfit.settings.zero3 import Coordinator

#: The first torchao release whose ``to_nf4`` searches the nearest NF4 code in chunks of ``1024**2`` weights
#: (``dtypes/nf4tensor.py`` L33 ``CHUNK_SIZE``, L645-651); 0.1 compares every weight of a projection with the 16 codes
#: at once (``quantize_tensor_nearest``: ``(value - nf4).abs()``, 64 bytes per weight in bf16).
TORCHAO_CHUNKS_NF4 = "0.2.0"

#: The first transformers release whose ``gradient_checkpointing_enable`` checkpoints non-reentrantly when the trainer
#: passes no ``gradient_checkpointing_kwargs`` (5.25 ``modeling_utils.py`` L3159-3160 ``{"use_reentrant": False}``);
#: 4.35-4.57 filled ``{"use_reentrant": True}`` there, and earlier ones called ``torch.utils.checkpoint.checkpoint``
#: with torch's own default, reentrant.
TRANSFORMERS_NON_REENTRANT = "5.0.0"

#: The trainers whose checkpointing is transformers' ``gradient_checkpointing_enable`` (``Stack.checkpoints_reentrant``).
HF_TRAINERS = ("hf", "trl", "axolotl", "llamafactory")

#: The trainers that run transformers' causal-LM classes, head and loss included (``Stack.loss_era``).
TRANSFORMERS_MODEL_TRAINERS = HF_TRAINERS + ("answerai-fsdp-qlora",)

#: The transformers releases whose Llama gives each attention layer its own ``LlamaRotaryEmbedding`` holding cos and sin
#: caches of (``max_position_embeddings``, ``head_dim``) in the dtype the model is built under (4.31.0
#: ``modeling_llama.py`` L104-115 ``cos_cached``/``sin_cached``, ``.to(dtype)`` of ``torch.get_default_dtype()``; 4.37.2
#: L134-146; 4.38-4.40 ``_cos_cached``/``_sin_cached``, 4.40.2 L112-113), from the first to the last (4.41.0 keeps
#: ``inv_freq`` alone). Read by ``Stack.keeps_rope_caches``.
TRANSFORMERS_ROPE_CACHES, TRANSFORMERS_DROPS_ROPE_CACHES = "4.31.0", "4.41.0"

#: The model types whose rotary caches ``TRANSFORMERS_ROPE_CACHES`` dates (checked in those releases' sources; Mistral
#: and Qwen2 kept theirs to later releases, not priced).
ROPE_CACHE_MODEL_TYPES = ("llama",)

#: The first transformers release whose ``ForCausalLMLoss`` upcasts and shifts a contiguous copy of the head's logits
#: (4.46.0 ``loss/loss_utils.py`` L36-38; from 4.31.0, ``modeling_llama.py`` L825, Llama returned them in fp32 and
#: shifted the copy itself), and the first that pads the labels instead, shifting nothing (4.49.0 L39).
TRANSFORMERS_LOSS_FUNCTION, TRANSFORMERS_PADS_LABELS = "4.46.0", "4.49.0"


class LossEra(enum.Enum):
    """How a transformers release before 4.49 runs the causal-LM head and loss (``memory.transformers_loss``)."""

    FP32_LOGITS = "fp32-logits"
    """Before 4.46: fp32 logits returned, the loss on a shifted contiguous copy (priced from 4.31 on)."""
    SHIFTED_COPY = "shifted-copy"
    """4.46-4.48: the head's logits returned; ``ForCausalLMLoss`` upcasts and shifts a contiguous copy."""

#: The first bitsandbytes release whose ``MatMul4Bit`` keeps only the packed weight for backward
#: (bitsandbytes commit 9e75374, "fix QLoRA mem bug: delete useless buffered activation"); earlier ones
#: keep ``ctx.tensors = (A, B)``, the layer's input with it (0.42.0 ``autograd/_functions.py`` L523).
BNB_DROPS_4BIT_INPUT = "0.43.2"


@dataclass(frozen=True)
class Trainer:
    """What one trainer's own code does that changes memory (each from its source)."""

    adapters_in_compute_dtype: bool = False
    """LoRA adapters created in the model's dtype (litgpt, torchtune), not PEFT's fp32 (``autocast_adapter_dtype``)."""
    shared_qkv_dropout: bool = False
    """One fused q/k/v projection, so one LoRA dropout of its input serves q, k and v (litgpt's ``LoRAQKVLinear``:
    ``lora.py`` L426 ``F.linear(self.lora_dropout(x), self.lora_A)``), not one per projection as PEFT's."""
    reentrant_checkpointing: bool = False
    """Activation checkpointing through ``torch.utils.checkpoint(use_reentrant=True)`` (fsdp_qlora's
    ``--reentrant_checkpointing``), whose recompute graph lives for one layer's backward; memfit's is non-reentrant."""
    quantizes_head: bool = False
    """A 4-bit base quantizes the output head too (Lightning Fabric's ``BitsandbytesPrecision`` replaces every
    ``nn.Linear``), dequantized at each call."""
    head_chunk_tokens: int = 0
    """The head runs in chunks of this many tokens, each chunk's logits handed back to the loss in fp32 (litgpt's LoRA:
    ``model(input_ids, lm_head_chunk_size=128)``, ``finetune/lora.py`` L304, and Fabric's ``convert_output`` to the
    default dtype, fp32), and the loss is ``F.cross_entropy`` per chunk (``utils.chunked_cross_entropy``);
    0: transformers' head and ``ForCausalLMLoss``, as memfit runs them."""
    keeps_outputs_until_next_forward: bool = False
    """The loop's ``logits`` holds the previous micro-batch's outputs, and through them its graph, until the next
    forward returns (litgpt ``finetune/lora.py`` L304; ``memory.litgpt_loop``)."""
    low_memory_loading: bool = False
    """A sharded run's base never sits whole on a rank: rank 0 reads it into host memory (a 4-bit base quantized on
    the device one projection at a time and moved back to the host), the other ranks build on ``meta``, and the
    wrapper brings one unit at a time to the device as it shards (``memory.phases``). False: memfit's own path,
    every rank loads the whole (4-bit) base onto its device before FSDP2 shards it."""
    nf4_on_build: bool = False
    """A 4-bit base is built on the device in bf16 and quantized there by torchao's ``to_nf4``, one projection at a
    time, the checkpoint copied in afterwards on the host (``memory.torchao_nf4``), not quantized by bitsandbytes as
    the checkpoint is loaded (``memory.loading``); with torchao older than 0.2.0, torchtune v0.1's three passes of it
    (``memory.torchtune_build``)."""
    shards_quant_state: bool = False
    """A sharded 4-bit base's quantization state (scalers and their factors) is sharded with its packed weights:
    torchao's ``NF4Tensor`` splits, pads and all-gathers its three inner tensors together (``nf4tensor.py``
    ``_INNER_TENSOR_NAMES_FOR_SHARDING = ["quantized_scalers", "quantization_factor", "quantized_data"]``,
    ``nf4_split``, ``nf4_new_zeros``, ``nf4_all_gather_into_tensor``; pytorch/ao@0598012); bitsandbytes keeps its
    ``quant_state`` as a module attribute, whole on every rank (``memory.states.quant_state_bytes``)."""
    selective_ac_op: bool = False
    """Checkpointing keeps, besides each layer's input, the outputs of every other ``aten.mm`` and of SDPA
    (torchtitan's ``selective_ac_option = "op"``: ``memory.selective_ac``); False: whole-layer checkpointing."""
    gathers_compute_dtype: bool = False
    """A sharded run under bf16/fp16 mixed precision casts each fp32 shard to the compute dtype before FSDP2 gathers
    it, and computes with no autocast: activations, gathered parameters and their unsharded gradients in that dtype
    (torchtitan's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: ``memory.stack_terms.gathered_in_compute_dtype``);
    False: autocast's half copies of gathered fp32 parameters, as Accelerate runs it."""
    root_unit_holds_ends: bool = False
    """FSDP2's root unit is the whole model, holding the embedding, the final norm and the head, and stays unsharded
    from the model's forward to the end of backward: torchtitan 9dec370 ``parallelize_llama.py`` L339
    ``fully_shard(model, ...)`` over L329-337's per-block units, and FSDP2's lazy init of that time never resharded the
    root after forward, whatever ``reshard_after_forward`` said (``_fsdp_state.py`` ``_lazy_init``: "For the root, do
    not reshard after forward", ``post_forward_mesh_info = None``; pytorch/pytorch#154655, changed in June 2025 by
    #154704 and #155319 to apply only where ``reshard_after_forward`` is left unset). False: Accelerate's units, an
    embedding unit resharded after its forward and a [final norm, head] unit (``memory.states.fsdp2_gathered``);
    ``memory.stack_terms.root_unit_kept``."""
    lora_in_fsdp_layer_units: bool = False
    """Under FSDP (1) the LoRA matrices share their layer's flat parameter with the frozen base (``use_orig_params=True``
    and a layer-only wrap policy: Lightning Fabric's ``FSDPStrategy`` default, litgpt ``finetune/lora.py``
    ``auto_wrap_policy={Block}``), so the whole layer gets a gradient (``memory.flat_params``); False: each LoRA
    matrix a unit of its own (PEFT's ``fsdp_auto_wrap_policy``, fsdp_qlora's)."""
    fsdp_no_sync_accumulation: bool = True
    """Under FSDP (1) the micro-batches before the last of an accumulated step run in ``no_sync`` (Accelerate's
    ``accumulate``, transformers' Trainer, Lightning Fabric's ``no_backward_sync``), keeping unsharded gradients;
    False: each micro-batch reduce-scatters (fsdp_qlora without ``--no_sync``, train.py L821-824)."""
    keeps_output_through_backward: bool = False
    """The loop binds the model's output (its logits) through ``loss.backward()`` and until the next forward returns
    (fsdp_qlora e877dda ``train.py`` L841 ``output = model(...)``, L863 ``loss.backward()``); transformers'
    ``Trainer.compute_loss`` returns the loss alone (``memory.transformers_loss``)."""
    builds_4bit_model_in_fp32: bool = False
    """A 4-bit model is built with no ``torch_dtype`` (fsdp_qlora e877dda ``train.py`` L577 ``from_config(cfg)`` under
    ``init_empty_weights``: its buffers, rotary caches included, in torch's default fp32); False: under the run's
    dtype (``from_pretrained(..., torch_dtype=...)``, which transformers' Trainer-based scripts pass)."""
    unsloth_kernels: bool = False
    """Unsloth's own Llama layer, LoRA autograd functions, checkpointing and loss (``memory.unsloth_layer``), where
    they run; elsewhere transformers' layer is priced and the estimate says so."""
    zero3_init: bool = False
    """Under DeepSpeed ZeRO-3 an unquantized model is built inside ``deepspeed.zero.Init`` (transformers 5.25
    ``modeling_utils.py`` L3829-3839 ``get_init_context``: ``is_deepspeed_zero3_enabled()`` and not quantized;
    the Trainer's ``TrainingArguments`` registers the config, ``training_args.py`` L1707-1710), which makes every
    ``F.linear`` DeepSpeed's ``zero3_linear_wrap`` (deepspeed 0.19.8 ``partition_parameters.py`` L412-419, for the
    rest of the process): a projection saves its parameter, not a view of the gathered weight, so the
    coordinator's release frees it (``memory.deepspeed_layout.coordinator_gathered``). memfit builds outside it."""
    unpriced: tuple[str, ...] = ()
    """What this trainer does that memfit does not price (sentences)."""


#: The trainers memfit knows by name. ``memfit``: its own loop (Accelerate + transformers + PEFT), which the
#: recipes model; ``hf``/``trl``/``axolotl``/``llamafactory``: transformers' Trainer with PEFT, as memfit, but
#: building a ZeRO-3 model under ``deepspeed.zero.Init`` (``Trainer.zero3_init``).
TRAINERS: dict[str, Trainer] = {
    "memfit": Trainer(),
    "hf": Trainer(zero3_init=True),
    "trl": Trainer(zero3_init=True),
    "axolotl": Trainer(zero3_init=True),
    "llamafactory": Trainer(zero3_init=True),
    # torchtune builds the whole model, LoRA modules included, under the recipe's dtype (training.set_default_dtype);
    # its distributed recipes build on meta (lora_finetune_distributed.py L520 ``torch.device("meta")``) and
    # ``training.load_from_full_model_state_dict`` distributes one full tensor at a time (_distributed.py L336-448)
    # and its 4-bit base is torchao's NF4, built on the device (lora.py L93-94 ``to_nf4(linear.weight)`` under
    # lora_finetune_single_device.py L254 ``with utils.set_default_dtype(self._dtype), self._device``)
    "torchtune": Trainer(adapters_in_compute_dtype=True, low_memory_loading=True, nf4_on_build=True,
                         shards_quant_state=True),
    # litgpt: the model under Fabric's bf16-true precision (adapters too), fused qkv (litgpt/lora.py L233, L426)
    "litgpt": Trainer(adapters_in_compute_dtype=True, shared_qkv_dropout=True, quantizes_head=True,
                      head_chunk_tokens=128, keeps_outputs_until_next_forward=True, lora_in_fsdp_layer_units=True),
    # Answer.AI's fsdp_qlora: PEFT's LoRA on a bitsandbytes or custom base, wrapped by FSDP (1)
    # (train.py --precision bf16 casts every parameter, the adapters too, to bf16; --reentrant_checkpointing True;
    # e877dda L1011 ``low_memory: bool_arg = True``: L628 quantizes each layer on the GPU then moves it to the CPU on
    # rank 0, to meta elsewhere; L733-735 FSDP(sync_module_states=True, param_init_fn=to_empty on cuda))
    "answerai-fsdp-qlora": Trainer(adapters_in_compute_dtype=True, reentrant_checkpointing=True,
                                   low_memory_loading=True, keeps_output_through_backward=True,
                                   fsdp_no_sync_accumulation=False, builds_4bit_model_in_fp32=True),
    # torchtitan: FSDP2 over every rank with its MixedPrecisionPolicy and per-op selective checkpointing
    # (torchtitan/models/llama3/train_configs/llama3_8b.toml: mode = "selective", selective_ac_option = "op";
    # 9dec370 parallelize_llama.py L213-276 the policy, L320 MixedPrecisionPolicy(param_dtype, reduce_dtype))
    "torchtitan": Trainer(selective_ac_op=True, gathers_compute_dtype=True, root_unit_holds_ends=True, unpriced=(
        "torchtitan's own Llama code (k and v expanded to every head, RoPE in fp32 complex numbers: model.py "
        "L85-126, L201-202) is priced as transformers' Llama layer: the same kept tensors, a recompute larger by "
        "the repeated k and v, 2 x (q width - kv width) x 2 bytes a token.",)),
    # Unsloth 2024.12 (unslothai/unsloth 6dd9d4e): LoRA_QKV/LoRA_W/LoRA_MLP, offloaded checkpoints, Cut Cross-Entropy
    "unsloth": Trainer(unsloth_kernels=True, unpriced=(
        "Unsloth runs xformers where flash-attn is not installed (its k and v expanded to every head); memfit prices "
        "flash-attention 2.",)),
}


@dataclass(frozen=True)
class Stack:
    """The trainer and versions that run a step (``memfit.settings.stack``); ``Stack()`` is memfit's own."""

    trainer: str = "memfit"
    """A name of ``TRAINERS``."""
    bitsandbytes: str | None = None
    """The bitsandbytes version the run uses (a release, as pip spells it); None: the installed one (memfit's
    own runs; ``constraints.txt`` pins 0.50.2)."""
    double_quant: bool = True
    """Whether a 4-bit base quantizes its absmax statistics again (bitsandbytes' ``compress_statistics``, memfit's
    setting); litgpt's ``quantize: bnb.nf4`` does not (``bnb.nf4-dq`` does)."""
    chunked_output_loss: bool = False
    """Whether ``--loss chunked`` is torchtune's ``CEWithChunkedOutputLoss``: the head's output made in chunks that
    all live until the loss, which keeps each chunk for backward (``memory.stack_terms.chunked_output_logits``);
    False: memfit's chunked loss (and torchtune's ``LinearCrossEntropyLoss``), one chunk of logits at a time."""
    compiled_loss: bool = False
    """Whether the trainer compiles its loss apart from the model (torchtune's ``compile: True``:
    ``training.compile_loss`` compiles ``CEWithChunkedOutputLoss.compute_cross_entropy``), which changes what the
    chunked-output loss keeps (``memory.stack_terms.chunked_output_logits``); ``--compile`` counts too."""
    lora_in_layer_units: bool | None = None
    """Whether FSDP (1) wraps the LoRA matrices inside their layer's unit (``Trainer.lora_in_fsdp_layer_units``); None:
    the trainer's own policy."""
    low_memory_loading: bool | None = None
    """Whether a sharded run loads its base low-memory (``Trainer.low_memory_loading``); None: the trainer's own
    way. transformers' Trainer does where Accelerate's config asks for it: ``fsdp_cpu_ram_efficient_loading: true``
    sets ``FSDP_CPU_RAM_EFFICIENT_LOADING`` (accelerate ``utils/dataclasses.py`` L1856), which transformers'
    ``is_fsdp_enabled`` reads (``distributed/fsdp.py`` L45-51); transformers 4.4x's ``_load_state_dict_into_meta_model``
    then quantizes each 4-bit parameter on the GPU and moves it to the CPU (rank 0) or meta "to avoid excessive
    memory usage on each GPU", under DeepSpeed ZeRO-3 too (to the CPU on every rank)."""
    torchao: str | None = None
    """The torchao version that quantizes a torchtune 4-bit base (a release, as pip spells it); None: one that
    searches in chunks (``TORCHAO_CHUNKS_NF4`` and later). Older than that is torchtune v0.1's (it pins
    ``torchao==0.1``, v0.2.0 pins 0.3.1), whose build and checkpoint copy ``memory.torchtune_build`` replays."""
    fsdp: int = 2
    """Which FSDP shards a ``--sharding fsdp`` run: 2 (torch's ``fully_shard``, memfit's own) or 1
    (``FullyShardedDataParallel``'s flat parameters: Accelerate's FSDP plugin before ``fsdp_version: 2``; priced by
    ``memory.flat_params``). With 1, ``--sharding ddp`` is its ``NO_SHARD`` (whole flat parameters)."""
    zero3: Coordinator = Coordinator()
    """DeepSpeed ZeRO-3's parameter coordinator settings (the run's DeepSpeed config; ``settings.zero3``)."""
    transformers: str | None = None
    """The transformers version a Trainer-based run uses (a release, as pip spells it); None: 5 or later, the
    installed one's behaviour. Before 5, ``gradient_checkpointing_enable`` checkpoints reentrantly when given no
    kwargs (``TRANSFORMERS_NON_REENTRANT``)."""
    reentrant_checkpointing: bool | None = None
    """Whether checkpointing is reentrant, as the run's config says (``gradient_checkpointing_kwargs.use_reentrant``,
    LLaMA-Factory's ``use_reentrant_gc``); None: the trainer's and its transformers version's default
    (``checkpoints_reentrant``)."""

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise UserError(f"Unknown trainer {self.trainer!r}; memfit knows: {', '.join(TRAINERS)}.")
        if self.fsdp not in (1, 2):
            raise UserError(f"FSDP version must be 1 or 2, got {self.fsdp!r}.")
        for version in (self.bitsandbytes, self.torchao, self.transformers):
            if version is not None:
                _release(version)  # refused here, in one sentence, not at the first estimate

    @property
    def traits(self) -> Trainer:
        return TRAINERS[self.trainer]

    def keeps_4bit_input(self) -> bool:
        """Whether a 4-bit layer keeps its input until the graph is freed (bitsandbytes < 0.43.2)."""
        return self.bitsandbytes is not None and _release(self.bitsandbytes) < _release(BNB_DROPS_4BIT_INPUT)

    def checkpoints_reentrant(self) -> bool:
        """Whether activation checkpointing runs ``torch.utils.checkpoint(use_reentrant=True)``: as the config says
        where it says, else the trainer's trait (fsdp_qlora), else for a transformers Trainer whether its transformers
        is older than 5 (``TRANSFORMERS_NON_REENTRANT``). It changes what a quantized base keeps: reentrant
        checkpointing runs each layer's forward under ``no_grad``, so bitsandbytes' ``ctx`` attributes (an 8-bit
        layer's ``ctx.A``, a 4-bit layer's input before 0.43.2) exist only while one layer recomputes
        (``memory.activations``)."""
        if self.reentrant_checkpointing is not None:
            return self.reentrant_checkpointing
        if self.traits.reentrant_checkpointing:
            return True
        return (self.trainer in HF_TRAINERS and self.transformers is not None
                and _release(self.transformers) < _release(TRANSFORMERS_NON_REENTRANT))

    def loss_era(self) -> LossEra | None:
        """How the run's transformers release holds the head's logits and the loss, where it is older than 4.49 and
        the trainer runs transformers' classes (``TRANSFORMERS_MODEL_TRAINERS``); None: the installed release's
        pricing."""
        if self.trainer not in TRANSFORMERS_MODEL_TRAINERS or self.transformers is None:
            return None
        release = _release(self.transformers)
        if release >= _release(TRANSFORMERS_PADS_LABELS):
            return None
        return LossEra.SHIFTED_COPY if release >= _release(TRANSFORMERS_LOSS_FUNCTION) else LossEra.FP32_LOGITS

    def keeps_rope_caches(self) -> bool:
        """Whether the run's transformers release gives every Llama attention layer cos and sin caches
        (``TRANSFORMERS_ROPE_CACHES``): a trainer running transformers' classes on a release named in that range."""
        if self.trainer not in TRANSFORMERS_MODEL_TRAINERS or self.transformers is None:
            return False
        release = _release(self.transformers)
        return _release(TRANSFORMERS_ROPE_CACHES) <= release < _release(TRANSFORMERS_DROPS_ROPE_CACHES)

    def nf4_chunked(self) -> bool:
        """Whether torchao's ``to_nf4`` searches the nearest code in chunks (torchao >= 0.2.0, or unnamed)."""
        return self.torchao is None or _release(self.torchao) >= _release(TORCHAO_CHUNKS_NF4)

    def lora_shares_layer_units(self) -> bool:
        """Whether FSDP (1) puts the LoRA matrices in their layer's flat parameter (``lora_in_layer_units``)."""
        return self.traits.lora_in_fsdp_layer_units if self.lora_in_layer_units is None else self.lora_in_layer_units

    def trains_whole_layers(self, run: RunConfig) -> bool:
        """Whether a LoRA ``run`` gives every decoder-layer parameter a gradient: FSDP (1) over several ranks with the
        adapters inside their layer's flat parameter (``lora_shares_layer_units``), which then requires a gradient as a
        whole, so the frozen base's weights get theirs and each layer saves what a full fine-tune saves (the base
        projections' inputs, the norms' normalised input). Read by ``memory.flat_params`` and ``memory.activations``."""
        return (run.is_lora() and self.fsdp == 1 and self.lora_shares_layer_units() and run.num_processes > 1
                and run.sharding in (Sharding.FSDP, Sharding.DDP))

    def loads_low_memory(self) -> bool:
        """Whether a sharded run's base reaches the device one unit at a time (``low_memory_loading``)."""
        return self.traits.low_memory_loading if self.low_memory_loading is None else self.low_memory_loading

    def is_memfit(self) -> bool:
        return self == Stack()

    def changes_terms(self) -> bool:
        """Whether this stack holds other tensors than memfit's own (a trait, bitsandbytes' kept inputs, or FSDP (1)'s
        flat parameters in a ``--sharding fsdp`` or ``ddp`` (NO_SHARD) run: ``memory.flat_params``)."""
        # how the base is loaded changes the loading and wrapping phases (memory.phases), not the step's tensors
        # nor does zero.Init: it changes DeepSpeed's layout (memory.deepspeed_layout), priced on every recipe
        step_traits = Trainer(unpriced=self.traits.unpriced, low_memory_loading=self.traits.low_memory_loading,
                              nf4_on_build=self.traits.nf4_on_build, zero3_init=self.traits.zero3_init)
        return (self.traits != step_traits or self.keeps_4bit_input()
                or not self.double_quant or self.fsdp == 1 or self.checkpoints_reentrant()
                or self.loss_era() is not None or self.chunked_output_loss or self.keeps_rope_caches())

    def unpriced(self) -> tuple[str, ...]:
        """What this stack holds that memfit does not price, in sentences."""
        out = list(self.traits.unpriced)
        if self.fsdp == 1 and self.lora_shares_layer_units():  # flat parameters priced (memory.flat_params) but:
            out.append("FSDP (1) with the adapters inside layer units: their AdamW state is priced split evenly over "
                       "the ranks; each rank holds that of the adapters its shard covers.")
        return tuple(out)

    def describe(self) -> str:
        """One line: ``litgpt, bitsandbytes 0.42.0``."""
        parts = [self.trainer]
        if self.bitsandbytes:
            parts.append(f"bitsandbytes {self.bitsandbytes}")
        if self.torchao:
            parts.append(f"torchao {self.torchao}")
        if self.transformers:
            parts.append(f"transformers {self.transformers}")
        if self.reentrant_checkpointing is not None and \
                self.reentrant_checkpointing != replace(self, reentrant_checkpointing=None).checkpoints_reentrant():
            parts.append("reentrant checkpointing" if self.reentrant_checkpointing else "non-reentrant checkpointing")
        if not self.double_quant:
            parts.append("NF4 without double quantization")
        if self.fsdp == 1:
            parts.append("FSDP (1)")
        if self.zero3 != Coordinator():
            parts.append(self.zero3.describe())
        if self.chunked_output_loss:
            parts.append("CEWithChunkedOutputLoss, compiled" if self.compiled_loss else "CEWithChunkedOutputLoss")
        if self.lora_in_layer_units is not None and self.lora_in_layer_units != self.traits.lora_in_fsdp_layer_units:
            parts.append("LoRA inside the layers' FSDP units" if self.lora_in_layer_units else "LoRA as FSDP units")
        if self.low_memory_loading is not None and self.low_memory_loading != self.traits.low_memory_loading:
            parts.append("low-memory loading" if self.low_memory_loading else "whole-base loading")
        return ", ".join(parts)

    @classmethod
    def of(cls, data: dict | None) -> Stack:
        """From a mapping (``{trainer: litgpt, bitsandbytes: 0.42.0}``); None or empty: memfit's own."""
        if not data:
            return cls()
        known = ("trainer", "bitsandbytes", "torchao", "double_quant", "fsdp", "low_memory_loading", "zero3",
                 "transformers", "reentrant_checkpointing", "chunked_output_loss", "compiled_loss",
                 "lora_in_layer_units")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise UserError(f"A stack names {', '.join(known)}; not {', '.join(unknown)}.")
        version, torchao, low_memory = data.get("bitsandbytes"), data.get("torchao"), data.get("low_memory_loading")
        transformers, reentrant = data.get("transformers"), data.get("reentrant_checkpointing")
        in_units = data.get("lora_in_layer_units")
        return cls(trainer=str(data.get("trainer", "memfit")), bitsandbytes=None if version is None else str(version),
                   torchao=None if torchao is None else str(torchao),
                   double_quant=bool(data.get("double_quant", True)), fsdp=int(data.get("fsdp", 2)),
                   low_memory_loading=None if low_memory is None else bool(low_memory),
                   zero3=Coordinator.of(data["zero3"]) if data.get("zero3") else Coordinator(),
                   transformers=None if transformers is None else str(transformers),
                   reentrant_checkpointing=None if reentrant is None else bool(reentrant),
                   chunked_output_loss=bool(data.get("chunked_output_loss", False)),
                   compiled_loss=bool(data.get("compiled_loss", False)),
                   lora_in_layer_units=None if in_units is None else bool(in_units))


def _release(version: str) -> tuple[int, ...]:
    try:
        return Version(version).release
    except InvalidVersion:
        raise UserError(f"Version {version!r} is not a version (e.g. 0.42.0).") from None
