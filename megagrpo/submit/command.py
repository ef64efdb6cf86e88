"""`megagrpo submit CONFIG --nodes N --gpus-per-node G [...]`: check, render, submit, report.

Everything that can be checked before submission is, the checks that need no cluster first: the config
(schema and paths), the mesh against N x G, the memory plan (GPU train jobs), then the partition (exists,
is up, has the nodes, GPUs or CPUs) and the log directory (writable). The rendered script and a snapshot
of the resolved config go to the log directory, so a requeue runs what was submitted. `--dry-run` does
all of this, prints the script, and submits nothing; where no Slurm controller answers, it skips the
partition checks and says so.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megagrpo.errors import MegagrpoError
from megagrpo.submit.render import LAYOUTS, render_layout

if TYPE_CHECKING:
    from megagrpo.submit.resources import JobShape

STAGES = ("train", "sft", "eval", "check")  # check: megagrpo.launch.mesh_check on the config's mesh and model
_SAFE = re.compile(r"^[A-Za-z0-9_./+@:,=-]+$")  # no spaces or shell syntax in #SBATCH paths and names


def add_submit_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    help_ = "render an sbatch script for CONFIG, check it against the cluster and submit it"
    p = sub.add_parser("submit", help=help_, description=help_ + ". See docs/slurm.md.")
    p.add_argument("config", help="YAML config file (see docs/config.md)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, applied before the snapshot is saved")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        required=True,
        help="GPUs per node; in CPU mode (--device cpu) the number of processes per node",
    )
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    p.add_argument("--time", default=None, help="time limit, e.g. 2-00:00:00 (default: the partition's)")
    p.add_argument(
        "--stage",
        choices=STAGES,
        default="train",
        help="what the job runs (default: train); check: the distributed bring-up check (megagrpo.launch.mesh_check: "
        "collectives, group sizes, sharded logprobs vs a single-process reference) on the same shape",
    )
    p.add_argument(
        "--layout",
        choices=("auto", *LAYOUTS),
        default="auto",
        help="single: one node, torchrun; torchrun: a torchrun per node; srun: one srun task per rank "
        "(default: single for 1 node, torchrun for more)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="gpu: request --gres=gpu:G and use NCCL; cpu: G CPU processes per node with gloo, no GPUs "
        "requested (default: gpu when the partition's nodes have gpu gres, else cpu)",
    )
    p.add_argument("--cpus-per-proc", type=int, default=None, help="CPUs per process (default: gpu 8, cpu 1)")
    p.add_argument("--job-name", default=None, help="job name (default: mg-<config file stem>)")
    p.add_argument("--log-dir", default=None, help="log directory (default: <logging.out_dir>/slurm)")
    p.add_argument("--signal-seconds", type=int, default=120, help="USR1 this long before the time limit")
    p.add_argument(
        "--sbatch", action="append", default=[], metavar="OPT", help="extra sbatch option, e.g. --account=x"
    )
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="export K=V in the job")
    p.add_argument("--dry-run", action="store_true", help="check and print the script; submit nothing")
    from megagrpo.plan.command import add_gpu_mem_arg

    add_gpu_mem_arg(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="submit a train job even when its memory plan (`megagrpo plan`) does not fit the GPUs",
    )
    return p


def _log_dir(arg: str | None, out_dir: str) -> Path:
    path = Path(arg) if arg else Path(out_dir) / "slurm"
    path = path if path.is_absolute() else Path.cwd() / path
    if not _SAFE.match(str(path)):
        raise MegagrpoError(f"--log-dir {str(path)!r}: use a path without spaces or shell characters")
    if path.exists() and not path.is_dir():
        raise MegagrpoError(f"--log-dir {path}: exists and is not a directory; pick another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".megagrpo-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise MegagrpoError(
            f"--log-dir {path}: not writable ({e.strerror or e}); pick a directory you can write"
        ) from None
    return path


def _env_lines(pairs: list[str]) -> str:
    lines = []
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise MegagrpoError(f"--env {kv!r}: expected NAME=VALUE, e.g. --env NCCL_SOCKET_IFNAME=ib0")
        lines.append(f"export {k}={shlex.quote(v)}")
    return "\n".join(lines)


def _sbatch_lines(args: argparse.Namespace, shape, partition: str | None) -> str:
    lines = []
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if args.time:
        lines.append(f"#SBATCH --time={args.time}")
    if shape.device == "gpu":
        lines.append(f"#SBATCH --gres=gpu:{shape.procs_per_node}")
    for opt in args.sbatch:
        if not opt.startswith("-") or "\n" in opt:
            raise MegagrpoError(f"--sbatch {opt!r}: expected one sbatch option, e.g. --sbatch=--account=x")
        lines.append(f"#SBATCH {opt}")
    return "\n".join(lines)


def _program(stage: str, cfg, snapshot: Path, log_dir: Path, job_name: str, world: int) -> str:
    """The per-rank program and its arguments, as they appear after `python` or `torchrun` on the
    launcher's command line: a module of the installed package, so the job needs no checkout."""
    if stage == "check":
        m = cfg.mesh
        tp, ep, pp = m.tp, m.ep, m.pp
        if cfg.rollout.placement.disaggregated:
            # Every rank joins the check, the engines' too (their node's interconnect is what it tests), so
            # the learner's TP runs over the whole world; its EP and PP need the learner's rank count.
            tp, ep, pp = (m.tp if world % m.tp == 0 else 1), 1, 1
        out = f'"{log_dir}/{job_name}-$SLURM_JOB_ID.check.json"'
        model = shlex.quote(str(Path(cfg.model.hf_path).resolve()))
        stages = "".join(
            f" --{end}-stage-layers {n}"
            for end, n in (("first", m.first_stage_layers), ("last", m.last_stage_layers))
            if pp > 1 and n is not None
        )  # uneven stages: a layer count that pp does not divide builds only with them
        return (
            f"-m megagrpo.launch.mesh_check --out {out} --tp {tp} --ep {ep} --pp {pp}{stages} --model {model}"
        )
    return f"-m megagrpo.launch.run {stage} {shlex.quote(str(snapshot))} --resume auto"


def _roles_comment(sizes, roles: list[str]) -> str:
    """The script's note of which ranks learn and which serve rollouts (`config.mesh_rules.rank_roles`)."""
    if not roles:
        engines = f"{sizes.num_engines} colocated SGLang engine(s)" if sizes.num_engines else "no engine"
        return f"# Roles: all {sizes.world_size} ranks learn; {engines}."
    head = (
        f"# Roles (rollout.placement.kind=disaggregated, by rank index): ranks 0-{sizes.learners - 1} "
        f"learn, the last {sizes.engine_ranks} run SGLang servers only."
    )
    return "\n".join([head, *(f"#   {r}" for r in roles)])


def _memory_plan(cfg, args: argparse.Namespace):
    """(MemoryPlan | None, MegagrpoError | None): the plan, or why there is none (raised later, and
    only if the job turns out to run on GPUs). Pure arithmetic on the config and the model's
    config.json, so it runs before anything asks the cluster."""
    from megagrpo.plan.command import plan_for

    try:
        return plan_for(
            cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gib
        )[0], None
    except MegagrpoError as e:
        return None, e


def _memory_verdict(plan, error: MegagrpoError | None, args: argparse.Namespace) -> str:
    """The plan's one-line verdict; a MegagrpoError when it does not fit or is missing (unless --force).
    A disaggregated plan (`plan.pools.DisaggregatedPlan`) fits only if both of its pools do, and the
    error names the pool that does not."""
    if plan is None:
        if not args.force:
            raise MegagrpoError(f"{error}; or pass --force to submit without a memory plan")
        return "memory plan: none (--force)"
    verdict = f"memory plan: {plan.summary()}"
    if plan.fits:
        return f"{verdict}: fits"
    if not args.force:
        cpu = ", pass --device cpu for a CPU partition" if args.device == "auto" else ""
        pools = getattr(plan, "failing", None)
        which = f" ({' and '.join(pools)})" if pools else ""
        raise MegagrpoError(
            f"the memory plan does not fit {args.gpu_mem_gib:g} GiB per GPU{which}:\n{plan.table()}\n"
            "change the config (try `megagrpo plan`), give the real GPU size with --gpu-mem-gib"
            f"{cpu}, or pass --force to submit anyway"
        )
    print(
        f"megagrpo submit: warning: --force: the memory plan does not fit:\n{plan.table()}", file=sys.stderr
    )
    return f"{verdict}: DOES NOT FIT (--force)"


def _job_shape(args: argparse.Namespace, device: str) -> JobShape:
    from megagrpo.submit.resources import JobShape

    cpus_per_proc = args.cpus_per_proc or (8 if device == "gpu" else 1)
    if cpus_per_proc < 1:
        raise MegagrpoError(f"--cpus-per-proc must be >= 1, got {cpus_per_proc}")
    return JobShape(args.nodes, args.gpus_per_node, device, cpus_per_proc)


def run_submit(args: argparse.Namespace) -> int:
    from megagrpo.config import dump_config, load_config
    from megagrpo.submit.resources import check_mesh_fits, check_partition_fits, mesh_warnings, role_layout
    from megagrpo.submit.slurm import CLUSTER_CHECKS, NoController, partitions, pick_partition, sbatch

    cfg = load_config(args.config, args.overrides, stage="eval" if args.stage == "check" else args.stage)
    for name in ("nodes", "gpus_per_node", "signal_seconds"):
        if getattr(args, name) < 1:
            raise MegagrpoError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    # What needs no cluster is checked first, so a job that cannot run is refused even where no
    # controller answers, and without waiting for one. The memory plan models the colocated RL step on
    # GPUs; --device auto is taken as GPUs here (the usual case) and the verdict dropped if the
    # partition turns out to have none.
    if args.device != "auto":
        check_mesh_fits(cfg, _job_shape(args, args.device), args.stage)
    elif cfg.rollout.placement.disaggregated:
        # A disaggregated layout's rules (whole engines per node, ranks left to learn) are the same on GPUs
        # and CPUs, so they are checked for GPUs before the cluster is asked.
        check_mesh_fits(cfg, _job_shape(args, "gpu"), args.stage)
    if args.stage in ("train", "sft"):
        from megagrpo.trainer.preflight import check_stage_inputs

        # the job starts the stage with `--resume auto` (job_command): the same checks the CLI makes
        # before any process, here before any allocation
        check_stage_inputs(cfg, args.stage, "auto")
    plan = plan_error = verdict = None
    if args.device != "cpu" and args.stage == "train":
        plan, plan_error = _memory_plan(cfg, args)
        if plan is not None or args.device == "gpu":
            verdict = _memory_verdict(plan, plan_error, args)
    try:
        parts, unreachable = partitions(), None
    except NoController as e:
        if not args.dry_run:
            raise MegagrpoError(
                f"no Slurm controller answered ({e}); submitting needs one: run on a login node of a "
                "cluster whose slurmctld is up, or pass --dry-run to render the script without the "
                "cluster checks"
            ) from None
        parts, unreachable = None, str(e)
    part = pick_partition(args.partition, parts) if parts is not None else None
    device = args.device
    if device == "auto":
        device = "gpu" if part is None or part.gpus_per_node > 0 else "cpu"
    shape = _job_shape(args, device)
    sizes = check_mesh_fits(cfg, shape, args.stage)
    if part is not None:
        check_partition_fits(shape, part)
    else:
        print(
            f"megagrpo submit: no Slurm controller answered ({unreachable}); cluster checks skipped: "
            + "; ".join(CLUSTER_CHECKS),
            file=sys.stderr,
        )
    for w in mesh_warnings(cfg, shape):
        print(f"megagrpo submit: warning: {w}", file=sys.stderr)
    if device == "cpu":
        verdict = None  # --device auto on a CPU partition: GPU memory does not apply
    elif verdict is None and args.stage == "train":  # --device auto without a plan, now known to be GPUs
        verdict = _memory_verdict(plan, plan_error, args)
    if verdict is not None:
        print(f"megagrpo submit: {verdict}", file=sys.stderr)
    layout = args.layout if args.layout != "auto" else ("single" if args.nodes == 1 else "torchrun")
    if layout == "single" and args.nodes != 1:
        raise MegagrpoError(
            f"--layout single runs on one node; got --nodes {args.nodes} (use torchrun or srun)"
        )

    job_name = args.job_name or f"mg-{Path(args.config).stem}"
    if not _SAFE.match(job_name):
        raise MegagrpoError(f"--job-name {job_name!r}: use letters, digits and . _ - only")
    log_dir = _log_dir(args.log_dir, cfg.logging.out_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base, n = stamp, 0
    while (log_dir / f"{job_name}-{stamp}.yaml").exists():  # two submissions within one second
        n += 1
        stamp = f"{base}.{n}"
    snapshot = log_dir / f"{job_name}-{stamp}.yaml"
    snapshot.write_text(dump_config(cfg))
    venv = Path(sys.prefix) if sys.prefix != sys.base_prefix else None
    roles = role_layout(sizes, cfg.rollout.engine_tp, shape) if sizes.engine_ranks else []
    values = dict(
        job_name=job_name,
        nodes=str(shape.nodes),
        procs_per_node=str(shape.procs_per_node),
        cpus_per_proc=str(shape.cpus_per_proc),
        cpus_per_node=str(shape.procs_per_node * shape.cpus_per_proc),
        log_dir=str(log_dir),
        signal_seconds=str(args.signal_seconds),
        sbatch_lines=_sbatch_lines(args, shape, args.partition),
        env_lines=_env_lines(args.env),
        workdir=shlex.quote(str(Path.cwd())),
        venv=shlex.quote(str(venv)) if venv else '""',
        python=shlex.quote(sys.executable),
        device=device,
        stage=args.stage,
        program=_program(args.stage, cfg, snapshot, log_dir, job_name, sizes.world_size),
        roles=_roles_comment(sizes, roles),
    )
    script = render_layout(layout, values)
    script_path = log_dir / f"{job_name}-{stamp}.sbatch"
    script_path.write_text(script)
    summary = (
        f"{layout} layout, {shape.describe()} ({device}), world {sizes.world_size}, DP {sizes.dp}, "
        f"{sizes.num_engines} SGLang engine(s)"
    )
    if roles:
        summary += (
            f", disaggregated: {sizes.learners} learner and {sizes.engine_ranks} rollout ranks\n  "
            + "\n  ".join(roles)
        )
    if args.dry_run:
        sys.stdout.write(script)
        print(f"megagrpo submit: dry run, nothing submitted; {summary}", file=sys.stderr)
        print(f"megagrpo submit: script {script_path}; config snapshot {snapshot}", file=sys.stderr)
        return 0
    job_id = sbatch(script_path)
    log = log_dir / f"{job_name}-{job_id}.out"
    print(f"submitted job {job_id}: {summary}")
    print(f"  log:      {log}")
    print(f"  script:   {script_path}")
    print(f"  config:   {snapshot}")
    if args.stage == "check":
        print(f"  result:   {log_dir / f'{job_name}-{job_id}.check.json'}")
    else:
        print(f"  metrics:  {Path(cfg.logging.out_dir).resolve()}")
        print(f"  checkpoints: {Path(cfg.checkpoint.dir).resolve()}")
        print(f"  preempt (checkpoint + requeue): scancel --batch --signal=USR1 {job_id}")
    print(f"  watch:    tail -f {log}")
    return 0
