"""Benchmark: chunked vocab-parallel logprob + entropy against the usual full-vocab baselines.

Usage: `.venv/bin/python tools/bench_logprobs.py [--tokens 8192] [--vocab 32768] [--repeats 5]`

Every case runs in its own fresh subprocess on the same `[tokens, vocab]` fp32 logits (same seed):
  * time: the minimum wall time over `--repeats` runs after one warm-up run (min is the least noisy
    statistic on a shared machine);
  * peak extra memory: `ru_maxrss` (the kernel's exact high-water mark of the process' resident set)
    after the first run, minus `ru_maxrss` just before it, when the logits and targets are already
    resident and every kernel has been warmed on a small input. Large torch CPU tensors are mmap-backed,
    so the resident set tracks them exactly; the delta is the memory the case needs beyond its inputs
    and its `[N]` outputs (tracemalloc cannot see torch's allocator, and a fresh process keeps one case's
    peak from hiding another's).

Comparisons printed at the end (ratios in the same run, lower is better):
  * logp only:        ours(with_entropy=False) / fastest logp baseline (log_softmax+gather, selective);
  * logp + entropy:   ours(with_entropy=True)  / (fastest logp baseline + full-softmax entropy), i.e.
    against computing the two quantities the usual way, one after the other;
  * also against a fused baseline: one log_softmax, then gather and entropy from that same buffer.
Goal (issue 4): time ratio <= 1.2 and peak extra memory <= 25% of the logits size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megagrpo.learner.logprobs import token_logprobs_and_entropy  # noqa: E402

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


def run_case(name: str, tokens: int, vocab: int, repeats: int, chunk: int | None, threads: int) -> dict:
    if threads:
        torch.set_num_threads(threads)
    fn = _cases(chunk)[name][1]
    g = torch.Generator().manual_seed(0)
    # Warm every kernel on a small input first so first-use allocations do not count as the case's memory.
    small = torch.randn(64, vocab, generator=g)
    fn(small, torch.randint(0, vocab, (64,), generator=g))
    # Filled in place: a temporary here would raise ru_maxrss before the case starts and hide its peak.
    z = torch.empty(tokens, vocab).normal_(generator=g).mul_(4)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    with torch.no_grad():
        before = _maxrss_bytes()
        t0 = time.perf_counter()
        fn(z, t)
        first = time.perf_counter() - t0
        peak_extra = _maxrss_bytes() - before
        times = [first]
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(z, t)
            times.append(time.perf_counter() - t0)
    return {
        "case": name,
        "time_s": min(times[1:]) if repeats else first,
        "peak_extra_bytes": peak_extra,
        "logits_bytes": z.numel() * z.element_size(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="0: the function's default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args()

    if args.case:
        chunk = args.chunk_tokens or None
        print(json.dumps(run_case(args.case, args.tokens, args.vocab, args.repeats, chunk, args.threads)))
        return

    results = {}
    for name in _cases(args.chunk_tokens):
        cmd = [
            sys.executable,
            __file__,
            "--case",
            name,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
        ]
        cmd += ["--repeats", str(args.repeats), "--chunk-tokens", str(args.chunk_tokens)]
        cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])

    logits_mb = next(iter(results.values()))["logits_bytes"] / 2**20
    print(
        f"logits: {args.tokens} tokens x {args.vocab} vocab fp32 = {logits_mb:.0f} MiB; "
        f"torch threads {args.threads or torch.get_num_threads()}; chunk_tokens {args.chunk_tokens or 'default'}; "
        f"time = min of {args.repeats} runs after a warm-up; memory = ru_maxrss delta in a fresh process"
    )
    print(f"{'case':30s} {'kind':22s} {'time s':>8s} {'peak extra MiB':>15s} {'% of logits':>12s}")
    cases = _cases(args.chunk_tokens)
    for name, r in results.items():
        mib = r["peak_extra_bytes"] / 2**20
        print(
            f"{name:30s} {cases[name][0]:22s} {r['time_s']:8.3f} {mib:15.1f} {100 * mib / logits_mb:11.1f}%"
        )

    tm = {k: v["time_s"] for k, v in results.items()}
    best_logp = min(("log_softmax+gather", "selective_logsumexp"), key=tm.__getitem__)
    mem_ours = results["ours_logp+entropy"]["peak_extra_bytes"] / 2**20 / logits_mb
    r_logp = tm["ours_logp"] / tm[best_logp]
    r_both = tm["ours_logp+entropy"] / (tm[best_logp] + tm["softmax_entropy"])
    r_fused = tm["ours_logp+entropy"] / tm["log_softmax+gather+entropy"]
    print()
    print(f"logp only:      ours / fastest logp baseline ({best_logp}) = {r_logp:.2f}x")
    print(f"logp + entropy: ours / ({best_logp} + softmax_entropy) = {r_both:.2f}x")
    print(f"logp + entropy: ours / fused log_softmax+gather+entropy = {r_fused:.2f}x")
    r_bwd = tm["ours_fwd+bwd"] / tm["fused_baseline_fwd+bwd"]
    print(f"fwd + bwd:      ours / autograd of the fused baseline = {r_bwd:.2f}x (both return a [N, V] grad)")
    print(f"peak extra memory of ours (logp+entropy): {100 * mem_ours:.1f}% of the logits size")
    ok = r_both <= 1.2 and mem_ours <= 0.25
    print(f"goal (time ratio <= 1.2 vs the sum of baselines, memory <= 25%): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
