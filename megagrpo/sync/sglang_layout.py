"""HF checkpoint tensors -> the parameters SGLang holds after loading them (TP=1), for checksums.

SGLang fuses some HF tensors when it loads them (llama/qwen2/qwen3/qwen3_moe/mixtral families):
  q_proj, k_proj, v_proj        -> self_attn.qkv_proj   (concatenated on dim 0, order q, k, v)
  gate_proj, up_proj (dense)    -> mlp.gate_up_proj     (concatenated on dim 0, order gate, up)
  experts.{e}.gate_proj/up_proj -> mlp.experts.w13_weight [E, 2I, H]  (per expert: gate rows, then up rows)
  experts.{e}.down_proj         -> mlp.experts.w2_weight  [E, H, I]
  (Mixtral: w1 = gate, w3 = up, w2 = down, under block_sparse_moe.)
Every other tensor keeps its HF name. `sglang_params` builds these fused tensors from a full set of HF
tensors; a fused parameter is only built when all of its parts are present.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_ATTN = re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$")
_DENSE = re.compile(r"^(.*\.mlp\.)(gate|up)_proj\.weight$")
_EXPERT = re.compile(
    r"^(.*\.(?:mlp|block_sparse_moe)\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_W13 = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


def sglang_params(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{SGLang parameter name: tensor} for the HF tensors given (full, unsharded: TP=1)."""
    out: dict[str, torch.Tensor] = {}
    attn: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    dense: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in hf.items():
        if m := _ATTN.match(name):
            attn.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = t
        elif m := _EXPERT.match(name):
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        elif m := _DENSE.match(name):
            dense.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            out[name] = t
    for (prefix, kind), parts in attn.items():
        if set(parts) == {"q", "k", "v"}:
            out[f"{prefix}qkv_proj.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], 0)
    for prefix, parts in dense.items():
        if set(parts) == {"gate", "up"}:
            out[f"{prefix}gate_up_proj.weight"] = torch.cat([parts["gate"], parts["up"]], 0)
    for prefix, per_expert in experts.items():
        n = max(per_expert) + 1
        if sorted(per_expert) != list(range(n)) or any(len(p) != 3 for p in per_expert.values()):
            continue
        w13, w2 = [], []
        for e in range(n):
            parts = per_expert[e]
            up_gate = sorted((k for k in parts if k in _W13), key=_W13.__getitem__)
            w13.append(torch.cat([parts[k] for k in up_gate], 0))
            w2.append(parts["down_proj" if "down_proj" in parts else "w2"])
        out[f"{prefix}w13_weight"] = torch.stack(w13)
        out[f"{prefix}w2_weight"] = torch.stack(w2)
    return out
