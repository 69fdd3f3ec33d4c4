"""memfit: train and fine-tune causal language models within the GPU memory you have.

Public API (each is what one CLI subcommand calls):

- ``estimate(model, run)``: analytic memory breakdown of one training step (``memory.estimate``).
- ``trace(model, run)``: the same breakdown from the model's real code on fake tensors (``memory.trace``).
- ``plan(model, budget, ...)``: ranked configurations that fit a memory budget (``plan.search``).
- ``maximize(model, budget, "seq-len"|"micro-batch", ...)``: the longest sequence (largest micro-batch) that
  fits, per technique (``planning.maximize``; ``memfit plan --maximize``).
- ``train(config)``: train on Accelerate and report measured against predicted memory (``train.loop``).
- ``read_config(path)`` / ``write_config(tool, path, model, run)``: another tool's training configuration
  (TRL/Trainer, Axolotl, LLaMA-Factory, torchtune) read as a memfit run, or a run written as one
  (``interop``); ``config_realizer(tool)``: a planner candidate as that tool runs it; ``config_engine(tool)``:
  the engine (FSDP2 or DeepSpeed) it runs that candidate's sharding on.

Imports are lazy so that ``import memfit`` and ``memfit --help`` stay fast (torch is not loaded).
"""

from __future__ import annotations

from memfit.integrations.versions import MEMFIT as __version__

__all__ = ["__version__", "estimate", "trace", "plan", "maximize", "train", "read_config", "write_config",
           "config_realizer", "config_engine"]

#: Public names of ``memfit.interop``: ``memfit.read_config`` is ``interop.read``, and so on.
_INTEROP = {"read_config": "read", "write_config": "emit", "config_realizer": "realize", "config_engine": "engine_of"}


def __getattr__(name: str):
    if name == "estimate":
        from memfit.memory.estimate import estimate

        return estimate
    if name == "trace":
        from memfit.memory.trace import trace

        return trace
    if name == "plan":
        from memfit.planning.search import plan

        return plan
    if name == "maximize":
        from memfit.planning.maximize import maximize

        return maximize
    if name == "train":
        from memfit.training.loop import train

        return train
    if name in _INTEROP:
        from memfit import interop

        return getattr(interop, _INTEROP[name])
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
