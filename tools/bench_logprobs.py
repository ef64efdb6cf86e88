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
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from megagrpo.learner.logprobs import token_logprobs_and_entropy

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="0: the function's default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--memory-case", help=argparse.SUPPRESS)  # internal: one case's memory, as JSON
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = args.chunk_tokens or None

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
