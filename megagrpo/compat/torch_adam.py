"""megatron-core 0.19.2's DistributedOptimizer over torch's AdamW, the optimizer it falls back to when
neither Transformer Engine nor Apex is installed (`megatron.core.optimizer.USING_PYTORCH_OPTIMIZER`).

This is not a CPU matter: a GPU node without TE/Apex takes the same fallback (seen on an H100 on
2026-11-24, where the GPU tier's checkpoint resume raised the KeyError below). So it has its own
switch, the fallback itself, and `learner.optimizer.build_optimizer` applies it on any device.

The fact (first found on the CPU, fact 10 there): torch's AdamW keeps a per-parameter `step` tensor.
`DistributedOptimizer.load_state_dict` gives every parameter the SAME step tensor, so AdamW advances it
once per parameter and the bias correction is wrong after a resume; and
`_set_main_param_and_optimizer_states` raises KeyError 'step' on the fully-reshardable load path, since
the checkpoint carries only `param`, `exp_avg` and `exp_avg_sq`. -> skip the state keys the checkpoint
does not carry, and un-share `step` after a load.
"""

from __future__ import annotations

from typing import Any

import torch

from megagrpo.compat.patching import replace

REASON = (
    "torch AdamW (no apex/TE) keeps a per-param 'step' tensor: the fully-reshardable load raises "
    "KeyError 'step', and load_state_dict shares one step tensor across params"
)


def needed() -> bool:
    """True when megatron-core wraps torch's AdamW (no TE, no Apex), on the CPU or a GPU."""
    from megatron.core import optimizer

    return bool(getattr(optimizer, "USING_PYTORCH_OPTIMIZER", False))


def apply() -> bool:
    """Install the two patches when `needed()`; idempotent. Returns whether they are in place."""
    if not needed():
        return False
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    up_set = cls._set_main_param_and_optimizer_states
    up_load = cls.load_state_dict

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            missing = [k for k in self.optimizer.state[main_param] if k not in tensors]
            # upstream skips non-tensor entries: None keeps the live value (step comes from param_groups)
            tensors = {**tensors, **dict.fromkeys(missing)}
        up_set(self, model_param, tensors)

    def load_state_dict(self: Any, state_dict: Any) -> None:
        up_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()

    replace(cls, "_set_main_param_and_optimizer_states", set_states, reason=REASON)
    replace(cls, "load_state_dict", load_state_dict, reason=REASON)
    return True
