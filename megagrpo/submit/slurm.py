"""The Slurm client commands `megagrpo submit` needs: partition sizes from `sinfo`, and `sbatch`."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megagrpo.errors import MegagrpoError


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    default: bool
    available: bool  # sinfo's %a is "up"
    nodes: int  # nodes in the partition
    cpus_per_node: int  # the smallest node's CPU count
    gpus_per_node: int  # the smallest node's GPU count from its gres (0: no GPUs)


# A down controller makes sinfo retry for its MessageTimeout (10 s by default) before it fails.
SINFO_TIMEOUT_S = 30.0
# What `megagrpo submit` cannot check without a controller (it renders the script all the same).
CLUSTER_CHECKS = (
    "the partition exists and is up",
    "it has --nodes nodes",
    "its nodes have --gpus-per-node GPUs and the CPUs asked for",
    "--device auto (taken as gpu)",
)


class NoController(MegagrpoError):
    """No Slurm controller answered: the client commands are not on PATH, or sinfo failed or timed out."""


def have_slurm() -> bool:
    return shutil.which("sinfo") is not None and shutil.which("sbatch") is not None


def _run(cmd: list[str], what: str, timeout: float = 60) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise MegagrpoError(
            f"{cmd[0]} not found: run `megagrpo submit` on a Slurm login node, or use --dry-run"
        ) from None
    except subprocess.TimeoutExpired:
        raise MegagrpoError(f"{' '.join(cmd)} did not answer in {timeout} s; is slurmctld up?") from None
    if r.returncode != 0:
        raise MegagrpoError(f"{what} failed ({' '.join(cmd)}): {(r.stderr or r.stdout).strip()}")
    return r.stdout


def _gpus(gres: str) -> int:
    """GPU count from a gres string: 'gpu:8', 'gpu:a100:4(S:0-1)', 'gpu:2,shard:8' -> 8, 4, 2."""
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total += int(m.group(1))
    return total


def partitions(timeout: float | None = None) -> dict[str, PartitionInfo]:
    """Every partition with its node count and smallest per-node CPU and GPU counts (from `sinfo`).

    Raises NoController, naming the cause, when the clients are missing or sinfo fails or times out.
    """
    if not have_slurm():
        raise NoController("sinfo/sbatch not found on PATH: not a Slurm login node")
    try:
        out = _run(["sinfo", "-h", "-o", "%P|%a|%D|%c|%G"], "listing partitions", timeout or SINFO_TIMEOUT_S)
    except MegagrpoError as e:
        raise NoController(str(e)) from None
    acc: dict[str, dict] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        name, avail, nodes, cpus, gres = parts
        default = name.endswith("*")
        name = name.rstrip("*")
        a = acc.setdefault(
            name, dict(default=default, available=avail == "up", nodes=0, cpus=None, gpus=None)
        )
        a["nodes"] += int(nodes)
        c = int(re.match(r"\d+", cpus).group(0)) if re.match(r"\d+", cpus) else 0
        a["cpus"] = c if a["cpus"] is None else min(a["cpus"], c)
        g = _gpus(gres)
        a["gpus"] = g if a["gpus"] is None else min(a["gpus"], g)
    return {
        n: PartitionInfo(n, a["default"], a["available"], a["nodes"], a["cpus"] or 0, a["gpus"] or 0)
        for n, a in acc.items()
    }


def pick_partition(name: str | None, parts: dict[str, PartitionInfo]) -> PartitionInfo:
    """The named partition, or the cluster's default one; a clear error when there is no such partition."""
    if name is None:
        default = [p for p in parts.values() if p.default]
        if not default:
            raise MegagrpoError(
                f"this cluster has no default partition; pass --partition (one of {', '.join(parts)})"
            )
        return default[0]
    if name not in parts:
        raise MegagrpoError(
            f"--partition {name!r}: no such partition on this cluster; available: "
            f"{', '.join(sorted(parts)) or '(none)'} (see `sinfo`)"
        )
    if not parts[name].available:
        raise MegagrpoError(f"--partition {name!r} is not up (sinfo reports it unavailable); pick another")
    return parts[name]


def sbatch(script: Path, *, test_only: bool = False) -> str:
    """Submit `script`; returns the job id (or, with `test_only`, sbatch's feasibility message)."""
    if test_only:
        # sbatch --test-only reports on stderr and exits 0 when the job could run.
        try:
            r = subprocess.run(
                ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
            )
        except FileNotFoundError:
            raise MegagrpoError("sbatch not found: run on a Slurm login node") from None
        if r.returncode != 0:
            raise MegagrpoError(f"sbatch --test-only rejected {script}: {(r.stderr or r.stdout).strip()}")
        return (r.stderr or r.stdout).strip()
    out = _run(["sbatch", "--parsable", str(script)], f"submitting {script}")
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise MegagrpoError(f"sbatch answered {out.strip()!r} instead of a job id")
    return job_id
