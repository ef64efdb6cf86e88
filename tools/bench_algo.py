"""Times `policy_loss` forward + backward against a plain hand-written PPO-clip loss in the same run.

    .venv/bin/python tools/bench_algo.py                      # B=256, T=4096 (the issue's size)
    .venv/bin/python tools/bench_algo.py --batch 16 --seq 512 --variants grpo gspo cispo

Reports the median time of each and the ratio to the baseline (goal for grpo: <= 1.3x). Both sides see
the same inputs (random lengths, right padding) and the same thread count; runs are interleaved so
machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megagrpo.algo.aggregation import loss_normaliser
from megagrpo.algo.losses import VARIANTS, policy_loss

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline

CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "gmpo": (0.4, 0.4)}


def plain_ppo_clip(logp, old_logp, adv, mask, eps=0.2):
    """The baseline: what one writes by hand, token-mean, no metrics."""
    ratio = torch.exp(logp - old_logp)
    pg1 = -adv.unsqueeze(-1) * ratio
    pg2 = -adv.unsqueeze(-1) * torch.clamp(ratio, 1 - eps, 1 + eps)
    return (torch.maximum(pg1, pg2) * mask).sum() / mask.sum()


def make_inputs(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 8, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    return logp, old, adv, mask


def time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--variants", nargs="+", default=["grpo"], choices=VARIANTS)
    ap.add_argument("--agg", default="token-mean")
    args = ap.parse_args()

    logp0, old, adv, mask = make_inputs(args.batch, args.seq)
    maskf = mask.float()
    norm = loss_normaliser(mask, args.agg, agg_constant=float(args.seq))

    def run_baseline():
        logp = logp0.clone().requires_grad_()
        plain_ppo_clip(logp, old, adv, maskf).backward()

    def runner(variant):
        lo, hi = CLIP.get(variant, (0.2, 0.2))

        def run():
            logp = logp0.clone().requires_grad_()
            loss, _ = policy_loss(
                logp,
                old,
                adv,
                mask,
                variant=variant,
                clip_low=lo,
                clip_high=hi,
                agg=args.agg,
                normaliser=norm,
            )
            loss.backward()

        return run

    machine = describe()
    fns = {"baseline": run_baseline} | {v: runner(v) for v in args.variants}
    for fn in fns.values():  # warm-up (allocator, lazy init)
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.reps):
        for k, fn in fns.items():
            times[k].append(time_once(fn))
    base = statistics.median(times["baseline"])
    print(headline(describe(machine)))
    print(f"B={args.batch} T={args.seq} agg={args.agg} threads={torch.get_num_threads()} reps={args.reps}")
    print(f"{'baseline (plain PPO-clip)':28s} {base * 1e3:9.1f} ms   1.00x")
    for v in args.variants:
        med = statistics.median(times[v])
        print(f"{'policy_loss ' + v:28s} {med * 1e3:9.1f} ms   {med / base:.2f}x")


if __name__ == "__main__":
    main()
