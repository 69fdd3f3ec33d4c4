"""memfit: train and fine-tune causal language models within the GPU memory you have.

Public API: what the ``memfit`` commands call (``cli/`` reaches nothing else but the settings, the leaves
and ``report/``'s renderers; tests/test_layers.py holds it). Each name is imported on first use.

Run: the breakdown, the plan, the training.

- ``estimate(model, run)``: analytic memory breakdown of one training step (``memory.estimate``);
  ``compare(model, run)``: the same for each of ``classic_regimes(run)`` (fp32, AMP, pure bf16, LoRA,
  QLoRA; ``memfit estimate --compare``).
- ``trace(model, run)``: the same breakdown from the model's real code on fake tensors (``memory.trace``).
- ``plan(model, budget, ...)``: ranked configurations that fit a memory budget (``planning.search``), within
  ``Constraints`` (what the user pinned or allowed; ``planning.space``) and ``SAFETY_MARGIN``.
- ``maximize(model, budget, "seq-len"|"micro-batch", ...)``: the longest sequence (largest micro-batch) that
  fits, per technique (``planning.maximize``; ``memfit plan --maximize``); ``largest_note(result, target)``:
  the sentence saying what one step more would need.
- ``device_phases(spec, run, breakdown, device)``: every phase of a run on one rank (loading, wrapping, the
  step, evaluation, saves, samples) with its predicted reserved memory, the CUDA context and NCCL's buffers
  (``memory.phases``; ``memfit estimate``'s phases table, and what the fit rule reads).
- ``host_bytes(spec, run)``: host RAM of a run's offloaded state and rollback snapshot (``memory.snapshot``).
- ``train(config)``: train on Accelerate and return the run summary's JSON form (``training.loop``);
  ``check_equivalence(config)``: whether micro-batch x accumulation trains the same weights as one big batch
  (``training.equivalence``); ``default_precision()``: the autocast train uses when none is given
  (``training.setup``); ``check_inputs(model, data, revision)``: a missing or mistyped model or data path
  refused from the file system alone, before torch loads (``training.inputs``); ``check_not_a_run_file(path,
  flag_name=...)``: refuse another command's output file at a name a training run writes in its folder
  (``training.runfolder``; ``memfit plan --output``); ``seq_len_as_train(model, data, run, context=...)``: the
  ``--seq-len`` train would run when none is given (``training.derived``; estimate's and plan's default).
- ``preview_record(config, index)``: one training record as the model sees it, loss mask marked
  (``data.prep``; ``memfit data preview``).

Inputs: the model and the machine.

- ``load_spec(model, trust_remote_code, revision)``: a preset, model folder, config.json or Hub id as a
  ``ModelSpec``; ``check_seq_len(seq_len, positions)``: refuse a sequence the model cannot take;
  ``load_presets()``: the architecture presets (``spec.model``).
- ``load_gpus()`` / ``detect_gpu()``: the GPU table, and the listed GPU present here (``planning.gpus``).
- ``progress_bars(show)``: Hub download bars on or off around a fetch (``integrations.hub``);
  ``quiet_import_notices()``: libraries' import-time notices kept off the output (``integrations.hf_compat``);
  ``derivation_progress(listener)``: a line to ``listener`` before each memory recipe is derived (``memory.derive``).

Launch: ``launch_command(model, run, config_file)``, ``accelerate_config(run, machine_rank)``,
``write_accelerate_config(run, path)`` (one file per node on several), ``torchrun_command(model, run, node_rank)``,
``MAIN_HOST`` and ``ACCELERATE_CONFIG_FILE`` (``planning.launch``).

Across nodes: ``plan_nodes(model, budget, gpus_per_node=...)``: the fastest plan over node counts
(``planning.nodes``); ``rank_layouts(spec, run)``: what a rank holds under each sharding on ``run.nodes``
nodes (``memory.hybrid_shard``).

Other tools: ``read_config(path)`` / ``write_config(tool, path, model, run)``: another tool's training
configuration (TRL/Trainer, Axolotl, LLaMA-Factory, torchtune) read as a memfit run, or a run written as one
(``interop``); ``config_realizer(tool)``: a planner candidate as that tool runs it; ``config_engine(tool)``:
the engine (FSDP2 or DeepSpeed) it runs that candidate's sharding on; ``config_stack(tool, reading)``: the stack
(trainer, versions: ``settings.stack``) whose memory the candidate is priced with.

Page: ``serve(host, port, open_browser)``: the estimate and the plan as a local web page over these same names
(``web.app``; the ``web`` extra; ``memfit serve``).

The settings these take and give are ``memfit.settings`` (``RunConfig``, ``TrainConfig``), their errors
``memfit.errors``, their units ``memfit.units``; the renderers of their results are ``memfit.report``.

Imports are lazy so that ``import memfit`` and ``memfit --help`` stay fast (torch is not loaded).
"""

from __future__ import annotations

import importlib

from memfit.integrations.versions import MEMFIT as __version__

#: Public name -> (module, name there): the one list of the public API (``__all__`` is made from it, and
#: tests/test_layers.py reads it as the imports it makes). Looked up on each access, not cached: the module's
#: current attribute is what a caller gets (a test that patches ``memfit.training.loop.train`` is seen).
_PUBLIC = {
    "estimate": ("memfit.memory.estimate", "estimate"),
    "compare": ("memfit.memory.estimate", "compare"),
    "classic_regimes": ("memfit.memory.estimate", "classic_regimes"),
    "trace": ("memfit.memory.trace", "trace"),
    "host_bytes": ("memfit.memory.snapshot", "host_bytes"),
    "device_phases": ("memfit.memory.phases", "device_phases"),
    "plan": ("memfit.planning.search", "plan"),
    "SAFETY_MARGIN": ("memfit.planning.search", "SAFETY_MARGIN"),
    "Constraints": ("memfit.planning.space", "Constraints"),
    "maximize": ("memfit.planning.maximize", "maximize"),
    "largest_note": ("memfit.planning.maximize", "largest_note"),
    "train": ("memfit.training.loop", "train"),
    "check_equivalence": ("memfit.training.equivalence", "check_equivalence"),
    "default_precision": ("memfit.training.setup", "default_precision"),
    "check_inputs": ("memfit.training.inputs", "check_inputs"),
    "check_not_a_run_file": ("memfit.training.runfolder.folder", "check_not_a_run_file"),
    "seq_len_as_train": ("memfit.training.derived", "seq_len_as_train"),
    "preview_record": ("memfit.data.prep", "preview_record"),
    "load_spec": ("memfit.spec.model", "load_spec"),
    "check_seq_len": ("memfit.spec.model", "check_seq_len"),
    "load_presets": ("memfit.spec.model", "load_presets"),
    "load_gpus": ("memfit.planning.gpus", "load_gpus"),
    "detect_gpu": ("memfit.planning.gpus", "detect_gpu"),
    "progress_bars": ("memfit.integrations.hub", "progress_bars"),
    "quiet_import_notices": ("memfit.integrations.hf_compat", "quiet_import_notices"),
    "derivation_progress": ("memfit.memory.derive", "progress"),
    "launch_command": ("memfit.planning.launch", "launch_command"),
    "accelerate_config": ("memfit.planning.launch", "accelerate_config"),
    "write_accelerate_config": ("memfit.planning.launch", "write_accelerate_config"),
    "ACCELERATE_CONFIG_FILE": ("memfit.planning.launch", "DEFAULT_CONFIG_FILE"),
    "torchrun_command": ("memfit.planning.launch", "torchrun_command"),
    "MAIN_HOST": ("memfit.planning.launch", "MAIN_HOST"),
    "plan_nodes": ("memfit.planning.nodes", "plan_nodes"),
    "rank_layouts": ("memfit.memory.hybrid_shard", "rank_layouts"),
    "read_config": ("memfit.interop", "read"),
    "write_config": ("memfit.interop", "emit"),
    "config_realizer": ("memfit.interop", "realize"),
    "config_engine": ("memfit.interop", "engine_of"),
    "config_stack": ("memfit.interop", "stack_of"),
    "serve": ("memfit.web.app", "serve"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
