"""The policy model's MoE routers, and forward hooks on them that hand each router call to the active pass.

megatron-core's `TopKRouter` owns a `RouterReplay` (`router.router_replay`) when the model is built with
`moe_enable_routing_replay`. Its action is set here per router call, never globally:

* inside a hooked chunk forward (between `before_forward` and `after_forward`): RECORD, REPLAY_FORWARD or
  none, as the pass asks;
* outside it, while autograd runs a backward (the activation-recompute forward of a checkpointed layer):
  REPLAY_BACKWARD, which pops the routes that REPLAY_FORWARD queued for this router, in micro-batch order
  (megatron's schedules run each chunk's backwards in the order of its forwards);
* otherwise (a forward that nobody hooked): none, so the router computes its own top-k.

The hooks are PyTorch module hooks on the router modules (no change to megatron's code). The post hook
also recomputes the router logits from the router's input (`router.gating`, the same fp32 math, no
autograd) for the statistics and the RSPO weights.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from megagrpo.errors import MegagrpoError


class RouterPass(Protocol):
    """What `RouterTaps` calls for each router call of the pass that owns the current forward."""

    def in_forward(self) -> bool: ...

    def router_pre(self, slot: RouterSlot, hidden: Tensor) -> None: ...

    def router_post(self, slot: RouterSlot, hidden: Tensor) -> None: ...


@dataclass
class RouterSlot:
    module: Any  # megatron TopKRouter
    moe: int  # index among the model's MoE layers (0-based, global over pipeline stages)
    pushes: int = 0  # routes queued for REPLAY_FORWARD in the current pass
    pops: int = 0  # of which consumed again by REPLAY_BACKWARD (activation recompute)

    @property
    def replay(self) -> Any:  # megatron RouterReplay or None
        return getattr(self.module, "router_replay", None)

    def logits(self, hidden: Tensor) -> Tensor:
        """fp32 router logits `[n, E]` of the router input `[s, b, H]` (no autograd)."""
        with torch.no_grad():
            return self.module.gating(hidden.detach()).reshape(-1, self.module.config.num_moe_experts).float()

    def own_topk(self, logits: Tensor) -> Tensor:
        """int64 `[n, K]`: the experts this router chooses by itself for these logits (megatron's own
        top-k function, with the model's score function, expert bias and group score)."""
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        from megagrpo.moe.group_topk import ModelGroupRule

        c = self.module.config
        with torch.no_grad():
            _, idx = topk_routing_with_score_function(
                logits,
                c.moe_router_topk,
                use_pre_softmax=c.moe_router_pre_softmax,
                num_groups=c.moe_router_num_groups,
                group_topk=c.moe_router_group_topk,
                scaling_factor=c.moe_router_topk_scaling_factor,
                score_function=c.moe_router_score_function,
                expert_bias=getattr(self.module, "expert_bias", None),
                router_replay=ModelGroupRule(),  # the model's group score, as GroupScoredRouter
                dense_output=True,
            )
        return idx.to(torch.int64)


def _unwrap(m: Any) -> Any:
    while hasattr(m, "module") and not hasattr(m, "decoder"):
        m = m.module
    return m


@dataclass
class RouterTaps:
    """The routers of one learner's policy model (all its chunks), with hooks installed once.

    `by_chunk[id(chunk)]` lists the routers of a model chunk (the object megatron's schedule passes to the
    forward step, and its unwrapped module). `active` is the pass whose hooks saw the latest chunk forward.
    """

    slots: list[RouterSlot]
    by_chunk: dict[int, list[RouterSlot]]
    moe_layers: list[int]  # global 0-based layer index of each MoE layer
    num_experts: int
    topk: int
    config: Any
    active: RouterPass | None = None
    state: dict[str, Any] = field(default_factory=dict)  # per-learner state kept across steps (drift)
    _handles: list[Any] = field(default_factory=list)

    def install(self) -> None:
        for slot in self.slots:
            self._handles.append(slot.module.register_forward_pre_hook(functools.partial(self._pre, slot)))
            self._handles.append(slot.module.register_forward_hook(functools.partial(self._post, slot)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def state_dict(self) -> dict:
        """What must survive a checkpoint: the drift tracker's previous load (JSON-serialisable)."""
        drift = self.state.get("drift")
        return {"drift": None if drift is None else drift.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        from megagrpo.moe.stats import LoadDriftTracker

        self.state.pop("drift", None)
        if st.get("drift") is not None:
            tracker = LoadDriftTracker()
            tracker.load_state_dict(st["drift"])
            self.state["drift"] = tracker

    def reset_replay(self) -> None:
        """Forget every queued/recorded route and action (between passes)."""
        for slot in self.slots:
            slot.pushes = slot.pops = 0
            if slot.replay is not None:
                slot.replay.clear_indices()
                slot.replay.clear_router_replay_action()

    def _pre(self, slot: RouterSlot, _module: Any, args: tuple) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        p = self.active
        if p is not None and p.in_forward():
            p.router_pre(slot, args[0])
            return
        rr = slot.replay
        if rr is None:
            return
        if torch._C._current_graph_task_id() != -1 and rr.replay_backward_list:
            rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)  # activation recompute
            slot.pops += 1
        else:
            rr.clear_router_replay_action()

    def _post(self, slot: RouterSlot, _module: Any, args: tuple, _output: Any) -> None:
        p = self.active
        if p is not None and p.in_forward():
            p.router_post(slot, args[0])


_TAPS: weakref.WeakKeyDictionary[Any, RouterTaps] = weakref.WeakKeyDictionary()


def router_taps(learner: Any) -> RouterTaps:
    """The (cached) `RouterTaps` of `learner.model`; raises MegagrpoError for a dense model."""
    taps = _TAPS.get(learner)
    if taps is not None:
        return taps
    from megatron.core.transformer.moe.router import TopKRouter

    from megagrpo.learner.model import model_config

    arch = learner.arch
    if not arch.is_moe:
        raise MegagrpoError(f"routing replay and router statistics need a MoE model; {arch.family} is dense")
    moe_layers = arch.moe_layers()
    slots: list[RouterSlot] = []
    by_chunk: dict[int, list[RouterSlot]] = {}
    for chunk in learner.model:
        mine = []
        for m in _unwrap(chunk).modules():
            if isinstance(m, TopKRouter):
                layer = int(m.layer_number) - 1  # megatron's global, 1-based layer number
                if layer not in moe_layers:
                    raise RuntimeError(f"router at layer {layer} is not a MoE layer of {moe_layers}")
                mine.append(RouterSlot(m, moe_layers.index(layer)))
        by_chunk[id(chunk)] = mine
        by_chunk[id(_unwrap(chunk))] = mine
        slots.extend(mine)
    taps = RouterTaps(
        slots, by_chunk, moe_layers, arch.num_experts, arch.moe_topk, model_config(learner.model)
    )
    taps.install()
    _TAPS[learner] = taps
    return taps
