"""Host RAM in the plan (``memory.snapshot.host_bytes``, ``memfit plan --host-memory``).

Offloading moves state to the host, and a plan that fits the GPU but not the machine's RAM is no plan. The
case is FSDP-QLoRA's (Answer.AI, 2024: Llama 2 70B on two 24 GB GPUs): on 2 x RTX 4090 the fastest plan
offloads a bf16 LoRA base (132 GiB of host RAM), which a 128 GiB workstation cannot hold; the 4-bit base
sharded and offloaded by FSDP2 needs 38 GiB of host RAM, but memfit loads it whole on each GPU first.
"""

from __future__ import annotations

import pytest

from memfit.memory.snapshot import host_bytes
from memfit.planning.search import plan
from memfit.planning.space import Constraints
from memfit.settings.config import Offload, Quantize, RunConfig
from memfit.spec.model import load_spec
from memfit.units import parse_size


def test_host_bytes_of_an_offloaded_full_finetune_by_hand():
    # fp32 AdamW under FSDP2's parameter offload, 2 ranks: each holds on the host its half of the weights (4 B),
    # gradients (4 B) and both moments (8 B) per parameter, 8 B in all, and fused AdamW's first-step rollback
    # copy of its half of the parameters, 2 B: 10 B per parameter per rank, 20 B per parameter per machine
    # (+ the rotary buffers, stored with the weights).
    spec = load_spec("tiny")
    run = RunConfig.of(num_processes=2, sharding="fsdp", offload="params", optimizer="adamw-fused")
    p = spec.params
    assert host_bytes(spec, run) == 2 * ((4 * p + spec.buffer_bytes) // 2 + 4 * p // 2 + 8 * p // 2 + 4 * p // 2)
    # without offload only the rollback copy is on the host
    assert host_bytes(spec, run.replace(offload="none")) == 2 * (4 * p // 2)


def test_the_70b_plan_on_two_24gb_gpus_needs_the_host_ram_of_an_offloaded_bf16_base():
    # Unchecked, the fastest plan offloads a bf16 LoRA base: 132 GiB of host RAM. FSDP-QLoRA (the 4-bit base
    # sharded and offloaded, 38 GiB of host RAM) fits the step in 24 GiB, but memfit loads a sharded 4-bit
    # base whole on every GPU before FSDP2 shards it (memory.outside ``loading``: ~35 GiB of packed weights),
    # so on a 128 GiB machine nothing fits, and the message names the peak outside the step.
    from memfit.memory.outside import outside_step
    from memfit.planning.search import NothingFitsError

    args = dict(seq_len=2048, batch=8, num_processes=2, gpu="rtx-4090")
    spec = load_spec("llama-2-70b")
    unchecked = plan("llama-2-70b", None, **args).best.config
    assert unchecked.offload is Offload.PARAMS and unchecked.quantize is Quantize.NONE
    assert host_bytes(spec, unchecked) > parse_size("128GiB")
    with pytest.raises(NothingFitsError, match="outside the training step"):
        plan("llama-2-70b", None, **args, constraints=Constraints(host_memory=parse_size("128GiB")))
    qlora = RunConfig.of(seq_len=2048, micro_batch=1, num_processes=2, sharding="fsdp", offload="params",
                      quantize="4bit", lora_r=16, mixed_precision="bf16", dtype="bf16", grad_checkpointing=True)
    assert host_bytes(spec, qlora) < parse_size("128GiB")
    packed_nf4 = spec.linear_params // 2  # two weights per byte, before absmax and the fp32 embeddings/head
    assert outside_step(spec, qlora).loading > max(packed_nf4, parse_size("24GiB"))
