"""Shared pieces of the distributed workers: the tiny MoE architecture, batches, and comparisons of
sharded tensors through megatron dist checkpoints (which reshard between any two meshes)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from megagrpo.config.model import ModelArch

TINY_MOE = ModelArch(
    family="qwen3_moe",
    vocab_size=1000,  # padded to 1024: exercises the masked padded-vocab rows
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_hidden_size=128,
    max_position_embeddings=256,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    num_experts=4,
    moe_topk=2,
    moe_ffn_hidden_size=32,
)
# DeepSeek-V3's router (sigmoid, correction bias, 2 groups with 1 kept, scaled by 2.5, a shared expert)
# and its dense first layer: with PP2, stage 0 holds the dense layer and one MoE layer, stage 1 two.
_V3_ROUTER = dict(
    qk_norm=False,
    num_experts=8,
    moe_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_expert_bias=True,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5,
    moe_shared_expert_ffn_hidden_size=32,
    moe_layer_pattern=(0, 1, 1, 1),
)
TINY_DEEPSEEK_V3 = dataclasses.replace(
    TINY_MOE,
    family="deepseek_v3",
    num_kv_heads=4,
    head_dim=24,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_type="yarn",
    rope_scaling_factor=4.0,
    rope_original_max_position_embeddings=64,
    rope_mscale_all_dim=1.0,
    **_V3_ROUTER,
)
# 5 layers divide by no PP size > 1 (DeepSeek-V3's 61 by none): PP2 with mesh.first_stage_layers=2 puts
# the dense layer and one MoE layer on stage 0 and three MoE layers on stage 1 (issue 37 section 4)
TINY_DEEPSEEK_V3_5L = dataclasses.replace(TINY_DEEPSEEK_V3, num_layers=5, moe_layer_pattern=(0, 1, 1, 1, 1))
TINY_GLM4_MOE = dataclasses.replace(
    TINY_MOE, family="glm4_moe", **{**_V3_ROUTER, "qk_norm": True}, qkv_bias=True, rotary_percent=0.5
)
# gpt-oss: sinks, a sliding window of 4 on layers 0 and 2 (the 24-token rows cross it), q/k/v/o biases,
# YaRN unrounded, a biased router (softmax over the top-k), expert biases, clamped SwiGLU
TINY_GPT_OSS = dataclasses.replace(
    TINY_MOE,
    family="gpt_oss",
    qk_norm=False,
    qkv_bias=True,
    attn_out_bias=True,
    attention_sinks=True,
    layer_types=("sliding_attention", "full_attention") * 2,
    sliding_window=4,
    num_experts=8,
    moe_ffn_hidden_size=64,
    moe_router_bias=True,
    moe_expert_bias=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    swiglu_up_offset=1.0,
    rope_type="yarn",
    rope_scaling_factor=4.0,
    rope_original_max_position_embeddings=64,
    rope_truncate=False,
)


def without_q_latent(src: Path, dst: Path) -> Path:
    """A copy of tiny deepseek_v3 model `src` with q_lora_rank null (a full q projection, as Moonlight and
    DeepSeek-V2-Lite ship), its weights drawn afresh."""
    from transformers import AutoConfig, AutoModelForCausalLM  # pytest side only (before CPU patches)

    from megagrpo.tiny_model import _randomise_v3_extras

    shutil.copytree(src, dst)
    cfg = AutoConfig.from_pretrained(src)
    cfg.q_lora_rank = None
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomise_v3_extras(model, 1)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def regrouped(src: Path, dst: Path, *, experts: int, n_group: int, topk_group: int, topk: int) -> Path:
    """A copy of tiny deepseek_v3 model `src` routed over `experts` experts in `n_group` groups, `topk_group`
    kept, top-`topk`, its weights drawn afresh (e.g. 4 groups, 2 kept, top-6: a group score that megatron's
    own rule, the sum of its top topk / topk_group, computes differently from the model's top-2 sum)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # pytest side only (before CPU patches)

    from megagrpo.tiny_model import _randomise_v3_extras

    shutil.copytree(src, dst)
    cfg = AutoConfig.from_pretrained(src)
    cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok = (
        experts,
        n_group,
        topk_group,
        topk,
    )
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomise_v3_extras(model, 2)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def randomise_expert_bias(chunks: list[Any], seed: int = 0) -> None:
    """Random correction biases (megatron initialises them to zero), so that the selection depends on them."""
    g = torch.Generator().manual_seed(seed)
    for c in chunks:
        for n, b in unwrap(c).named_buffers():
            if n.endswith("router.expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def randomise_sinks_and_biases(chunks: list[Any], seed: int = 0) -> None:
    """Random attention sinks and linear biases of a model that has sinks (gpt-oss): megatron's zero biases
    and 0.02-wide sinks would leave them out of every number."""
    g = torch.Generator().manual_seed(seed)
    for c in chunks:
        if not any(n.endswith("softmax_offset") for n, _ in unwrap(c).named_parameters()):
            continue
        with torch.no_grad():
            for n, p in unwrap(c).named_parameters():
                if n.endswith(".bias"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
                elif n.endswith("softmax_offset"):
                    p.copy_(torch.randn(p.shape, generator=g))


def make_batch(B: int = 8, T: int = 24, seed: int = 0, vocab: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lens = torch.randint(T // 3, T + 1, (B,), generator=g)
    lens[0] = T
    pos = torch.arange(T).unsqueeze(0)
    prompt = torch.randint(2, 6, (B, 1), generator=g)
    loss_mask = (pos >= prompt) & (pos < lens.unsqueeze(1))
    ids = torch.where(pos < lens.unsqueeze(1), ids, torch.zeros_like(ids))
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 5 - 1
    return {"input_ids": ids, "seq_lens": lens, "loss_mask": loss_mask, "advantages": adv, "old_logp": old}


def unwrap(m: Any) -> Any:
    while hasattr(m, "module"):
        m = m.module
    return m


def save_params(chunks: list[Any], path: Path, *, source: str = "data") -> None:
    """Dist checkpoint of the model, with param data (`source="data"`) or main grads (`"grad"`)."""
    from megatron.core import dist_checkpointing

    models = [unwrap(c) for c in chunks]
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    saved = []
    if source == "grad":
        for m in models:
            for p in m.parameters():
                g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
                saved.append((p, p.data))
                p.data = g.detach().to(p.dtype).clone()
    try:
        sd = _sharded(models)
        dist_checkpointing.save(sd, str(path))
    finally:
        for p, d in saved:
            p.data = d


def _sharded(models: list[Any]) -> dict[str, Any]:
    if len(models) == 1:
        return models[0].sharded_state_dict()
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def load_params(chunks: list[Any], path: Path) -> None:
    from megatron.core import dist_checkpointing

    models = [unwrap(c) for c in chunks]
    loaded = dist_checkpointing.load(_sharded(models), str(path))
    if len(models) == 1:
        models[0].load_state_dict(loaded, strict=False)
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded[f"model{i}"], strict=False)


def read_as_local(chunks: list[Any], path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint at `path` in THIS rank's sharding, by local parameter name (params untouched)."""
    models = [unwrap(c) for c in chunks]
    keep = [{n: p.data.clone() for n, p in m.named_parameters()} for m in models]
    load_params(chunks, path)
    out = {}
    for i, m in enumerate(models):
        for n, p in m.named_parameters():
            out[f"{i}.{n}"] = p.data.clone()
            p.data.copy_(keep[i][n])
    return out


def local_values(chunks: list[Any], *, source: str) -> dict[str, torch.Tensor]:
    out = {}
    for i, c in enumerate(chunks):
        for n, p in unwrap(c).named_parameters():
            if source == "grad":
                g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
                out[f"{i}.{n}"] = g.detach().clone()
            else:
                out[f"{i}.{n}"] = p.data.clone()
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k, v in a.items():
        d = float((v.float() - b[k].float()).abs().max()) if v.numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
