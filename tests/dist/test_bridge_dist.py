"""Issue 5 on gloo CPU meshes: converted checkpoints against Hugging Face transformers, and the streaming export.

One 4-process launch (tests/dist/_harness.py) runs every case in sequence: rank 0 converts each tiny HF
model with tools/convert_hf_to_megatron.py, then every mesh loads the dist checkpoint and
- computes logits on a fixed batch (pipeline stages exchanged by hand, TP vocab shards gathered), compared
  with the logits of `transformers` (fp32, eager attention) computed in this pytest process;
- (export cases) runs `iter_hf_buckets` for several bucket sizes; rank 0 checks that the buckets hold
  exactly the HF state dict (names, dtypes, values) and respect the size bound, other ranks get nothing.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megagrpo.compat import APPLIED
from tests.dist._common import regrouped, without_q_latent
from tests.dist._harness import launch

if not APPLIED:
    # transformers' modeling code fails to import once the CPU patches replaced torch.cuda.Stream, so the
    # pytest process imports it at collection; the forked ranks (patched) never need it.
    from transformers import AutoModelForCausalLM  # noqa: F401

NO_Q_LATENT = "deepseek_v3_no_q_latent"
NO_Q_LATENT_MESHES = ("tp2_sp", "tp2_ep2")  # one process: tests/integration/test_convert.py
# 16 experts in 4 groups, 2 kept, top-6 (`_common.regrouped`): megatron alone would score a group by its
# top 3, the model by its top 2 (moe.group_topk.GroupScoredRouter)
REGROUPED = "deepseek_v3_g4_k2_top6"
REGROUPED_MESHES = ("single", "tp2_ep2")

MODELS = {
    # tied embeddings are not here: megatron's LanguageModule.setup_embeddings_and_output_layer calls
    # `weight.data.cuda()` whenever torch.distributed is initialised, which has no CPU-compat patch yet
    # (reported); tests/unit/bridge covers the tied map and its export.
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen3_moe": dict(arch="qwen3_moe", experts=8, topk=2),
    "mixtral": dict(arch="mixtral", experts=8, topk=2),
    # sigmoid routers with a correction bias, group-limited top-k, shared experts, a dense first layer;
    # 4 layers so that PP2 puts the dense layer and one MoE layer on stage 0, two MoE layers on stage 1
    "deepseek_v3": dict(arch="deepseek_v3", experts=8, topk=2, layers=4),  # MLA + YaRN
    # q_lora_rank null (Moonlight): q is one column-parallel projection (`_common.without_q_latent`)
    "deepseek_v3_no_q_latent": dict(arch="deepseek_v3", experts=8, topk=2, layers=4),
    "glm4_moe": dict(arch="glm4_moe", experts=8, topk=2, layers=4),  # partial rotary, qkv bias, qk norm
    # 5 layers divide by no PP size (issue 37 section 4): uneven PP2, 2 layers (dense + MoE) then 3 MoE
    "deepseek_v3_5l": dict(arch="deepseek_v3", experts=8, topk=2, layers=5),
    REGROUPED: dict(arch="deepseek_v3", experts=8, topk=2, layers=4),
    # learned sinks, sliding window 4 on layers 0 and 2 (the 16-token batch crosses it), q/k/v/o biases,
    # YaRN without truncation, a biased router, expert biases, clamped SwiGLU; PP2 puts a sliding and a
    # full layer on each stage (layer numbers are global)
    "gpt_oss": dict(arch="gpt_oss", experts=8, topk=2, layers=4),
}
UNEVEN = {"deepseek_v3_5l": ("pp2_first2",)}  # models checked on uneven pipeline stages only
DENSE_MESHES = ("tp2", "pp2", "tp2_pp2")
MOE_MESHES = ("tp2_sp", "ep2", "tp2_ep2", "tp2_ep2_etp2", "ep2_pp2")
V3_MESHES = ("single", "tp2_sp", "ep2", "pp2", "tp2_ep2")
MESH_KW = {
    "single": {},
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "ep2": dict(ep=2),
    "tp2_ep2": dict(tp=2, ep=2, sequence_parallel=True),
    "tp2_ep2_etp2": dict(tp=2, ep=2, etp=2, sequence_parallel=True),
    "ep2_pp2": dict(ep=2, pp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "pp2_first2": dict(pp=2, first_stage_layers=2),
}
# (model, mesh) pairs whose export is checked, in addition to their logits
EXPORTS = {
    ("qwen3_moe", "tp2_ep2"),
    ("qwen3_moe", "tp2_ep2_etp2"),
    ("mixtral", "ep2_pp2"),
    ("llama", "tp2_pp2"),
    ("deepseek_v3", "tp2_ep2"),
    (NO_Q_LATENT, "tp2_ep2"),
    ("glm4_moe", "pp2"),
    ("deepseek_v3_5l", "pp2_first2"),
    ("gpt_oss", "tp2_ep2"),  # stacked HF experts gathered over EP and stacked back
}
BUCKETS = (1, 3000, 70000, 1 << 40)
SEQ, BATCH = 16, 2


def cases() -> list[tuple[str, str]]:
    out = []
    for model, spec in MODELS.items():
        if model in UNEVEN:
            meshes = UNEVEN[model]
        elif spec["arch"] in ("deepseek_v3", "glm4_moe", "gpt_oss"):
            meshes = V3_MESHES
        else:
            meshes = MOE_MESHES if spec["arch"] in ("qwen3_moe", "mixtral") else DENSE_MESHES
        out += [(model, mesh) for mesh in meshes]
    only = {NO_Q_LATENT: NO_Q_LATENT_MESHES, REGROUPED: REGROUPED_MESHES}
    return [(m, mesh) for m, mesh in out if mesh in only.get(m, (mesh,))]


def fixed_batch(vocab: int = 1024) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234))


# -- worker (runs in the forked ranks) ---------------------------------------------------------------


def _forward_logits(model, ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Full-vocab logits [B, T, V] on last-stage ranks (None elsewhere); stages exchanged by send/recv."""
    from megatron.core import parallel_state as ps

    model.eval()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            sp = model.config.sequence_parallel
            tp = ps.get_tensor_model_parallel_world_size()
            buf = torch.empty(ids.shape[1] // (tp if sp else 1), ids.shape[0], model.config.hidden_size)
            dist.recv(buf, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(buf)
        out = model(input_ids=ids, position_ids=pos, attention_mask=None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
    group = ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, out.contiguous(), group=group)
    return torch.cat(shards, dim=-1)[..., :vocab]


def _check_export(model, arch, hf_dir: Path, layer_offset: int) -> dict:
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from megagrpo.bridge.export import ExportGroups, export_tensors, iter_hf_buckets

    groups = ExportGroups.from_parallel_state(ps, layer_offset=layer_offset)
    ref = load_file(str(hf_dir / "model.safetensors"))
    res = {}
    for bucket_bytes in BUCKETS:
        seen: dict[str, torch.Tensor] = {}
        over = 0
        n_buckets = 0
        for bucket in iter_hf_buckets(export_tensors(model), arch, bucket_bytes=bucket_bytes, groups=groups):
            n_buckets += 1
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            over += int(size > bucket_bytes and len(bucket) > 1)
            for name, t in bucket:
                assert name not in seen, f"{name} exported twice"
                seen[name] = t.clone()
        diff = sorted(set(seen) ^ set(ref))
        bad = [
            n
            for n in ref
            if n in seen and not (seen[n].dtype == ref[n].dtype and torch.equal(seen[n], ref[n]))
        ]
        res[str(bucket_bytes)] = dict(key_diff=diff[:5], mismatched=bad[:5], over=over, buckets=n_buckets)
    # the exporter of each model-parallel replica (DP replicas beyond EP export independently)
    res["exporter"] = all(g.rank() == 0 for g in (groups.tp, groups.etp, groups.ep, groups.pp))
    # every rank an engine owner (rollout.groups): each receives the whole model from its own replica,
    # whatever its TP/EP rank and pipeline stage
    with _counted_traffic() as received:
        got = {
            n: t.clone()
            for b in iter_hf_buckets(
                export_tensors(model), arch, bucket_bytes=RECEIVE_BUCKET, groups=groups, receive=True
            )
            for n, t in b
        }
    res["receive"] = dict(
        key_diff=sorted(set(got) ^ set(ref))[:5],
        mismatched=[n for n in ref if n in got and not torch.equal(got[n], ref[n])][:5],
    )
    res["traffic"] = dict(received=received[0], model=sum(t.numel() * t.element_size() for t in ref.values()))
    # a pipeline stage's own tensors only (disaggregated PP > 1: each stage feeds its own weights group)
    real_send, real_recv = dist.send, dist.recv

    def crossing(*a, **kw):
        raise AssertionError("a stage-only export moved a tensor over the pipeline group")

    dist.send = dist.recv = crossing
    try:
        own = {
            n: t.clone()
            for b in iter_hf_buckets(
                export_tensors(model),
                arch,
                bucket_bytes=RECEIVE_BUCKET,
                groups=groups,
                receive=True,
                stage_only=True,
            )
            for n, t in b
        }
    finally:
        dist.send, dist.recv = real_send, real_recv
    res["stage"] = dict(
        pp_rank=groups.pp.rank() if groups.pp is not None else 0,
        names=sorted(own),
        mismatched=[n for n in own if n not in ref or not torch.equal(own[n], ref[n])][:5],
        of=len(ref),
    )
    return res


RECEIVE_BUCKET = 70000


@contextlib.contextmanager
def _counted_traffic():
    """Bytes this rank receives through the export's tensor collectives (TP/ETP/EP all-gathers, PP recv)."""
    received = [0]
    real_gather, real_recv = dist.all_gather, dist.recv

    def gather(out, t, *a, **kw):
        received[0] += sum(o.numel() * o.element_size() for o in out) - t.numel() * t.element_size()
        return real_gather(out, t, *a, **kw)

    def recv(t, *a, **kw):
        received[0] += t.numel() * t.element_size()
        return real_recv(t, *a, **kw)

    dist.all_gather, dist.recv = gather, recv
    try:
        yield received
    finally:
        dist.all_gather, dist.recv = real_gather, real_recv


def worker(rank: int, world: int, outdir: Path, *, models: dict, cases: list, refs: str) -> None:

    from megagrpo.config.model import ModelArch
    from megagrpo.convert.hf_to_megatron import convert, read_checkpoint_info
    from megagrpo.convert.megatron_to_hf import layer_offset, load_model
    from megagrpo.learner.mesh import DistEnv, MeshConfig, destroy_mesh, init_mesh

    env = DistEnv.from_environ()
    init_mesh(MeshConfig(), env)
    ckpts = {name: outdir / f"ckpt_{name}" for name in models}
    if rank == 0:
        for name, hf_dir in models.items():
            convert(hf_dir, ckpts[name], progress=False)
    dist.barrier()
    reference = torch.load(refs)
    ids = reference["ids"]
    results = {}
    for model_name, mesh_name in cases:
        mesh_cfg = MeshConfig(**MESH_KW[mesh_name])
        init_mesh(mesh_cfg, env)
        arch = ModelArch.from_dict(read_checkpoint_info(ckpts[model_name])["arch"])
        (model,) = load_model(ckpts[model_name], arch, mesh_cfg, torch.float32)
        logits = _forward_logits(model, ids, arch.vocab_size)
        r: dict = {"last_stage": logits is not None}
        if logits is not None:
            r["logits_err"] = (logits - reference[model_name]).abs().max().item()
        if (model_name, mesh_name) in EXPORTS:
            r["export"] = _check_export(model, arch, Path(models[model_name]), layer_offset(model))
        results[f"{model_name}/{mesh_name}"] = r
        del model
        destroy_mesh()
        dist.barrier()
    (outdir / f"rank{rank}.json").write_text(json.dumps(results))


# -- pytest side -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_dist")
    from transformers import AutoModelForCausalLM

    dirs = {name: str(tiny_model(**spec)) for name, spec in MODELS.items()}
    dirs[NO_Q_LATENT] = str(without_q_latent(Path(dirs[NO_Q_LATENT]), out / f"src_{NO_Q_LATENT}"))
    dirs[REGROUPED] = str(
        regrouped(
            Path(dirs[REGROUPED]), out / f"src_{REGROUPED}", experts=16, n_group=4, topk_group=2, topk=6
        )
    )
    ids = fixed_batch()
    refs: dict[str, torch.Tensor] = {"ids": ids}
    for name, d in dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            refs[name] = hf(ids).logits
    torch.save(refs, out / "refs.pt")
    launch(
        "tests.dist.test_bridge_dist:worker",
        4,
        out,
        timeout=1200,
        models=dirs,
        cases=cases(),
        refs=str(out / "refs.pt"),
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("case", [f"{m}/{mesh}" for m, mesh in cases()])
def test_logits_match_transformers(results, case):
    last = [res[case] for res in results if res[case]["last_stage"]]
    assert last, f"{case}: no rank reported logits"
    for r in last:
        assert r["logits_err"] <= 1e-4, f"{case}: max |logits - HF logits| = {r['logits_err']}"


@pytest.mark.parametrize("case", sorted(f"{m}/{mesh}" for m, mesh in EXPORTS))
def test_streaming_export_is_the_hf_state_dict(results, case):
    exports = [res[case]["export"] for res in results]
    for rank, exp in enumerate(exports):
        assert exp["receive"] == dict(key_diff=[], mismatched=[]), f"{case}: receiving rank {rank}"
        # issue 14's bound on sync traffic: no rank receives more than one model plus two buckets
        t = exp["traffic"]
        assert 0 < t["received"] <= t["model"] + 2 * RECEIVE_BUCKET, f"{case}: rank {rank} received {t}"
    assert exports[0]["exporter"], f"{case}: rank 0 is not an exporter"
    # stage-only exports: every rank of a stage yields the same names, the stages' are disjoint and together
    # the whole state dict, each tensor equal to HF's
    by_stage: dict[int, set] = {}
    for rank, exp in enumerate(exports):
        st = exp["stage"]
        assert st["mismatched"] == [], f"{case}: rank {rank} stage-only tensors differ: {st['mismatched']}"
        assert by_stage.setdefault(st["pp_rank"], set(st["names"])) == set(st["names"]), (
            f"{case}: rank {rank}"
        )
    stages = list(by_stage.values())
    assert sum(len(n) for n in stages) == len(set().union(*stages)), f"{case}: a tensor sent by two stages"
    assert len(set().union(*stages)) == exports[0]["stage"]["of"], f"{case}: a tensor sent by no stage"
    for rank, exp in enumerate(exports):
        if not exp["exporter"]:
            assert all(exp[str(b)]["buckets"] == 0 for b in BUCKETS), (
                f"{case}: non-exporter rank {rank} got buckets"
            )
            continue
        for bucket_bytes in BUCKETS:
            r = exp[str(bucket_bytes)]
            ctx = f"{case} rank {rank} bucket {bucket_bytes}"
            assert r["key_diff"] == [], f"{ctx}: key sets differ {r['key_diff']}"
            assert r["mismatched"] == [], f"{ctx}: values differ {r['mismatched']}"
            assert r["over"] == 0, f"{ctx}: {r['over']} multi-tensor buckets over the bound"
        # 1-byte buckets hold one tensor each; an unbounded bucket holds everything
        assert exp["1"]["buckets"] > exp[str(1 << 40)]["buckets"] == 1
