"""Host RAM in the plan (``memory.snapshot.host_bytes``, ``memfit plan --host-memory``).

Offloading moves state to the host, and a plan that fits the GPU but not the machine's RAM is no plan. The
case that shows it is FSDP-QLoRA's (Answer.AI, 2024: Llama 2 70B on two 24 GB GPUs): on 2 x RTX 4090 the
fastest plan offloads a bf16 LoRA base (138 GB of host RAM), which a 128 GiB workstation cannot hold; told
so, the planner takes the 4-bit base sharded and offloaded by FSDP2 (39 GB).
"""

from __future__ import annotations

from memfit.config import Offload, Quantize, RunConfig
from memfit.memory.snapshot import host_bytes
from memfit.modelspec import load_spec
from memfit.planning.search import plan
from memfit.planning.space import Constraints
from memfit.units import parse_size


def test_host_bytes_of_an_offloaded_full_finetune_by_hand():
    # fp32 AdamW under FSDP2's parameter offload, 2 ranks: each holds on the host its half of the weights (4 B),
    # gradients (4 B) and both moments (8 B) per parameter, 8 B in all, and fused AdamW's first-step rollback
    # copy of its half of the parameters, 2 B: 10 B per parameter per rank, 20 B per parameter per machine
    # (+ the rotary buffers, stored with the weights).
    spec = load_spec("tiny")
    run = RunConfig(num_processes=2, sharding="fsdp", offload="params", optimizer="adamw-fused")
    p = spec.params
    assert host_bytes(spec, run) == 2 * ((4 * p + spec.buffer_bytes) // 2 + 4 * p // 2 + 8 * p // 2 + 4 * p // 2)
    # without offload only the rollback copy is on the host
    assert host_bytes(spec, run.replace(offload="none")) == 2 * (4 * p // 2)


def test_a_small_host_turns_the_70b_plan_from_an_offloaded_bf16_base_to_fsdp_qlora():
    args = dict(seq_len=2048, batch=8, num_processes=2, gpu="rtx-4090")
    unchecked = plan("llama-2-70b", None, **args).best.config
    spec = load_spec("llama-2-70b")
    assert unchecked.offload is Offload.PARAMS and unchecked.quantize is Quantize.NONE
    assert host_bytes(spec, unchecked) > parse_size("128GiB")
    chosen = plan("llama-2-70b", None, **args, constraints=Constraints(host_memory=parse_size("128GiB"))).best.config
    assert chosen.quantize is Quantize.Q4 and chosen.offload is Offload.PARAMS and str(chosen.sharding) == "fsdp"
    assert host_bytes(spec, chosen) <= parse_size("128GiB")
