"""What ``torch.compile`` saves for backward: the compiled joint graph, partitioned as inductor does, on fake tensors.

``--compile`` hands the model to inductor through AOTAutograd, which traces forward + backward as one
joint graph and cuts it with ``min_cut_rematerialization_partition`` (torch._functorch.partitioners): the
forward keeps only the tensors the min cut chooses (cheap element-wise results are recomputed in backward
instead of saved). ``compiled_saved_bytes`` runs the same tracing and the same partitioner (with inductor's
decomposition table, so the graph is the one inductor partitions) on the model's fake tensors, as the exact
trace builds them, and sums the tensors the backward graph takes as saved inputs, each storage once, leaving
out the parameters and buffers (and views of them: resident anyway). Eager autograd's saved set for the same
step is what ``memory/trace.py`` counts as activations + logits at the end of forward.

Known error: this is the saved set of one graph traced without Dynamo's graph breaks (AOTAutograd traces
through Python); where Dynamo breaks the graph (data-dependent control flow in the model's code), each piece
is partitioned on its own and the pieces' boundaries are saved too, which this does not see. Inductor's
buffer reuse and fusion inside forward and backward (their transients) are not modelled: the prediction is
of the saved set, the dominant term of the backward-start peak. For a CUDA target the graph is traced with the
CPU's kernels (``memory/cuda_kernels.py``'s stand-ins are not applied inside it: their backward reads only
shapes, so the partitioner would save nothing for them); with dropout in SDPA that over-counts the CPU's math
path's T x T tensors. Measured against real CPU steps (Llama, hidden 64, 2 layers, vocab 384, B 4, T 64,
AdamW fp32; ``measure.counted_compiled``): compiled 5,160,896 bytes measured, 5,333,948 predicted (+3.4%: the
predicted peak is eager's forward peak, in the loss, which inductor's fused loss does not reach); eager
5,720,988 measured, 5,723,036 predicted. At hidden 128 (vocab 2,048, T 128; ``bench/compile_cpu.py``): compiled
30.98 MiB measured, 28.85 MiB predicted (-6.8%: inductor's backward buffers beside the saved set, which this
leaves at eager's, are larger there); eager 32.84 vs 32.85 MiB. Known error: within about 7% either way.
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from transformers import masking_utils

from memfit.memory.activations import MASKED_PACKING
from memfit.settings.config import RunConfig


def compiled_saved_bytes(net, fake_mode, inputs: dict, mask_path) -> int:
    """Bytes the compiled forward saves for backward (not counting parameters, buffers or views of them).

    ``net``: the model as the exact trace builds it, on fake tensors of ``fake_mode``; ``inputs``: one
    micro-batch's model inputs (fake; ``labels`` among them: the model's own loss, computed inside its forward,
    is compiled with it); ``mask_path``: the attention path to trace under (``mask_path``). Called by
    ``memory.trace.trace`` for ``--compile``.
    """

    named = dict(net.named_parameters()) | dict(net.named_buffers())
    names, tensors = list(named), list(named.values())
    keys = list(inputs)
    captured: list = []

    def loss_of(*args):
        state = dict(zip(names, args[: len(names)], strict=True))
        batch = dict(zip(keys, args[len(names):], strict=True))
        return torch.func.functional_call(net, state, (), {**batch, "use_cache": False}).loss

    compiled = aot_function(loss_of, fw_compiler=_keep, bw_compiler=_keep, decompositions=select_decomp_table(),
                            partition_fn=lambda joint, joint_inputs, **kw: _partition(captured, joint, joint_inputs,
                                                                                      **kw))
    with mask_path, fake_mode:
        compiled(*tensors, *inputs.values())
    return sum(captured)


def mask_path(run: RunConfig, otherwise):
    """The attention-mask path a compiled run takes. Packed rows (``MASKED_PACKING``): transformers'
    ``find_packed_sequence_indices`` skips its data-dependent "nothing packed" check when compiling and returns
    the sequence indices, so the block-causal mask is always built; the stand-in does the same (the check
    cannot run on fake tensors under AOTAutograd's tracing). Otherwise ``otherwise`` (the exact trace's path)."""



    if run.packing not in MASKED_PACKING:
        return otherwise

    def indices(position_ids):
        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # (B, T)

    return mock.patch.object(masking_utils, "find_packed_sequence_indices", indices)


def _keep(graph_module, _example_inputs):
    return graph_module


def _partition(captured: list, joint, joint_inputs, **kwargs):
    """Inductor's partition of the joint graph; records the saved bytes of the backward graph's inputs."""

    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
    captured.append(saved_bytes(joint, bw))
    return fw, bw


def saved_bytes(joint, bw) -> int:
    """Bytes of the distinct storages ``bw`` takes as saved inputs (not tangents), less the joint graph's
    inputs' (parameters, buffers, the batch: resident, not saved activations)."""

    def storage_key(value):
        return value.untyped_storage()._cdata

    resident = {storage_key(n.meta["val"]) for n in joint.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    seen: dict[int, int] = {}
    for node in bw.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        key = storage_key(value)
        if key not in resident:
            seen[key] = value.untyped_storage().nbytes()
    return sum(seen.values())


def with_compiled_saved_set(breakdown, timeline, saved: int):
    """The exact (eager) trace's breakdown with the compiled forward's saved set in place of eager autograd's.

    Eager's saved set is what the trace holds as activations + logits at the end of forward (``E``); the
    compiled one is ``saved`` (``C``). Every sample from the end of forward through backward is moved by
    ``C - E`` (in ``activations``), the optimizer phase is kept, and the peak is taken again. Known error:
    backward frees the saved set as it goes, so late backward samples move by less than ``C - E``, and the
    transients beside the saved set (the loss' and backward's gradients, inductor's fused buffers) are eager's,
    not inductor's; the backward-start peak, where the whole saved set and the logits' gradients meet, is
    the one this is right for.
    """

    forward = [i for i, phase in enumerate(timeline.phases) if phase == "forward"]
    if not forward:
        return breakdown
    end = timeline.samples[forward[-1]]
    delta = saved - (end["activations"] + end["logits"])
    moved = [dict(s, activations=s["activations"] + delta) if i == forward[-1] or phase == "backward" else s
             for i, (s, phase) in enumerate(zip(timeline.samples, timeline.phases, strict=True))]
    totals = [sum(s.values()) for s in moved]
    peak = max(range(len(totals)), key=totals.__getitem__)
    phase_peaks: dict[str, int] = {}
    for total, phase in zip(totals, timeline.phases, strict=True):
        phase_peaks[phase] = max(phase_peaks.get(phase, 0), total + breakdown.other)
    note = (f"--compile: the compiled forward saves {saved:,} bytes for backward (AOTAutograd's min-cut partition "
            f"with inductor's decompositions, memory/compiled.py) where eager autograd saves {saved - delta:,}; "
            "the samples from the end of forward through backward moved by the difference.")
    return replace(breakdown, **{k: int(v) for k, v in moved[peak].items()}, phase=timeline.phases[peak],
                   phase_peaks=phase_peaks, notes=[*breakdown.notes, note])
