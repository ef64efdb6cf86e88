"""HF checkpoint tensors -> the parameters SGLang holds after loading them (TP=1): names, shapes, fusion.

SGLang fuses some HF tensors when it loads them (llama/qwen2/qwen3/qwen3_moe/mixtral/glm4_moe/deepseek_v3):
  q_proj, k_proj, v_proj        -> self_attn.qkv_proj   (concatenated on dim 0, order q, k, v)
  gate_proj, up_proj (dense)    -> mlp.gate_up_proj     (concatenated on dim 0, order gate, up)
  shared_experts.gate/up_proj   -> mlp.shared_experts.gate_up_proj   (the same, for shared experts)
  q_a_proj, kv_a_proj_with_mqa  -> self_attn.fused_qkv_a_proj_with_mqa (multi-latent attention with a q
                                   latent; order q_a, kv_a. With q_lora_rank null, q_proj and
                                   kv_a_proj_with_mqa keep their names)
  experts.{e}.gate_proj/up_proj -> mlp.experts.w13_weight [E, 2I, H]  (per expert: gate rows, then up rows)
  experts.{e}.down_proj         -> mlp.experts.w2_weight  [E, H, I]
  (Mixtral: w1 = gate, w3 = up, w2 = down, under block_sparse_moe.)
Every other tensor keeps its HF name. SGLang keeps a router's correction bias (`e_score_correction_bias`)
in fp32 whatever the engine's dtype (`FP32_PARAMS`, `engine_dtype`). MLA's `w_kc`/`w_vc` are not
parameters: SGLang derives them from `kv_b_proj` after a load (`staging.load_packed` refreshes them).

Every fusion above is a concatenation on dim 0 of the parts, in `FusedParam.parts` order, into the fused
tensor viewed as `[-1, *part.shape[1:]]`: w13 is `[g_0; u_0; g_1; u_1; ...]` as `[E*2I, H]` and w2 is
`[d_0; d_1; ...]` as `[E*H, I]`. `fuse_into` therefore fills any fused parameter with ONE torch op, whatever
the number of experts.

Padding. An engine may hold a parameter larger than its checkpoint: SGLang's CPU engine rounds every MLP
intermediate size (`moe_intermediate_size`, `intermediate_size`, `shared_expert_intermediate_size`) up
to a multiple of `tp_size * 32` before building the model (`adjust_config_with_unaligned_cpu_tp`; AMX
kernels take only multiples of 32), and some GPU MoE kernels round each TP shard's (flashinfer_trtllm
to 128: GLM-4.5's 1408 over TP 8 is 176 a shard, held as 256). Its loaders
(`narrow_padded_param_and_loaded_weight`, `FusedMoE._load_w13/_load_w2`) shard HF tensors themselves,
then put each part at the start of a slot of the padded size and zero the rest (the HF-named transports,
GPU ones included, rely on that). At TP 1, the packed CPU sync's case, with I real and Ip padded rows:
`w13_weight [E, 2Ip, H]` is `[g_0; 0; u_0; 0; g_1; ...]` (each part in an `[Ip, H]` slot), `w2_weight
[E, H, Ip]` and a dense `down_proj [H, Ip]` have zero columns I..Ip, a dense `gate_up_proj [2Ip, H]` is
`[g; 0; u; 0]`. Zeros are exact: a zero gate and up row gives silu(0) * 0 = 0, and a zero down column
adds nothing. `laid_out` gives a `FusedParam` the engine's shape and each part its `slot`; `fuse_into`
then zeroes the slots' tails and writes every part in one op, so the packed tensor is, byte for byte,
what SGLang's own loader leaves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_ATTN = re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$")
_DENSE = re.compile(r"^(.*\.mlp\.(?:shared_experts\.)?)(gate|up)_proj\.weight$")
_MLA_A = re.compile(r"^(.*\.self_attn\.)(q_a_proj|kv_a_proj_with_mqa)\.weight$")
# Parameters SGLang allocates in fp32 whatever the engine's dtype (DeepSeek-V3's MoEGate): the correction
# bias drives the expert selection, and a rounded bias routes differently from the learner's.
FP32_PARAMS = (".mlp.gate.e_score_correction_bias",)


def engine_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine holds SGLang parameter `name` in, when its model runs in `dtype`."""
    return torch.float32 if name.endswith(FP32_PARAMS) else dtype


_EXPERT = re.compile(
    r"^(.*\.(?:mlp|block_sparse_moe)\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")
_MLP_PROJ = re.compile(r"^.*\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


@dataclass(frozen=True)
class FusedParam:
    """One SGLang parameter (TP=1) and the HF tensors it is built from, concatenated on dim 0 in this order."""

    name: str  # SGLang parameter name, e.g. model.layers.0.mlp.experts.w13_weight
    parts: tuple[str, ...]  # HF checkpoint names, in fill order (a single name: a plain copy)
    shape: tuple[int, ...]  # the SGLang parameter's shape
    # Each part's slot when the engine pads (module doc, "Padding"): the part sits at the start of every
    # dim of its slot, the rest is zero; the parameter is `[len(parts), *slot]`. None: parts fill it exactly.
    slot: tuple[int, ...] | None = None


def _concat(name: str, parts: Sequence[str], shapes: Mapping[str, tuple[int, ...]]) -> FusedParam:
    first = shapes[parts[0]]
    rows = sum(shapes[p][0] for p in parts)
    return FusedParam(name, tuple(parts), (rows, *first[1:]))


def sglang_plan(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FusedParam]:
    """{SGLang parameter name: FusedParam} for a set of HF tensor shapes (full, unsharded: TP=1).

    A group whose parts are not all present (or not shape-compatible) is left unfused: each of its HF
    tensors becomes its own entry under its HF name (which the engine may not hold; callers check).
    """
    plan: dict[str, FusedParam] = {}
    attn: dict[tuple[str, str], dict[str, str]] = {}
    dense: dict[str, dict[str, str]] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    mla_a: dict[str, dict[str, str]] = {}
    for name in shapes:
        if m := _MLA_A.match(name):
            mla_a.setdefault(m.group(1), {})[m.group(2)] = name
        elif m := _ATTN.match(name):
            attn.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = name
        elif m := _EXPERT.match(name):
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
        elif m := _DENSE.match(name):
            dense.setdefault(m.group(1), {})[m.group(2)] = name
        else:
            plan[name] = FusedParam(name, (name,), tuple(shapes[name]))

    def unfused(parts: list[str]) -> None:
        for p in parts:
            plan[p] = FusedParam(p, (p,), tuple(shapes[p]))

    def fused(name: str, parts: list[str]) -> None:
        if all(len(shapes[p]) >= 1 for p in parts) and len({tuple(shapes[p][1:]) for p in parts}) == 1:
            plan[name] = _concat(name, parts, shapes)
        else:
            unfused(parts)

    for (prefix, kind), parts in attn.items():
        if set(parts) == {"q", "k", "v"}:
            fused(f"{prefix}qkv_proj.{kind}", [parts["q"], parts["k"], parts["v"]])
        else:
            unfused(list(parts.values()))
    for prefix, parts in mla_a.items():
        if set(parts) == {"q_a_proj", "kv_a_proj_with_mqa"}:
            fused(
                f"{prefix}fused_qkv_a_proj_with_mqa.weight", [parts["q_a_proj"], parts["kv_a_proj_with_mqa"]]
            )
        else:
            unfused(list(parts.values()))
    for prefix, parts in dense.items():
        if set(parts) == {"gate", "up"}:
            fused(f"{prefix}gate_up_proj.weight", [parts["gate"], parts["up"]])
        else:
            unfused(list(parts.values()))
    for prefix, per_expert in experts.items():
        n = max(per_expert) + 1
        w13: list[str] = []
        w2: list[str] = []
        for e in range(n):
            kinds = per_expert.get(e, {})
            gate = next((kinds[k] for k in _GATE if k in kinds), None)
            up = next((kinds[k] for k in _UP if k in kinds), None)
            down = next((kinds[k] for k in _DOWN if k in kinds), None)
            if gate is None or up is None or down is None or len(kinds) != 3:
                break
            w13 += [gate, up]
            w2.append(down)
        else:
            gu, d = tuple(shapes[w13[0]]), tuple(shapes[w2[0]])
            if (
                len(gu) == 2
                and all(tuple(shapes[p]) == gu for p in w13)
                and all(tuple(shapes[p]) == d for p in w2)
            ):
                w13_name, w2_name = f"{prefix}w13_weight", f"{prefix}w2_weight"
                plan[w13_name] = FusedParam(w13_name, tuple(w13), (n, 2 * gu[0], gu[1]))
                plan[w2_name] = FusedParam(w2_name, tuple(w2), (n, *d))
                continue
        unfused([p for kinds in per_expert.values() for p in kinds.values()])
    return plan


def load_groups(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """{HF name: the HF tensors that SGLang's `load_weights` fuses with it at load, itself included, in fill
    order} for every tensor in such a group of two or more: `sglang_plan`'s concatenations (q/k/v, a
    dense or shared MLP's gate/up, MLA's q_a/kv_a pair) and each routed expert's gate/up pair (its slot
    of `w13_weight`, paired even where the layer's experts are incomplete, as SGLang loads them pair by
    pair; the experts of one layer are not one group).

    Why a group must reach one `load_weights` call whole: SGLang's DeepSeek-V3 loader caches q_a_proj
    until kv_a_proj_with_mqa arrives in the same call, and a cache that ends with the call drops a lone
    half without a word (the engine keeps serving the old fused weight). The other fusions load each part
    into its slot and survive a split today; they are kept whole too, so that no transport depends on
    which loader caches.
    """
    out: dict[str, tuple[str, ...]] = {}
    for fp in sglang_plan(shapes).values():
        if len(fp.parts) > 1 and len(fp.shape) == len(shapes[fp.parts[0]]):  # a concatenation, not [E, ...]
            out.update(dict.fromkeys(fp.parts, fp.parts))
    pairs: dict[tuple[str, int], dict[bool, str]] = {}
    for name in shapes:
        if (m := _EXPERT.match(name)) and m.group(3) not in _DOWN:
            pairs.setdefault((m.group(1), int(m.group(2))), {})[m.group(3) in _UP] = name
    for pair in pairs.values():
        if len(pair) == 2:
            group = (pair[False], pair[True])  # gate, then up
            out.update(dict.fromkeys(group, group))
    return out


def laid_out(
    fp: FusedParam, held: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
) -> FusedParam | None:
    """`fp` in the shape `held` that the engine allocates for it, with each part's `slot`; `fp` itself
    when `held` is its shape; None when `held` is not a zero-padding of it (module doc, "Padding").

    The parts (all of one shape p) run along fp's dim j = len(fp.shape) - len(p), c of them per index of
    the dims before j (c = 2 for gate/up, 1 for down); padding may grow p's dims only, so `held` must keep
    fp's leading dims and split its dim j into c equal slots no smaller than p."""
    held = tuple(held)
    if held == fp.shape:
        return fp
    p = tuple(shapes[fp.parts[0]])
    j = len(fp.shape) - len(p)
    if (
        j < 0
        or len(held) != len(fp.shape)
        or any(tuple(shapes[q]) != p for q in fp.parts)
        or held[:j] != fp.shape[:j]
        or fp.shape[j + 1 :] != p[1:]
        or fp.shape[j] % p[0]
    ):
        return None
    c = fp.shape[j] // p[0]
    if held[j] % c:
        return None
    slot = (held[j] // c, *held[j + 1 :])
    if any(s < d for s, d in zip(slot, p)):
        return None
    return FusedParam(fp.name, fp.parts, held, slot)


def padded_mlp_shapes(shapes: Mapping[str, tuple[int, ...]], multiple: int) -> dict[str, tuple[int, ...]]:
    """HF shapes with every MLP intermediate size (dense, expert or shared: gate/up rows, down columns)
    rounded up to `multiple`: the checkpoint as SGLang's CPU engine pads it (module doc, "Padding"), for
    an engine that cannot be asked for its shapes (a disaggregated one, over HTTP)."""
    out = {}
    for name, shape in shapes.items():
        kind = _MLP_PROJ.match(name)
        shape = tuple(shape)
        if kind and len(shape) == 2:
            dim = 1 if kind.group(1) in _DOWN else 0
            shape = tuple(-(-d // multiple) * multiple if i == dim else d for i, d in enumerate(shape))
        out[name] = shape
    return out


def fuse_into(
    out: torch.Tensor, parts: Sequence[torch.Tensor], slot: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Write `parts` concatenated on dim 0 into the contiguous `out` (one op; casts to out's dtype). With
    a `slot` (`laid_out`), each part goes to the start of its slot and the slots' tails are zeroed: one
    op per padded dim, plus one strided op for all the parts."""
    if slot is not None:
        grid = out.view(len(parts), *slot)
        p = parts[0].shape
        for dim, (s, d) in enumerate(zip(slot, p)):
            if s > d:
                grid.narrow(dim + 1, d, s - d).zero_()
        torch.stack(list(parts), 0, out=grid[(slice(None), *(slice(0, d) for d in p))])
        return out
    if len(parts) == 1:
        return out.copy_(parts[0].reshape(out.shape))
    rows = sum(p.shape[0] for p in parts)
    torch.cat(list(parts), 0, out=out.view(rows, *parts[0].shape[1:]))
    return out


def sglang_params(
    hf: Mapping[str, torch.Tensor], held: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """{SGLang parameter name: tensor} for the HF tensors given (full, unsharded: TP=1), each laid out in
    the shape `held` gives for it (the engine's, zero-padded: `laid_out`) or, where `held` does not name
    it or is not a padding of it, in the checkpoint's.

    Only fully present groups are fused; members of partial groups appear under their HF names.
    """
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    out: dict[str, torch.Tensor] = {}
    for name, fp in sglang_plan(shapes).items():
        if held is not None and held.get(name) is not None:
            fp = laid_out(fp, held[name], shapes) or fp
        parts = [hf[p] for p in fp.parts]
        dst = torch.empty(fp.shape, dtype=parts[0].dtype)
        out[name] = fuse_into(dst, parts, fp.slot)
    return out
