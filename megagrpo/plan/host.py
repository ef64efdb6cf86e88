"""The host side of the memory plan: what a node's CPU memory holds for the tools of multi-turn rollouts.

Each engine owner runs at most `rollout.multi_turn.max_concurrent_tools` tool calls at once, shared by all
the trajectories it samples (`envs.tools.ToolSlots`). A python-tool call is one sandbox, and holds at most
`PythonEnv.host_bytes_per_call` of host memory: its `memory_mb` limit, its private tmpfs (`scratch_mb`,
RAM) and the sandbox's boot and init processes (`envs.registry.tool_call_host_bytes` asks the environment).
So a node holds

  tools = owners on the node x max_concurrent_tools x one call's bytes

where the owners on a node are, colocated, one per engine (gpus_per_node / engine_tp), and disaggregated,
learner ranks that feed an engine each: at most min(engines, gpus_per_node) on one node. The learner state
that a colocated job offloads to the host while sampling is not counted here. With `--host-mem-gib` the
tools' share is judged against it; without, it is printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megagrpo.errors import MegagrpoError

GIB = 1 << 30


@dataclass(frozen=True)
class HostPlan:
    """Host bytes per node for tool calls, and a verdict when the node's memory is known."""

    owners_per_node: int
    tool_slots: int  # per owner: rollout.multi_turn.max_concurrent_tools (0: no multi-turn)
    tool_call_bytes: int  # one running tool call (a sandbox), 0 for tools that hold nothing of their own
    host_mem_gib: float | None = None  # the node's memory; None: not judged

    @property
    def sandboxes_per_node(self) -> int:
        return self.owners_per_node * self.tool_slots

    @property
    def tools_bytes(self) -> int:
        return self.sandboxes_per_node * self.tool_call_bytes

    @property
    def reasons(self) -> tuple[str, ...]:
        if self.host_mem_gib is None or self.tools_bytes <= self.host_mem_gib * GIB:
            return ()
        return (
            f"host: {self.sandboxes_per_node} tool calls at once per node ({self.owners_per_node} owners x "
            f"rollout.multi_turn.max_concurrent_tools={self.tool_slots}) hold up to "
            f"{self.tools_bytes / GIB:.1f} GiB, more than the node's {self.host_mem_gib:g} GiB; lower "
            "max_concurrent_tools or the sandbox's memory_mb/scratch_mb (environment_options)",
        )

    @property
    def fits(self) -> bool:
        return not self.reasons

    def lines(self) -> list[str]:
        """The host rows of `megagrpo plan`'s table (none without multi-turn tools)."""
        if not self.tool_slots:
            return []
        of = "" if self.host_mem_gib is None else f" of {self.host_mem_gib:g} GiB"
        return [
            f"  {'host, per node':<32}{'GiB':>9}",
            f"  {'tool calls (sandboxes)':<32}{self.tools_bytes / GIB:9.2f}  ({self.owners_per_node} owners x "
            f"{self.tool_slots} at once x {self.tool_call_bytes / GIB:.2f} GiB){of}",
        ]


def host_plan(
    cfg: Any, *, gpus_per_node: int, engines: int, disaggregated: bool, host_mem_gib: float | None = None
) -> HostPlan:
    """The host side of config `cfg` on nodes of `gpus_per_node` GPUs running `engines` engines."""
    if host_mem_gib is not None and host_mem_gib <= 0:
        raise MegagrpoError(f"--host-mem-gib must be > 0, got {host_mem_gib}")
    mt = cfg.rollout.multi_turn
    if not mt.enabled:
        return HostPlan(0, 0, 0, host_mem_gib)
    from megagrpo.envs.registry import tool_call_host_bytes

    if disaggregated:
        owners = min(engines, gpus_per_node)
    else:
        owners = max(1, gpus_per_node // cfg.rollout.engine_tp)
    call = tool_call_host_bytes(
        mt.environment, mt.environment_options, where="rollout.multi_turn.environment"
    )
    return HostPlan(owners, mt.max_concurrent_tools, call, host_mem_gib)
