"""``--optimizer-in-backward``: each parameter is stepped as soon as its gradient is ready, then freed.

A plain step holds a gradient for every trainable parameter when ``optimizer.step()`` starts (plus
foreach temporaries the size of a parameter group): for a full fine-tune that is the step's peak. Here
every trainable parameter gets its own optimizer (same class, same hyper-parameters), and a
``register_post_accumulate_grad_hook`` runs its ``step()`` and drops its ``.grad`` the moment autograd
has written it, so at most a few gradients exist at once. torchtune's ``optimizer_in_bwd`` does the same.

What it cannot do, and why (each refused in one sentence by ``check``):
- gradient accumulation > 1: the step would happen after the first micro-batch;
- gradient clipping: the global norm is known only after the last gradient, when the others are stepped;
- fp16's loss scaler: gradients would be stepped before they are unscaled and checked for inf;
- several processes: the hook fires on the local gradient, before DDP has averaged it.

``OptimizerInBackward`` is a real ``torch.optim.Optimizer`` (the LR scheduler and Accelerate accept it)
whose ``param_groups`` *are* the per-parameter optimizers' groups and whose ``state`` is shared with them,
so the scheduler's learning rate reaches every parameter and ``state_dict``/``load_state_dict`` make
checkpoints that resume exactly. Its own ``step()`` does nothing: the work was done in backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.errors import UserError
from memfit.settings.config import Precision, RunConfig


def check(run: RunConfig, max_grad_norm: float) -> None:
    """Refuse, in one sentence, what optimizer-in-backward cannot do (grad_accum > 1 is refused by RunConfig)."""
    if not run.optimizer_in_backward:
        return
    if max_grad_norm > 0:
        raise UserError("--optimizer-in-backward steps each parameter before the global gradient norm is known, "
                        "so it cannot clip; add --max-grad-norm 0.")
    if run.mixed_precision is Precision.FP16:
        raise UserError("--optimizer-in-backward cannot run fp16's loss scaler (parameters would be stepped before "
                        "their gradients are unscaled); use bf16 or fp32.")
    if run.num_processes > 1:
        raise UserError("--optimizer-in-backward steps local gradients before data-parallel ranks average them; "
                        "use one process.")


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per trainable parameter, stepped from its post-accumulate-grad hook."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        """``groups``: the parameter groups a plain optimizer would get; ``make``: builds that optimizer
        from a list of groups (called once per parameter with one single-parameter group)."""
        self._per_param: list[torch.optim.Optimizer] = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self._per_param.append(make([{"params": [p], **options}]))
        first = self._per_param[0]
        super().__init__([p for opt in self._per_param for p in opt.param_groups[0]["params"]], first.defaults)
        self._link(from_self=False)
        self._handles: list = []
        self.install_hooks()

    def install_hooks(self) -> None:
        """(Re-)register the step hooks; hooks run in registration order, so re-installing puts them last
        (the exact tracer needs MemTracker's gradient hooks, which read ``.grad``, to run first)."""
        self.remove_hooks()
        self._handles = [opt.param_groups[0]["params"][0].register_post_accumulate_grad_hook(self._hook(opt))
                         for opt in self._per_param]

    def _link(self, from_self: bool) -> None:
        """Make this optimizer's groups and state the per-parameter optimizers' own objects (``from_self``:
        after ``load_state_dict``, this optimizer's new groups replace theirs)."""
        if from_self:
            for opt, group in zip(self._per_param, self.param_groups, strict=True):
                opt.param_groups = [group]
        self.param_groups = [opt.param_groups[0] for opt in self._per_param]
        shared = self.state
        for opt in self._per_param:
            shared.update(opt.state)
            opt.state = shared

    @staticmethod
    def _hook(opt: torch.optim.Optimizer):
        def step_and_free(_param: torch.Tensor) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step_and_free

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - the steps ran in backward
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # rebuilds self.param_groups and self.state as new objects
        for opt in self._per_param:
            opt.state = type(opt.state)()
        self._link(from_self=True)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
