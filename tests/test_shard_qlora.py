"""QLoRA across processes: DDP on 2 CPU processes (gloo) trains the same adapters as 1 process; FSDP2
sharding of a quantized base is refused in one sentence, by ``memfit train`` and by the planner, which
therefore never prints it (issue 13: every configuration ``memfit plan`` prints is one ``memfit train`` runs).
"""

from __future__ import annotations

import pytest

from _launch_helpers import gloo_launch
from _train_helpers import tiny_config, write_qa
from memfit.config import Quantize, RunConfig, Sharding
from memfit.errors import UserError
from memfit.training import sharding
from memfit.training.loop import run_training
from memfit.training.setup import preflight

pytest.importorskip("bitsandbytes")  # installed by scripts/setup.sh (the quant extra): runs in CI

ARGS = ["--tokenizer", "byte", "--seq-len", "64", "--micro-batch", "1", "--grad-accum", "1", "--max-steps", "4",
        "--lr", "0.01", "--warmup-steps", "0", "--optimizer", "adamw", "--no-packing", "--eval-every", "0",
        "--eval-fraction", "0", "--samples", "0", "--log-every", "1", "--max-grad-norm", "0"]


def test_qlora_ddp_on_two_processes_matches_one(tmp_path):
    # Effective batch 2 either way: 1 process x 2 accumulated micro-batches, or 2 processes x 1. Every rank
    # quantizes the same seeded random base (quant_support.quantized_copy) and DDP averages adapter gradients.
    from safetensors.torch import load_file

    data = write_qa(tmp_path, n=22)
    one = run_training(tiny_config(tmp_path / "one", data=data, max_steps=4, optimizer_lr=1e-2, warmup_steps=0,
                                   run={"optimizer": "adamw", "lora_r": 4, "quantize": "4bit", "micro_batch": 1,
                                        "grad_accum": 2}), show=False)
    two = tiny_config(tmp_path / "two", data=data)
    proc = gloo_launch("-m", "memfit", "train", "--model", two.model, "--data", data, *ARGS, "--lora-r", "4",
                       "--quantize", "4bit", "--output", two.output, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = {k.replace(".default", ""): v for k, v in one.model.state_dict().items() if "lora_" in k}
    ddp = load_file(f"{two.output}/adapter_model.safetensors")  # PEFT's names, without the adapter name
    assert single.keys() == ddp.keys() and len(ddp) == 28  # A and B of 7 projections x 2 layers
    assert any(float(v.abs().max()) > 0 for k, v in ddp.items() if "lora_B" in k)  # trained (B starts at 0)
    assert max(float((single[k] - ddp[k]).abs().max()) for k in ddp) < 1e-5


@pytest.mark.parametrize("shard", ["fsdp", "zero2", "zero3"])
@pytest.mark.parametrize("quantize", ["4bit", "8bit"])
def test_sharded_quantized_base_is_refused_in_one_sentence(shard, quantize):
    run = RunConfig(lora_r=4, quantize=quantize, sharding=shard, num_processes=2)
    expected = (f"--quantize {quantize} cannot be combined with --sharding {shard}: FSDP2 cannot shard bitsandbytes' "
                "quantized weights (their quantization state is lost); use --sharding ddp, where every rank holds "
                "the quantized base and trains the adapters, or drop --quantize.")
    assert sharding.refusal(run, cuda=True) == expected
    assert sharding.refusal(run, cuda=False) == expected
    with pytest.raises(UserError) as err:
        preflight(run)
    assert str(err.value) == expected
    assert sharding.refusal(run.replace(sharding="ddp"), cuda=False) is None


def test_planner_never_proposes_a_sharded_quantized_base():
    from memfit.planning.search import plan
    from memfit.planning.space import Constraints

    result = plan("llama-2-7b", "24GiB", seq_len=512, batch=8, num_processes=2,
                  constraints=Constraints(lora_r=16))
    quantized = [p.config for p in result.plans if p.config.quantize is not Quantize.NONE]
    assert quantized  # QLoRA is proposed ...
    assert all(r.sharding is Sharding.DDP for r in quantized)  # ... only where train runs it
    assert any(p.config.sharding is not Sharding.DDP for p in result.plans)  # sharding itself still is
