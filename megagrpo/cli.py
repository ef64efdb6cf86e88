"""`megagrpo` command line: train, sft, eval, convert, probe, submit, plan.

User errors (`MegagrpoError`) print one message without a traceback and exit with status 2. A config is
loaded and validated before any process group or engine starts, so a bad config fails in a second.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from megagrpo.errors import MegagrpoError

REPO = Path(__file__).resolve().parents[1]
EXIT_USER_ERROR = 2


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see docs/config.md)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. algo.clip_high=0.28 schedule.steps=10"
    )
    p.add_argument(
        "--resume", default=None, help="'auto' (latest checkpoint in checkpoint.dir) or a checkpoint path"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many local processes with torchrun (default: run in this process, "
        "taking rank/world from torchrun, srun or mpirun variables if present)",
    )


def _tool(name: str) -> Path:
    return REPO / "tools" / name


def _forward(tool: str, args: list[str]) -> int:
    """Run a tools/ script with this interpreter; the tools keep their own --help."""
    return subprocess.call([sys.executable, str(_tool(tool)), *args])


def _spawn_torchrun(nproc: int, mode: str, argv_rest: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(REPO / "launch" / "run.py"),
        mode,
        *argv_rest,
    ]
    return subprocess.call(cmd)


def _check_world(cfg, stage: str, nproc: int | None) -> None:
    """The mesh against the world size this run will have (`--nproc`, else the launcher's variables)."""
    from megagrpo.config import check_mesh
    from megagrpo.learner.mesh import world_size_from_environ

    world = nproc or world_size_from_environ()
    if world is not None:  # None: the mpi4py bootstrap; init_mesh checks once MPI is up
        check_mesh(cfg, world, stage)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megagrpo", description="GRPO-family RL post-training for MoE models."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("train", "GRPO-family RL training (rollout, reward, update, sync)"),
        ("sft", "cold-start supervised fine-tuning on the same learner"),
        ("eval", "held-out evaluation of a model or checkpoint"),
    ):
        _add_run_args(sub.add_parser(name, help=help_, description=help_))
    for name, help_ in (
        ("convert", "HF <-> Megatron checkpoint conversion (tools/convert_*.py)"),
        ("probe", "parallelism-mismatch probe (tools/mismatch_probe.py)"),
    ):
        sp = sub.add_parser(name, help=help_, description=help_, add_help=False)
        sp.add_argument("args", nargs=argparse.REMAINDER)
    from megagrpo.plan.command import add_plan_parser
    from megagrpo.submit.command import add_submit_parser

    add_submit_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "convert":
            rest = args.args
            if not rest or rest[0] not in ("hf-to-megatron", "megatron-to-hf"):
                print(
                    "usage: megagrpo convert {hf-to-megatron,megatron-to-hf} SRC DST [options]",
                    file=sys.stderr,
                )
                return EXIT_USER_ERROR if rest and rest[0] not in ("-h", "--help") else 0
            tool = "convert_hf_to_megatron.py" if rest[0] == "hf-to-megatron" else "convert_megatron_to_hf.py"
            return _forward(tool, rest[1:])
        if args.cmd == "probe":
            return _forward("mismatch_probe.py", args.args)
        if args.cmd == "submit":
            from megagrpo.submit.command import run_submit

            return run_submit(args)
        if args.cmd == "plan":
            from megagrpo.plan.command import run_plan

            return run_plan(args)
        from megagrpo.config import load_config

        cfg = load_config(args.config, args.overrides, stage=args.cmd)  # validates before anything starts
        spawn = bool(args.nproc and args.nproc > 1 and "RANK" not in os.environ)
        _check_world(cfg, args.cmd, args.nproc if spawn else None)
        if spawn:
            rest = [args.config, *args.overrides] + (["--resume", args.resume] if args.resume else [])
            return _spawn_torchrun(args.nproc, args.cmd, rest)
        from megagrpo.trainer.entry import run

        return run(args.cmd, cfg, resume=args.resume)
    except MegagrpoError as e:
        print(f"megagrpo: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
