"""Benchmark: chunked vocab-parallel logprob + entropy against the usual full-vocab baselines.

Usage: `.venv/bin/python tools/bench_logprobs.py [--tokens 8192] [--vocab 32768] [--rounds 5] [--threads N]`

All cases use the same `[tokens, vocab]` fp32 logits (same seed).
  * Peak extra memory: each case runs once in its own fresh subprocess; the figure is `ru_maxrss` (the
    kernel's exact high-water mark of the resident set) after the run minus `ru_maxrss` just before it,
    when the logits and targets are resident and every kernel has been warmed on a small input. Large
    torch CPU tensors are mmap-backed, so the resident set follows them exactly; the delta is what the
    case needs beyond its inputs and `[N]` outputs. (tracemalloc cannot see torch's allocator, and a
    fresh process per case keeps one case's peak from hiding another's.)
  * Time: one process runs `--rounds` rounds after a warm-up round; each round runs every case once,
    in a rotated order, so load from other processes on this shared machine hits all cases alike. The
    figure is the minimum over rounds (the least noisy statistic here); the median is shown too.

Comparisons (ratios of times from the same run; lower is better):
  * logp only:      ours(with_entropy=False) / fastest logp baseline (log_softmax+gather, selective);
  * logp + entropy: ours(with_entropy=True) / (fastest logp baseline + full-softmax entropy), i.e.
    against computing the two quantities the usual way, one after the other (the issue's goal);
  * and against a fused baseline: one log_softmax, then gather and entropy from that same buffer;
  * fwd + bwd: ours / autograd through the fused baseline (both must return a [N, V] grad).
Goal (issue 4): the logp + entropy ratio <= 1.2, and peak extra memory <= 25% of the logits size.

`--families` (issue 37) measures instead the learner's whole logprob forward per token, as the trainer computes
old and reference logprobs (`Learner.forward`: megatron's forward-only schedule, THD packing, the chunked
logprob + entropy head), for Qwen3-MoE, DeepSeek-V3 (MLA) and GLM-4.5 at similar parameter counts
(`tools/bench_families.py`), each a megatron GPTModel loaded from its tiny HF checkpoint, all three in one
process on one CPU rank: `--rounds` rotated rounds of `--seqs` sequences of `--seq-len` tokens each, min over
rounds, ratio of time per token to Qwen3-MoE's (goal: <= 1.5x). Figures: docs/scaling.md, "Model families".

    python tools/bench_logprobs.py --families [--seqs 16] [--seq-len 256] [--rounds 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from megagrpo.learner.logprobs import token_logprobs_and_entropy

try:
    from tools import bench_families as fam
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    import bench_families as fam
    from machine import describe, headline

SEQ_LEN = 1024  # the selective baseline loops over sequences of this many tokens, as TRL loops over rows


def _log_softmax_gather(z: torch.Tensor, t: torch.Tensor):
    return torch.log_softmax(z, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def _selective(z: torch.Tensor, t: torch.Tensor):
    # log-sum-exp row block by row block, minus the target logit: no [N, V] log-softmax buffer.
    lse = torch.cat([torch.logsumexp(rows, dim=-1) for rows in z.split(SEQ_LEN)])
    return z.gather(-1, t.unsqueeze(-1)).squeeze(-1) - lse


def _softmax_entropy(z: torch.Tensor, t: torch.Tensor):
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _fused_baseline(z: torch.Tensor, t: torch.Tensor):
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _ours(chunk: int | None, with_entropy: bool):
    def run(z: torch.Tensor, t: torch.Tensor):
        return token_logprobs_and_entropy(z, t, chunk_tokens=chunk, with_entropy=with_entropy)

    return run


def _fused_baseline_fwd_bwd(z: torch.Tensor, t: torch.Tensor):
    with torch.enable_grad():
        zz = z.detach().requires_grad_()
        logp, ent = _fused_baseline(zz, t)
        (grad,) = torch.autograd.grad(logp.sum() + 0.01 * ent.sum(), zz)
    return grad


def _ours_fwd_bwd(chunk: int | None):
    def run(z: torch.Tensor, t: torch.Tensor):
        with torch.enable_grad():
            zz = z.detach().requires_grad_()
            logp, ent = token_logprobs_and_entropy(zz, t, chunk_tokens=chunk)
            (grad,) = torch.autograd.grad(logp.sum() + 0.01 * ent.sum(), zz)
        return grad

    return run


def _cases(chunk: int | None) -> dict[str, tuple[str, object]]:
    return {
        "log_softmax+gather": ("baseline logp", _log_softmax_gather),
        "selective_logsumexp": ("baseline logp", _selective),
        "softmax_entropy": ("baseline entropy", _softmax_entropy),
        "log_softmax+gather+entropy": ("baseline logp+entropy", _fused_baseline),
        "ours_logp": ("ours logp", _ours(chunk, False)),
        "ours_logp+entropy": ("ours logp+entropy", _ours(chunk, True)),
        "fused_baseline_fwd+bwd": ("baseline fwd+bwd", _fused_baseline_fwd_bwd),
        "ours_fwd+bwd": ("ours fwd+bwd", _ours_fwd_bwd(chunk)),
    }


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _inputs(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # Filled in place: a temporary here would raise ru_maxrss before a case starts and hide its peak.
    z = torch.empty(tokens, vocab).normal_(generator=g).mul_(4)
    return z, torch.randint(0, vocab, (tokens,), generator=g)


def memory_case(name: str, tokens: int, vocab: int, chunk: int | None) -> dict:
    fn = _cases(chunk)[name][1]
    small = torch.randn(64, vocab)  # warm every kernel so first-use allocations do not count
    fn(small, torch.randint(0, vocab, (64,)))
    z, t = _inputs(tokens, vocab)
    with torch.no_grad():
        before = _maxrss_bytes()
        fn(z, t)
        peak_extra = _maxrss_bytes() - before
    return {"case": name, "peak_extra_bytes": peak_extra, "logits_bytes": z.numel() * z.element_size()}


def time_cases(tokens: int, vocab: int, rounds: int, chunk: int | None) -> dict[str, list[float]]:
    cases = _cases(chunk)
    names = list(cases)
    z, t = _inputs(tokens, vocab)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms up
            for k in range(len(names)):
                name = names[(k + r) % len(names)]
                t0 = time.perf_counter()
                cases[name][1](z, t)
                if r:
                    times[name].append(time.perf_counter() - t0)
    return times


def family_batch(seqs: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`seqs` full rows of `seq_len` random token ids below `vocab` (the same for every family)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (seqs, seq_len), generator=g)
    return {"input_ids": ids, "seq_lens": torch.full((seqs,), seq_len)}


def family_forwards(dirs: dict, batch: dict[str, torch.Tensor]) -> dict:
    """{family: a callable running the learner's logprob forward of `batch` once}: one megatron model per
    family on one single-rank mesh, built and loaded as `Learner` builds and `load_hf_into_learner` loads
    the policy (a `Learner` each would re-initialise the mesh under the models already built)."""
    from types import SimpleNamespace

    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.compat import apply_cpu_compat
    from megagrpo.learner import forward as fwd
    from megagrpo.learner.learner import LearnerConfig
    from megagrpo.learner.mesh import DistEnv, init_mesh
    from megagrpo.learner.model import build_gpt_model, wrap_ddp
    from megagrpo.trainer.weights import load_hf_into_learner

    apply_cpu_compat(megatron=True, sglang=False)
    cfg = LearnerConfig()
    init_mesh(cfg.mesh, DistEnv.from_environ({}), seed=cfg.seed)
    runs = {}
    for family, d in dirs.items():
        arch = arch_from_hf(Path(d) / "config.json")
        chunks = build_gpt_model(arch, cfg.mesh, dtype=cfg.dtype, layer_spec=cfg.layer_spec)
        model = wrap_ddp(chunks, distributed_optimizer=cfg.distributed_optimizer)
        load_hf_into_learner(SimpleNamespace(arch=arch, chunks=chunks), d)
        opts = fwd.RunOptions(
            vocab_size=arch.vocab_size,
            num_micro_batches=cfg.num_micro_batches,
            packed=cfg.packed,
            balance=cfg.balance,
            temperature=cfg.temperature,
            chunk_tokens=cfg.chunk_tokens,
        )
        runs[family] = functools.partial(fwd.forward_logprobs, model, batch, opts)
    return runs


def run_families(args: argparse.Namespace) -> dict:
    import tempfile

    machine = describe()
    with tempfile.TemporaryDirectory(prefix="bench_logprobs_families_") as tmp:
        dirs = fam.build_family_models(tmp)
        params = {f: fam.param_count(d) for f, d in dirs.items()}
        batch = family_batch(args.seqs, args.seq_len, vocab=1000)
        runs = family_forwards(dirs, batch)

        def once(family: str) -> dict[str, float]:
            t0 = time.perf_counter()
            with torch.no_grad():
                runs[family]()
            return {"forward": time.perf_counter() - t0}

        times = fam.rotated_rounds(list(dirs), args.rounds, once)
    tokens = args.seqs * args.seq_len
    rows = fam.per_token_rows({f: min(t["forward"]) for f, t in times.items()}, {f: tokens for f in times})
    print(headline(describe(machine)))
    print(
        fam.render_rows(
            f"learner logprob forward (one CPU rank, fp32, {args.seqs} x {args.seq_len} tokens, torch threads "
            f"{torch.get_num_threads()}; min of {args.rounds} rotated rounds; ratio = time per token / "
            f"{fam.BASELINE}'s, goal <= {fam.GOAL_RATIO}x)",
            rows,
            params,
        )
    )
    return {"machine": describe(machine), "params": params, "rows": rows, "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="0: the function's default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--families", action="store_true", help="the learner's logprob forward per family")
    ap.add_argument("--seqs", type=int, default=16, help="--families: sequences per forward")
    ap.add_argument("--seq-len", type=int, default=256, help="--families: tokens per sequence")
    ap.add_argument("--json", help="--families: write the figures to this file")
    ap.add_argument("--memory-case", help=argparse.SUPPRESS)  # internal: one case's memory, as JSON
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = args.chunk_tokens or None
    if args.families:
        out = run_families(args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return

    if args.memory_case:
        print(json.dumps(memory_case(args.memory_case, args.tokens, args.vocab, chunk)))
        return

    machine = describe()
    cases = _cases(chunk)
    mem = {}
    for name in cases:
        cmd = [sys.executable, __file__, "--memory-case", name, "--tokens", str(args.tokens)]
        cmd += [
            "--vocab",
            str(args.vocab),
            "--chunk-tokens",
            str(args.chunk_tokens),
            "--threads",
            str(args.threads),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200).stdout
        mem[name] = json.loads(out.strip().splitlines()[-1])
    times = time_cases(args.tokens, args.vocab, args.rounds, chunk)

    logits_mb = next(iter(mem.values()))["logits_bytes"] / 2**20
    print(headline(describe(machine)))
    print(
        f"logits: {args.tokens} tokens x {args.vocab} vocab fp32 = {logits_mb:.0f} MiB; "
        f"torch threads {torch.get_num_threads()}; chunk_tokens {args.chunk_tokens or 'default'}; "
        f"time = min (median) of {args.rounds} interleaved rounds; memory = ru_maxrss delta, fresh process"
    )
    print(
        f"{'case':28s} {'kind':22s} {'min s':>7s} {'median s':>9s} {'peak extra MiB':>15s} {'% logits':>9s}"
    )
    tm = {}
    for name in cases:
        tm[name] = min(times[name])
        mib = mem[name]["peak_extra_bytes"] / 2**20
        print(
            f"{name:28s} {cases[name][0]:22s} {tm[name]:7.3f} {statistics.median(times[name]):9.3f} "
            f"{mib:15.1f} {100 * mib / logits_mb:8.1f}%"
        )

    best_logp = min(("log_softmax+gather", "selective_logsumexp"), key=tm.__getitem__)
    mem_ours = mem["ours_logp+entropy"]["peak_extra_bytes"] / 2**20 / logits_mb
    r_both = tm["ours_logp+entropy"] / (tm[best_logp] + tm["softmax_entropy"])
    print()
    print(
        f"logp only:      ours / fastest logp baseline ({best_logp}) = {tm['ours_logp'] / tm[best_logp]:.2f}x"
    )
    print(f"logp + entropy: ours / ({best_logp} + softmax_entropy) = {r_both:.2f}x")
    r_fused = tm["ours_logp+entropy"] / tm["log_softmax+gather+entropy"]
    r_bwd = tm["ours_fwd+bwd"] / tm["fused_baseline_fwd+bwd"]
    print(f"logp + entropy: ours / fused log_softmax+gather+entropy = {r_fused:.2f}x")
    print(f"fwd + bwd:      ours / autograd of the fused baseline = {r_bwd:.2f}x")
    print(f"peak extra memory of ours (logp+entropy): {100 * mem_ours:.1f}% of the logits size")
    ok = r_both <= 1.2 and mem_ours <= 0.25
    print(f"goal (logp+entropy time ratio <= 1.2, memory <= 25%): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
