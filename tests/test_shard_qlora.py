"""QLoRA across processes: DDP and FSDP2 (the 4-bit base sharded) on 2 CPU processes (gloo) train the same
adapters as 1 process, and the sharded run resumes; FSDP2 sharding of an 8-bit base is refused in one sentence,
by ``memfit train`` and by the planner, which therefore never prints it (issue 13: every configuration
``memfit plan`` prints is one ``memfit train`` runs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _launch_helpers import gloo_launch
from _train_helpers import tiny_config, write_qa
from memfit.errors import UserError
from memfit.settings.config import Quantize, RunConfig, Sharding
from memfit.spec import engines
from memfit.training import sharding
from memfit.training.loop import run_training
from memfit.training.setup import preflight

pytest.importorskip("bitsandbytes")  # installed by scripts/setup.sh (the quant extra): runs in CI

from _gloo_cases import QLORA_ARGS as ARGS  # the flags of every launch here


def _single(tmp_path, data: str) -> dict:
    """The 1-process reference's adapters: effective batch 2 as 1 process x 2 accumulated micro-batches."""
    one = run_training(tiny_config(tmp_path / "one", data=data, max_steps=4, lr=1e-2, warmup_steps=0,
                                   run={"optimizer": "adamw", "lora_r": 4, "quantize": "4bit", "micro_batch": 1,
                                        "grad_accum": 2}), show=False)
    return {k.replace(".default", ""): v for k, v in one.model.state_dict().items() if "lora_" in k}


@pytest.mark.launch_cases("qlora-ddp")
def test_qlora_ddp_on_two_processes_matches_one(tmp_path, gloo_runs):
    # Effective batch 2 either way: 1 process x 2 accumulated micro-batches, or 2 processes x 1. Every rank
    # quantizes the same seeded random base (quant_support.quantized_copy) and DDP averages adapter gradients.
    # The launch (_gloo_cases): ARGS --lora-r 4 --quantize 4bit on 22 samples.
    launched = gloo_runs["qlora-ddp"]
    assert launched.returncode == 0, launched.failure()
    single = _single(tmp_path, launched.paths["data"])
    ddp = _adapters(launched.paths["output"])
    assert single.keys() == ddp.keys() and len(ddp) == 28  # A and B of 7 projections x 2 layers
    assert any(float(v.abs().max()) > 0 for k, v in ddp.items() if "lora_B" in k)  # trained (B starts at 0)
    assert max(float((single[k] - ddp[k]).abs().max()) for k in ddp) < 1e-5


def _adapters(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{path}/adapter_model.safetensors")  # PEFT's names, without the adapter name


def _qlora_single_and_fsdp(tmp_path, *extra: str):
    data = write_qa(tmp_path, n=22)
    single = _single(tmp_path, data)
    two = tiny_config(tmp_path / "two", data=data)
    launch = ["-m", "memfit", "train", "--model", two.source.model, "--data", data, *ARGS, "--lora-r", "4",
              "--quantize", "4bit", "--sharding", "fsdp", "--save-every", "2", *extra, "--output", two.folder.output]
    proc = gloo_launch(*launch, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return single, launch, two.folder.output


@pytest.mark.launch_cases("qlora-fsdp")
def test_qlora_fsdp_shards_the_4bit_base_and_matches_one_process(tmp_path, gloo_runs):
    # The packed NF4 weights are stored as fp32 (quant_support.shards_packed_weights), so FSDP2 shards them
    # like any frozen parameter; each layer's quantization state stays whole on every rank. Same effective
    # batch as the single process (2 ranks x 1 micro-batch vs 1 x 2 accumulated), same adapters.
    # The launch (_gloo_cases): ARGS --lora-r 4 --quantize 4bit --sharding fsdp --save-every 2 on 22 samples.
    from torch.distributed.checkpoint import FileSystemReader

    launched = gloo_runs["qlora-fsdp"]
    assert launched.returncode == 0, launched.failure()
    single, output = _single(tmp_path, launched.paths["data"]), launched.paths["output"]
    sharded = _adapters(output)
    assert single.keys() == sharded.keys() and len(sharded) == 28
    assert any(float(v.abs().max()) > 0 for k, v in sharded.items() if "lora_B" in k)  # trained (B starts at 0)
    assert max(float((single[k] - sharded[k]).abs().max()) for k in sharded) < 1e-5
    # The checkpoint holds each rank's half of the packed q_proj: 64 x 64 NF4 weights = 2,048 bytes = 512 fp32
    # values, stored (512, 1) and split by rows over 2 ranks.
    meta = FileSystemReader(str(Path(output) / "checkpoints/step-2" / sharding.DCP_DIR)).read_metadata()
    packed = meta.state_dict_metadata["app.model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert [tuple(c.sizes) for c in packed.chunks] == [(256, 1), (256, 1)]


@pytest.mark.slow
def test_qlora_fsdp_resumes_from_its_sharded_checkpoint(tmp_path):
    single, launch, output = _qlora_single_and_fsdp(tmp_path)
    shutil.rmtree(Path(output) / "checkpoints" / "step-4")
    proc = gloo_launch(*launch, "--resume", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _adapters(output)
    assert max(float((single[k] - resumed[k]).abs().max()) for k in resumed) < 1e-5


@pytest.mark.slow
def test_qlora_fsdp_with_the_base_offloaded_matches_one_process(tmp_path):
    # FSDP-QLoRA with FSDP2's parameter offload (the 70B-on-two-24GB-GPUs recipe; memfit plan picks it when the
    # host is too small for a bf16 base): the packed shards live on the host and are gathered per layer.
    single, _, output = _qlora_single_and_fsdp(tmp_path, "--offload", "params")
    sharded = _adapters(output)
    assert max(float((single[k] - sharded[k]).abs().max()) for k in sharded) < 1e-5


@pytest.mark.parametrize("shard", ["fsdp", "zero2", "zero3"])
def test_sharded_8bit_base_is_refused_in_one_sentence(shard):
    run = RunConfig.of(lora_r=4, quantize="8bit", sharding=shard, num_processes=2)
    expected = (f"--quantize 8bit cannot be combined with --sharding {shard}: FSDP2 cannot shard bitsandbytes' "
                "8-bit weights (their row scales are lost); use --quantize 4bit, which shards, or --sharding ddp.")
    assert engines.refusal(run, cuda=True) == expected
    assert engines.refusal(run, cuda=False) == expected
    with pytest.raises(UserError) as err:
        preflight(run)
    assert str(err.value) == expected
    assert engines.refusal(run.replace(sharding="ddp"), cuda=False) is None
    assert engines.refusal(run.replace(quantize="4bit"), cuda=False) is None


def test_planner_never_proposes_a_sharded_8bit_base():
    from memfit.planning.search import plan
    from memfit.planning.space import Constraints

    result = plan("llama-2-7b", "24GiB", seq_len=512, batch=8, num_processes=2,
                  constraints=Constraints(lora_r=16))
    eight = [p.config for p in result.plans if p.config.quantize is Quantize.Q8]
    assert eight  # 8-bit QLoRA is proposed ...
    assert all(r.sharding is Sharding.DDP for r in eight)  # ... only where train runs it
    four = [p.config for p in result.plans if p.config.quantize is Quantize.Q4]
    assert any(r.sharding is not Sharding.DDP for r in four)  # a 4-bit base is sharded too
