"""`megagrpo` command line: train, sft, eval, convert, probe, submit, plan, bundle.

User errors (`MegagrpoError`) print one message without a traceback and exit with status 2. A config is
loaded and validated before any process group or engine starts, so a bad config fails in a second.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from megagrpo.errors import MegagrpoError

EXIT_USER_ERROR = 2
VERBOSE_HELP = (
    "show every library warning and log line; by default the known-harmless ones listed in "
    "megagrpo/console.py are hidden"
)


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
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def _spawn_torchrun(nproc: int, mode: str, argv_rest: list[str]) -> int:
    """Start `nproc` local ranks of the installed package's per-process entry (megagrpo.launch.run).

    A user error inside the ranks is printed here once, as in a single process, and exits 2: each rank
    leaves its message in a private directory instead of printing it, and torchrun runs through
    `megagrpo.launch.torchrun`, which keeps torchrun's failure report and traceback for other failures."""
    from megagrpo.launch.torchrun import ERROR_DIR_ENV, first_user_error

    with tempfile.TemporaryDirectory(prefix="megagrpo-errors-") as errors:
        cmd = [
            sys.executable,
            "-m",
            "megagrpo.launch.torchrun",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "megagrpo.launch.run",
            mode,
            *argv_rest,
        ]
        code = subprocess.call(cmd, env={**os.environ, ERROR_DIR_ENV: errors})
        message = first_user_error(errors)
    if message is not None:
        print(f"megagrpo: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    return code


def _report(error: MegagrpoError) -> None:
    """Print a user error; a rank started by `_spawn_torchrun` leaves it for the parent to print once."""
    from megagrpo.dist.agree import PeerFailed
    from megagrpo.launch.torchrun import leave_user_error

    if not leave_user_error(str(error), echo=isinstance(error, PeerFailed)):
        print(f"megagrpo: error: {error}", file=sys.stderr)


def _refuse_a_spawned_rerun() -> None:
    """Stop a command that a spawned child process started by re-running its parent's main script.

    SGLang starts its scheduler with the spawn method, which runs the parent's main script again in the child
    (as `__mp_main__`). A script that calls `main()` outside an `if __name__ == "__main__":` guard would run
    the whole command in there, a second engine included, and the scheduler dies of it. multiprocessing
    marks that phase on the current process (`_inheriting`, what its own `_check_not_importing_main` reads)."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise MegagrpoError(
            f"{sys.argv[0]} calls megagrpo.cli.main() when it is imported, so a process started with the spawn "
            "method (SGLang's scheduler) runs the command again: call it under `if __name__ == "
            '"__main__":`. A clone whose .venv/bin/megagrpo was written before this was fixed: `make setup`'
        )


def _check_world(cfg, stage: str, nproc: int | None) -> None:
    """The mesh against the world size this run will have (`--nproc`, else the launcher's variables)."""
    from megagrpo.config import check_mesh
    from megagrpo.learner.mesh import world_size_from_environ

    world = nproc or world_size_from_environ()
    if world is not None:  # None: the mpi4py bootstrap; init_mesh checks once MPI is up
        import torch

        check_mesh(cfg, world, stage, on_gpu=torch.cuda.is_available())


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
        ("convert", "HF <-> Megatron checkpoint conversion (megagrpo.convert)"),
        ("probe", "parallelism-mismatch probe (megagrpo.probe); --verbose: " + VERBOSE_HELP),
        ("bundle", "offline GPU-node bundles: record symbol tables, select versions (megagrpo.bundle)"),
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
    if argv[:1] in (
        ["convert"],
        ["probe"],
        ["bundle"],
    ):  # their own parsers; REMAINDER would refuse a leading --help
        args = argparse.Namespace(cmd=argv[0], args=argv[1:])
    else:
        # Overrides may follow options (`train CFG --resume X a.b=1`): argparse ends a nargs="*"
        # positional at the first option, so what it leaves over is taken as more overrides.
        args, extra = parser.parse_known_args(argv)
        if extra:
            if not hasattr(args, "overrides") or any(a.startswith("-") for a in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides = [*args.overrides, *extra]
    if args.cmd == "probe" and "--verbose" in args.args:
        args.args, args.verbose = [a for a in args.args if a != "--verbose"], True
    if args.cmd in ("train", "sft", "eval", "probe"):
        from megagrpo.console import quiet_known_noise, verbose_requested

        quiet_known_noise(verbose=getattr(args, "verbose", False) or verbose_requested())
    try:
        _refuse_a_spawned_rerun()
        if args.cmd == "convert":
            rest = args.args
            if not rest or rest[0] not in ("hf-to-megatron", "megatron-to-hf"):
                print(
                    "usage: megagrpo convert {hf-to-megatron,megatron-to-hf} SRC DST [options]",
                    file=sys.stderr,
                )
                return EXIT_USER_ERROR if rest and rest[0] not in ("-h", "--help") else 0
            if rest[0] == "hf-to-megatron":
                from megagrpo.convert.hf_to_megatron import main as convert_main
            else:
                from megagrpo.convert.megatron_to_hf import main as convert_main
            return convert_main(rest[1:], prog=f"megagrpo convert {rest[0]}")
        if args.cmd == "bundle":
            from megagrpo.bundle.cli import main as bundle_main

            return bundle_main(args.args)
        if args.cmd == "probe":
            from megagrpo.probe import main as probe_main

            return probe_main(args.args, prog="megagrpo probe")
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
        from megagrpo.trainer.preflight import check_stage_inputs

        check_stage_inputs(cfg, args.cmd, args.resume)  # model config.json, checkpoint meta.json
        if spawn:
            rest = [args.config, *args.overrides] + (["--resume", args.resume] if args.resume else [])
            return _spawn_torchrun(args.nproc, args.cmd, rest)
        from megagrpo.trainer.entry import run

        return run(args.cmd, cfg, resume=args.resume)
    except MegagrpoError as e:
        _report(e)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
