"""Checkpoints, the optimizer and vocab-parallel logprobs on gloo CPU meshes (issue 4), in three launches:

  L1 `one_process` (1 rank): Adam step 1 with the DistributedOptimizer, save `ckpt/step_00000001`
     (model + optimizer + scheduler + RNG), RNG restore on the same mesh, step 2 (params saved as the
     reference), every error case, then a save of step 2 that is SIGKILLed inside the writer.
  L2 `two_processes` (2 ranks): TP2 logprobs/entropy against the unsharded computation (values, grads);
     `latest_checkpoint` still finds step 1 after the kill; TP2 loads step 1 (same logits as L1), takes
     step 2 (same params as L1), saves on TP2; a failing re-save of that path leaves it intact; then DP2
     loads step 1 and takes step 2 on half the batch per rank (same params as L1).
  L3 `one_process_load` (1 rank): loads the TP2 checkpoint: same logits, same params after step 3; then
     loads it again into an optimizer built with a changed optimizer.lr and min_lr (issue 25, item 4).

Every rank writes rank<r>_<phase>.json; the tests below assert the tolerances.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist._harness import run

B, T = 4, 12
OPT = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.05)
SCHED = dict(warmup_steps=1, decay_style="cosine", total_steps=10)


# -- worker helpers (run inside the launched ranks) ----------------------------------------------------


def _batch(seed: int) -> torch.Tensor:
    from tests.dist._common import TINY_MOE

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_MOE.vocab_size, (B, T), generator=g)


def _setup(mesh_kw: dict[str, Any], seed: int = 7, opt: dict[str, Any] | None = None):
    from megagrpo.learner.mesh import DistEnv, MeshConfig, init_mesh
    from megagrpo.learner.model import build_gpt_model, wrap_ddp
    from megagrpo.learner.optimizer import OptimizerConfig, build_optimizer
    from tests.dist._common import TINY_MOE

    mesh = MeshConfig(**mesh_kw)
    init_mesh(mesh, DistEnv.from_environ(), seed=seed)
    chunks = build_gpt_model(TINY_MOE, mesh)
    model = wrap_ddp(chunks, distributed_optimizer=True)
    optimizer, scheduler = build_optimizer(model, OptimizerConfig(**{**OPT, **(opt or {})}, **SCHED))
    return chunks, model, optimizer, scheduler


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits `[b, T, V_real]`, all-gathered over TP (tests only)."""
    from megatron.core import parallel_state as ps

    from tests.dist._common import TINY_MOE

    b, t = ids.shape
    with torch.no_grad():
        local = model[0](ids, torch.arange(t).expand(b, t), None)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    return local[..., : TINY_MOE.vocab_size]


def _train_step(model, optimizer, scheduler, ids: torch.Tensor) -> float:
    """One step on the global batch `ids [B, T]`: each DP rank takes rows rank::dp; the loss is
    -mean logp - 0.01 mean entropy over the GLOBAL token count, so DP sums give the full-batch grads."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megagrpo.learner.logprobs import token_logprobs_and_entropy
    from tests.dist._common import TINY_MOE

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in model:
        chunk.zero_grad_buffer()
    mine = ids[dpr::dp]
    b, t = mine.shape
    logits = model[0](mine, torch.arange(t).expand(b, t), None)
    logp, ent = token_logprobs_and_entropy(
        logits[:, :-1],
        mine[:, 1:],
        tp_group=tp_group if tp > 1 else None,
        vocab_start=tpr * logits.shape[-1],
        vocab_size=TINY_MOE.vocab_size,
    )
    n_global = ids.shape[0] * (ids.shape[1] - 1)
    loss = -(logp.sum() + 0.01 * ent.sum()) / n_global
    loss.backward()
    finalize_model_grads(model)
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(1)
    optimizer.zero_grad()
    total = loss.detach().clone()
    if dp > 1:
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total)


def _error(fn) -> str:
    from megagrpo.errors import MegagrpoError

    try:
        fn()
    except MegagrpoError as e:
        return str(e)
    return "NO ERROR RAISED"


def _write(outdir: Path, phase: str, res: dict[str, Any]) -> None:
    rank = torch.distributed.get_rank()
    (outdir / f"rank{rank}_{phase}.json").write_text(json.dumps(res, indent=1, sort_keys=True))


# -- L1 ------------------------------------------------------------------------------------------------


def one_process(rank: int, world: int, outdir: Path) -> None:
    import shutil

    from megatron.core import dist_checkpointing, tensor_parallel

    from megagrpo.learner import checkpoint as ck
    from tests.dist._common import TINY_MOE, save_params

    res: dict[str, Any] = {}
    chunks, model, optimizer, scheduler = _setup({})
    save_params(chunks, outdir / "p0")
    res["loss1"] = _train_step(model, optimizer, scheduler, _batch(1))
    save_params(chunks, outdir / "p1")
    root = outdir / "ckpt"
    path = ck.save_checkpoint(
        ck.step_dir(root, 1), model, optimizer=optimizer, scheduler=scheduler, step=1,
        consumed_samples=B, arch=TINY_MOE, extra={"data": {"epoch": 0, "index": 4}},
    )  # fmt: skip
    torch.save(_logits(model, _batch(100)), outdir / "l1_logits_step1.pt")
    res["lr_after_1"] = optimizer.param_groups[0]["lr"]

    # Same mesh: the RNG streams continue exactly where the save left them.
    with tensor_parallel.get_cuda_rng_tracker().fork():
        want = torch.cat([torch.rand(3), torch.rand(3)])
    want = torch.cat([want, torch.rand(3)])
    torch.manual_seed(12345)
    meta = ck.load_checkpoint(path, model, optimizer=optimizer, scheduler=scheduler, arch=TINY_MOE)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        got = torch.cat([torch.rand(3), torch.rand(3)])
    got = torch.cat([got, torch.rand(3)])
    res["rng_restored_err"] = float((want - got).abs().max())
    res["meta"] = {
        "step": meta.step,
        "consumed": meta.consumed_samples,
        "extra": meta.extra,
        "mesh": meta.mesh,
    }
    res["lr_after_load"] = optimizer.param_groups[0]["lr"]

    res["loss2"] = _train_step(model, optimizer, scheduler, _batch(2))
    save_params(chunks, outdir / "p2")

    # -- error cases -----------------------------------------------------------------------------------
    errs: dict[str, str] = {}
    errs["missing"] = _error(lambda: ck.load_checkpoint(root / "step_00000099", model))
    foreign = outdir / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_text("not a checkpoint")
    errs["foreign"] = _error(lambda: ck.load_checkpoint(foreign, model))
    errs["root"] = _error(lambda: ck.load_checkpoint(root, model))
    bad = outdir / "bad"
    shutil.copytree(path, bad / "step_00000001")
    shutil.copytree(path, bad / "step_00000002")
    shutil.copytree(path, bad / "step_00000003")
    distcp = sorted((bad / "step_00000001").glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]
    distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])
    errs["truncated"] = _error(lambda: ck.load_checkpoint(bad / "step_00000001", model))
    (bad / "step_00000002" / ".metadata").write_bytes(b"garbage" * 10)
    sizes = json.loads((bad / "step_00000002" / "meta.json").read_text())
    sizes["files"][".metadata"] = 70  # same size as recorded: only the DCP reader can notice
    sizes["step"] = 2  # so latest_checkpoint(bad) must pick it over step 1, and skip step 3's bad meta
    (bad / "step_00000002" / "meta.json").write_text(json.dumps(sizes))
    errs["garbled"] = _error(lambda: ck.load_checkpoint(bad / "step_00000002", model))
    (bad / "step_00000003" / "meta.json").write_text("{ not json")
    errs["bad_meta"] = _error(lambda: ck.load_checkpoint(bad / "step_00000003", model))
    errs["latest_skips_damaged"] = str(ck.latest_checkpoint(bad))  # 1, 2 only fail on load; 3 is skipped
    weights_only = ck.save_checkpoint(outdir / "weights_only", model, step=0)
    errs["no_optimizer"] = _error(lambda: ck.load_checkpoint(weights_only, model, optimizer=optimizer))
    other = TINY_MOE.__class__(**{**TINY_MOE.to_dict(), "num_experts": 8})
    errs["arch"] = _error(lambda: ck.load_checkpoint(path, model, arch=other))
    res["errors"] = errs
    res["paths"] = {"ckpt": str(path), "bad": str(bad), "foreign": str(foreign)}
    _write(outdir, "one_process", res)

    # -- killed save: SIGKILL right after the sharded data is written, before meta.json and the rename --
    real_save = dist_checkpointing.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        (outdir / "killed_after_write").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    dist_checkpointing.save = save_then_die
    ck.save_checkpoint(ck.step_dir(root, 2), model, optimizer=optimizer, scheduler=scheduler, step=2)


# -- L2 ------------------------------------------------------------------------------------------------


def _logprobs_tp2(res: dict[str, Any]) -> None:
    """Vocab split over the TP group against (a) the exact unsharded values (log_softmax in fp64 from the
    same inputs; errors are max |a - b| / max(1, max |b|)) and (b) the same function unsharded in the
    same dtype. fp64 shows the sharded combine is exact math; fp32 agrees to its resolution."""
    from megatron.core import parallel_state as ps

    from megagrpo.learner.logprobs import token_logprobs_and_entropy

    group, tpr = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(3)
    n, v_pad, v_real = 300, 1024, 1000  # padded vocab: the last 24 columns of rank 1 are not tokens
    full = torch.randn(n, v_pad, generator=g) * 3
    full[:, v_real:] = 50.0  # garbage in the padding must not leak into the softmax
    full[:5, 7] = 40.0  # a few very peaked rows
    targets = torch.randint(0, v_real, (n,), generator=g)
    targets[:5] = 7
    gl, gh = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(n, generator=g, dtype=torch.float64),
    )
    v_local = v_pad // 2

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).abs().max() / max(1.0, float(b.abs().max())))

    for dtype in (torch.float32, torch.float64):
        for temp in (1.0, 0.7):
            for with_entropy in (True, False):
                ref_in = full[:, :v_real].double().requires_grad_()
                lsm = torch.log_softmax(ref_in / temp, dim=-1)
                ref_lp = lsm.gather(-1, targets[:, None])[:, 0]
                ref_h = -(lsm.exp() * lsm).sum(-1)
                obj = (ref_lp * gl + ref_h * gh).sum() if with_entropy else (ref_lp * gl).sum()
                (ref_grad,) = torch.autograd.grad(obj, ref_in)
                ref_grad = torch.nn.functional.pad(ref_grad, (0, v_pad - v_real))[:, tpr * v_local :][
                    :, :v_local
                ]

                shard = full[:, tpr * v_local : (tpr + 1) * v_local].to(dtype).requires_grad_()
                lp, h = token_logprobs_and_entropy(
                    shard, targets, tp_group=group, vocab_start=tpr * v_local, chunk_tokens=64,
                    with_entropy=with_entropy, temperature=temp, vocab_size=v_real,
                )  # fmt: skip
                obj = (
                    (lp * gl.to(dtype) + h * gh.to(dtype)).sum()
                    if with_entropy
                    else (lp * gl.to(dtype)).sum()
                )
                (grad,) = torch.autograd.grad(obj, shard)
                key = f"{str(dtype)[6:]}/T{temp}/{'ent' if with_entropy else 'noent'}"
                res[f"logp_err/{key}"] = rel(lp.detach(), ref_lp.detach())
                res[f"grad_err/{key}"] = rel(grad, ref_grad)
                if with_entropy:
                    res[f"entropy_err/{key}"] = rel(h.detach(), ref_h.detach())
                else:
                    res[f"entropy_none/{key}"] = h is None
                # The same function unsharded, same dtype: what TP adds is only the cross-shard combine.
                one = full.to(dtype).requires_grad_()
                lp1, h1 = token_logprobs_and_entropy(
                    one,
                    targets,
                    chunk_tokens=64,
                    with_entropy=with_entropy,
                    temperature=temp,
                    vocab_size=v_real,
                )
                obj = (
                    (lp1 * gl.to(dtype) + h1 * gh.to(dtype)).sum()
                    if with_entropy
                    else (lp1 * gl.to(dtype)).sum()
                )
                (grad1,) = torch.autograd.grad(obj, one)
                # fp32 resolves ~6e-8 of a value's magnitude, and logp = z_t - lse inherits the rounding of
                # z and lse, so differences are measured against the logit scale max |z| (~57 here).
                z_scale = max(1.0, float(full[:, :v_real].abs().max()) / temp)
                res[f"tp_vs_unsharded/{key}"] = (
                    max(
                        float((lp.detach() - lp1.detach()).abs().max()),
                        float((grad - grad1[:, tpr * v_local : (tpr + 1) * v_local]).abs().max()),
                        float((h.detach() - h1.detach()).abs().max()) if with_entropy else 0.0,
                    )
                    / z_scale
                )


def two_processes(rank: int, world: int, outdir: Path, l1: str) -> None:
    from megatron.core import dist_checkpointing

    from megagrpo.learner import checkpoint as ck
    from megagrpo.learner.mesh import destroy_mesh
    from tests.dist._common import (
        TINY_MOE,
        load_params,
        local_values,
        max_abs_diff,
        read_as_local,
        save_params,
    )

    l1 = Path(l1)
    res: dict[str, Any] = {}
    chunks, model, optimizer, scheduler = _setup({"tp": 2, "sequence_parallel": True}, seed=8)
    _logprobs_tp2(res)

    latest = ck.latest_checkpoint(l1 / "ckpt")
    res["latest"] = str(latest)
    res["leftover_tmp"] = sorted(p.name for p in (l1 / "ckpt").iterdir())
    meta = ck.load_checkpoint(latest, model, optimizer=optimizer, scheduler=scheduler, arch=TINY_MOE)
    res["tp2_meta_step"] = meta.step
    res["tp2_logits_err"] = float(
        (_logits(model, _batch(100)) - torch.load(l1 / "l1_logits_step1.pt")).abs().max()
    )
    res["tp2_lr_after_load"] = optimizer.param_groups[0]["lr"]
    res["tp2_loss2"] = _train_step(model, optimizer, scheduler, _batch(2))
    res["tp2_param_err"], res["tp2_param_err_where"] = max_abs_diff(
        local_values(chunks, source="data"), read_as_local(chunks, l1 / "p2")
    )

    path = ck.save_checkpoint(
        ck.step_dir(outdir / "ckpt", 2),
        model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=2,
        arch=TINY_MOE,
    )
    logits2 = _logits(model, _batch(100))
    if rank == 0:
        torch.save(logits2, outdir / "l2_logits_step2.pt")
    before = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}

    # A re-save of the same path that fails inside the writer on every rank: the old one must survive.
    real_save = dist_checkpointing.save

    def save_then_raise(*args, **kwargs):
        real_save(*args, **kwargs)
        raise OSError("disk full (simulated)")

    dist_checkpointing.save = save_then_raise
    try:
        ck.save_checkpoint(path, model, optimizer=optimizer, scheduler=scheduler, step=2)
        res["failed_save_raised"] = False
    except OSError:
        res["failed_save_raised"] = True
    finally:
        dist_checkpointing.save = real_save
    torch.distributed.barrier()
    after = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
    res["intact_after_failed_save"] = before == after
    res["dir_after_failed_save"] = sorted(p.name for p in path.parent.iterdir())
    ck.load_checkpoint(path, model, optimizer=optimizer, scheduler=scheduler)
    res["reload_logits_err"] = float((_logits(model, _batch(100)) - logits2).abs().max())
    res["tp2_loss3"] = _train_step(model, optimizer, scheduler, _batch(3))
    save_params(chunks, outdir / "p3_tp2")
    destroy_mesh()

    # DP2: the DistributedOptimizer shards Adam's state over the two ranks; each rank sees half the batch.
    # First one step from the same initial weights as L1 with a fresh optimizer, then the resume.
    chunks, model, optimizer, scheduler = _setup({}, seed=9)
    load_params(chunks, l1 / "p0")
    res["dp2_loss1"] = _train_step(model, optimizer, scheduler, _batch(1))
    res["dp2_fresh_param_err"], res["dp2_fresh_param_err_where"] = max_abs_diff(
        local_values(chunks, source="data"), read_as_local(chunks, l1 / "p1")
    )
    destroy_mesh()
    chunks, model, optimizer, scheduler = _setup({}, seed=9)
    ck.load_checkpoint(latest, model, optimizer=optimizer, scheduler=scheduler)
    res["dp2_loss2"] = _train_step(model, optimizer, scheduler, _batch(2))
    res["dp2_param_err"], res["dp2_param_err_where"] = max_abs_diff(
        local_values(chunks, source="data"), read_as_local(chunks, l1 / "p2")
    )
    _write(outdir, "two_processes", res)


# -- L3 ------------------------------------------------------------------------------------------------

NEW_LR = dict(lr=3e-4, min_lr=2e-5)  # a resume after an instability: lower peak and floor


def _adam_state(optimizer) -> list[torch.Tensor]:
    """Every Adam moment and step counter of this rank, in the optimizer's own order."""
    out = []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                st = sub.optimizer.state[p]
                out += [st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["step"].clone().float()]
    return out


def one_process_load(rank: int, world: int, outdir: Path, l2: str) -> None:
    from megagrpo.learner import checkpoint as ck
    from megagrpo.learner.mesh import destroy_mesh
    from tests.dist._common import local_values, max_abs_diff, read_as_local

    l2 = Path(l2)
    res: dict[str, Any] = {}
    chunks, model, optimizer, scheduler = _setup({}, seed=10)
    path = ck.latest_checkpoint(l2 / "ckpt")
    meta = ck.load_checkpoint(path, model, optimizer=optimizer, scheduler=scheduler)
    res["meta_step"], res["saved_mesh"] = meta.step, meta.mesh
    res["logits_err"] = float(
        (_logits(model, _batch(100)) - torch.load(l2 / "l2_logits_step2.pt")).abs().max()
    )
    moments = _adam_state(optimizer)
    res["loss3"] = _train_step(model, optimizer, scheduler, _batch(3))
    res["param_err_step3"], res["param_err_step3_where"] = max_abs_diff(
        local_values(chunks, source="data"), read_as_local(chunks, l2 / "p3_tp2")
    )
    destroy_mesh()

    # The same checkpoint into a run whose config changed optimizer.lr and min_lr.
    chunks, model, optimizer, scheduler = _setup({}, seed=10, opt=NEW_LR)
    res["new_lr_error"] = _error(
        lambda: ck.load_checkpoint(path, model, optimizer=optimizer, scheduler=scheduler)
    )
    got = _adam_state(optimizer)
    res["new_lr_moments_err"] = max(float((a - b).abs().max()) for a, b in zip(got, moments, strict=True))
    res["new_lr_groups"] = [{k: g[k] for k in ("lr", "max_lr", "min_lr")} for g in optimizer.param_groups]
    res["new_lr_loss3"] = _train_step(model, optimizer, scheduler, _batch(3))
    res["new_lr_after_step3"] = [g["lr"] for g in optimizer.param_groups]
    _write(outdir, "one_process_load", res)


# -- the launches ----------------------------------------------------------------------------------------


def _launch(target: str, nprocs: int, outdir: Path, timeout: float = 400, **kwargs: Any) -> tuple[int, str]:
    """Like tests.dist._harness.launch, but returns the exit code (-999 on timeout): L1 is meant to die. A
    SIGKILLed rank leaves megatron's checkpoint-writer manager process behind; `run` kills it with the
    launch's process group."""
    log = outdir / f"launch_{target.rsplit(':', 1)[-1]}.log"
    rc = run(target, nprocs, outdir, log, timeout=timeout, **kwargs)
    out = log.read_text()
    return (rc if rc is not None else -999), out + ("" if rc is not None else "\nTIMEOUT")


def _read(outdir: Path, phase: str, n: int) -> list[dict[str, Any]]:
    return [json.loads((outdir / f"rank{r}_{phase}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    l1, l2, l3 = base / "l1", base / "l2", base / "l3"
    rc, out = _launch("tests.dist.test_checkpoint:one_process", 1, l1)
    assert (l1 / "killed_after_write").exists() and rc != 0, (
        f"L1 should die by SIGKILL in the save:\n{out[-8000:]}"
    )
    rc, out = _launch("tests.dist.test_checkpoint:two_processes", 2, l2, l1=str(l1))
    assert rc == 0, out[-12000:]
    rc, out = _launch("tests.dist.test_checkpoint:one_process_load", 1, l3, l2=str(l2))
    assert rc == 0, out[-12000:]
    return {
        "l1": _read(l1, "one_process", 1)[0],
        "l2": _read(l2, "two_processes", 2),
        "l3": _read(l3, "one_process_load", 1)[0],
    }


def test_logprobs_tp2_match_unsharded(runs):
    for r in runs["l2"]:
        for key, v in r.items():
            if key.startswith(("logp_err/", "entropy_err/", "grad_err/")):
                # Against the exact (fp64) unsharded values: fp64 shows the sharded math is exact; fp32 is
                # within its resolution (x/T of a peaked logit ~57 alone is off by ~4e-6 in fp32).
                assert v <= (5e-6 if key.startswith("float32/", key.index("/") + 1) else 1e-12), (key, v)
            if key.startswith("tp_vs_unsharded/"):
                assert v <= (1e-6 if "float32" in key else 1e-12), (key, v)
            if key.startswith("entropy_none/"):
                assert v is True
        assert sum(k.startswith("grad_err/") for k in r) == 8


def test_one_adam_step_dp2_and_tp2_equal_one_process(runs):
    l1 = runs["l1"]
    for r in runs["l2"]:
        assert r["tp2_loss2"] == pytest.approx(l1["loss2"], rel=1e-6)
        assert r["dp2_loss2"] == pytest.approx(l1["loss2"], rel=1e-6)
        assert r["tp2_param_err"] <= 1e-5 and r["dp2_param_err"] <= 1e-5, r


def test_scheduler_and_rng_resume(runs):
    l1 = runs["l1"]
    assert l1["lr_after_load"] == l1["lr_after_1"] == pytest.approx(OPT["lr"])  # warm-up of 1 step done
    assert l1["rng_restored_err"] == 0.0
    assert l1["meta"]["step"] == 1 and l1["meta"]["consumed"] == B
    assert l1["meta"]["extra"] == {"data": {"epoch": 0, "index": 4}}
    for r in runs["l2"]:
        assert r["tp2_meta_step"] == 1 and r["tp2_lr_after_load"] == pytest.approx(l1["lr_after_1"])


def test_checkpoint_reshards_between_one_process_and_tp2(runs):
    for r in runs["l2"]:
        assert r["tp2_logits_err"] <= 1e-5, r
    l3 = runs["l3"]
    assert l3["saved_mesh"]["tp"] == 2 and l3["meta_step"] == 2
    assert l3["logits_err"] <= 1e-5
    # The optimizer state saved on TP2 resumes on one process: step 3 gives the same params.
    assert l3["param_err_step3"] <= 1e-5
    assert l3["loss3"] == pytest.approx(runs["l2"][0]["tp2_loss3"], rel=1e-6)


def _cosine_lr(step: int, lr: float, min_lr: float) -> float:
    """megatron's cosine decay after a linear warm-up (`OptimizerParamScheduler.get_lr`), for SCHED."""
    w, total = SCHED["warmup_steps"], SCHED["total_steps"]
    ratio = (step - w) / (total - w)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def test_resume_with_a_changed_lr_keeps_the_moments_and_takes_the_new_lr(runs):
    l3 = runs["l3"]
    assert l3["new_lr_error"] == "NO ERROR RAISED"
    # Adam's moments and step counters are the checkpoint's, bit for bit.
    assert l3["new_lr_moments_err"] == 0.0
    # The config's LR schedule is in effect at the checkpoint's position (step 2), and stays (step 3).
    assert l3["new_lr_groups"], l3
    for g in l3["new_lr_groups"]:
        assert g["max_lr"] == NEW_LR["lr"] and g["min_lr"] == NEW_LR["min_lr"], g
        assert g["lr"] == pytest.approx(_cosine_lr(2, **NEW_LR), rel=1e-9), g
    for lr in l3["new_lr_after_step3"]:
        assert lr == pytest.approx(_cosine_lr(3, **NEW_LR), rel=1e-9)
    assert math.isfinite(l3["new_lr_loss3"])
    assert l3["new_lr_loss3"] == pytest.approx(l3["loss3"], rel=1e-6)  # the same weights, the same batch


def test_interrupted_saves_leave_previous_checkpoint(runs):
    for r in runs["l2"]:
        # SIGKILL inside the writer (L1): step 2 never became a checkpoint; step 1 loads (above).
        assert r["latest"].endswith("step_00000001"), r["latest"]
        assert "step_00000002" not in r["leftover_tmp"]
        assert any(".tmp-" in n for n in r["leftover_tmp"]), r["leftover_tmp"]
        # An exception inside the writer while replacing step 2 (L2): old files byte-identical, no tmp.
        assert r["failed_save_raised"] and r["intact_after_failed_save"]
        assert r["dir_after_failed_save"] == ["step_00000002"]
        assert r["reload_logits_err"] == 0.0


def test_errors_name_the_path_and_the_fix(runs):
    errs, paths = runs["l1"]["errors"], runs["l1"]["paths"]
    assert "step_00000099" in errs["missing"] and "does not exist" in errs["missing"]
    assert "step_00000001" in errs["missing"]  # points at the newest complete checkpoint
    assert paths["foreign"] in errs["foreign"] and "not a megagrpo checkpoint" in errs["foreign"]
    assert "checkpoint ROOT" in errs["root"] and "--resume auto" in errs["root"]
    assert (
        "corrupt" in errs["truncated"] and "bytes" in errs["truncated"] and "delete it" in errs["truncated"]
    )
    assert "step_00000002" in errs["garbled"] and "could not be read" in errs["garbled"]
    assert "meta.json is corrupt" in errs["bad_meta"] and "step_00000003" in errs["bad_meta"]
    assert errs["latest_skips_damaged"].endswith("step_00000002")
    assert "no optimizer state" in errs["no_optimizer"]
    assert "num_experts" in errs["arch"] and "different model architecture" in errs["arch"]
