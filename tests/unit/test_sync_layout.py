"""Packing HF tensors into SGLang's parameter layout (sglang_layout) and into send buckets (packing._pack)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.sync import bucketize
from megagrpo.sync.packing import _pack
from megagrpo.sync.sglang_layout import sglang_params, sglang_plan

H, INTER, E, Q, KV = 8, 6, 4, 8, 4


def _moe_layer(prefix: str = "model.layers.0", moe: str = "mlp", names=("gate_proj", "up_proj", "down_proj")):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    t = {
        f"{prefix}.self_attn.q_proj.weight": r(Q, H),
        f"{prefix}.self_attn.k_proj.weight": r(KV, H),
        f"{prefix}.self_attn.v_proj.weight": r(KV, H),
        f"{prefix}.self_attn.o_proj.weight": r(H, Q),
        f"{prefix}.input_layernorm.weight": r(H),
        f"{prefix}.{moe}.gate.weight": r(E, H),
    }
    gate, up, down = names
    for e in range(E):
        t[f"{prefix}.{moe}.experts.{e}.{gate}.weight"] = r(INTER, H)
        t[f"{prefix}.{moe}.experts.{e}.{up}.weight"] = r(INTER, H)
        t[f"{prefix}.{moe}.experts.{e}.{down}.weight"] = r(H, INTER)
    return t


@pytest.mark.parametrize(
    "moe,names", [("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2"))]
)
def test_sglang_params_match_reference_layout(moe, names):
    hf = _moe_layer(moe=moe, names=names)
    gate, up, down = names
    p = "model.layers.0"
    out = sglang_params(hf)
    assert torch.equal(
        out[f"{p}.self_attn.qkv_proj.weight"],
        torch.cat([hf[f"{p}.self_attn.{k}_proj.weight"] for k in "qkv"]),
    )
    w13 = torch.stack(
        [
            torch.cat([hf[f"{p}.{moe}.experts.{e}.{gate}.weight"], hf[f"{p}.{moe}.experts.{e}.{up}.weight"]])
            for e in range(E)
        ]
    )
    w2 = torch.stack([hf[f"{p}.{moe}.experts.{e}.{down}.weight"] for e in range(E)])
    assert out[f"{p}.{moe}.experts.w13_weight"].shape == (E, 2 * INTER, H)
    assert torch.equal(out[f"{p}.{moe}.experts.w13_weight"], w13)
    assert torch.equal(out[f"{p}.{moe}.experts.w2_weight"], w2)
    assert torch.equal(out[f"{p}.{moe}.gate.weight"], hf[f"{p}.{moe}.gate.weight"])
    assert len(out) == 6  # qkv, o, norm, gate, w13, w2


def test_incomplete_groups_stay_unfused():
    hf = _moe_layer()
    del hf["model.layers.0.self_attn.v_proj.weight"]
    del hf["model.layers.0.mlp.experts.2.down_proj.weight"]
    plan = sglang_plan({n: tuple(t.shape) for n, t in hf.items()})
    assert "model.layers.0.self_attn.qkv_proj.weight" not in plan
    assert "model.layers.0.mlp.experts.w13_weight" not in plan
    assert plan["model.layers.0.self_attn.q_proj.weight"].parts == ("model.layers.0.self_attn.q_proj.weight",)
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in plan
    covered = sorted(p for fp in plan.values() for p in fp.parts)
    assert covered == sorted(hf)  # nothing dropped


def _owner(hf):
    return {
        p: fp for fp in sglang_plan({n: tuple(t.shape) for n, t in hf.items()}).values() for p in fp.parts
    }


def test_pack_sends_each_fused_param_with_the_bucket_that_completes_it():
    hf = _moe_layer()
    buckets = list(bucketize(hf.items(), bucket_bytes=1024))  # splits the layer, so experts span buckets
    assert len(buckets) > 3
    packed = _pack(buckets, _owner(hf), torch.bfloat16)
    names = [n for b in packed for n, _ in b]
    assert len(names) == len(set(names)) == 6
    got = {n: t for b in packed for n, t in b}
    ref = sglang_params(hf)
    for n, t in got.items():
        assert t.dtype == torch.bfloat16 and t.is_shared()
        assert torch.equal(t, ref[n].to(torch.bfloat16))
    # each packed bucket only holds parameters whose last HF part was in the matching input bucket
    last_part = {fp.name: fp.parts[-1] for fp in _owner(hf).values()}
    seen_in = {n: i for i, b in enumerate(buckets) for n, _ in b}
    order = [max(seen_in[p] for p in _owner(hf)[last_part[n]].parts) for b in packed for n, _ in b]
    assert order == sorted(order)


def test_pack_names_the_hf_tensor_with_nan_or_out_of_range_values():
    hf = _moe_layer()
    bad = dict(hf)
    bad["model.layers.0.mlp.experts.3.up_proj.weight"] = hf[
        "model.layers.0.mlp.experts.3.up_proj.weight"
    ].clone()
    bad["model.layers.0.mlp.experts.3.up_proj.weight"][1, 2] = float("nan")
    with pytest.raises(MegagrpoError, match=r"experts\.3\.up_proj\.weight.*NaN or inf"):
        _pack([list(bad.items())], _owner(bad), torch.float32)
    big = dict(hf)
    big["model.layers.0.self_attn.k_proj.weight"] = (
        hf["model.layers.0.self_attn.k_proj.weight"].double() * 1e39
    )
    with pytest.raises(MegagrpoError, match=r"k_proj\.weight.*outside the range.*float32"):
        _pack([list(big.items())], _owner(big), torch.float32)


class _FakeEngine:
    """Records the weight-update calls of a GPU sync (the payload is SGLang's flattened bucket)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin_weight_update(self):
        self.calls.append("begin")
        return True, ""

    def update_weights_from_tensor(self, payload, load_format, flush_cache):
        self.calls.append(f"update:{load_format}:{int(flush_cache)}")
        return True, ""

    def end_weight_update(self):
        self.calls.append("end")
        return True, ""


def test_gpu_sync_streams_and_checks_each_bucket_before_it_is_sent():
    """`_sync_streamed` holds at most the bucket being checked and the one before it; a bad first bucket
    sends nothing, a bad later one says that the engine is partly updated."""
    import time

    from megagrpo.sync.checks import _Checker
    from megagrpo.sync.streaming import _sync_streamed

    tensors = [(f"w{i}", torch.full((4,), float(i))) for i in range(5)]
    shapes = {n: (4,) for n, _ in tensors}
    eng = _FakeEngine()
    events = []
    stats = _sync_streamed(
        eng,
        iter([[t] for t in tensors]),
        _Checker(shapes),
        1,
        False,
        lambda: events.append("resume"),
        time.perf_counter(),
    )
    assert events == ["resume"] and stats.buckets == 5 and stats.tensors == 5
    assert eng.calls == ["begin", *["update:flattened_bucket:0"] * 4, "update:flattened_bucket:1", "end"]

    bad = [(n, t.clone()) for n, t in tensors]
    bad[0][1][2] = float("nan")
    eng = _FakeEngine()
    with pytest.raises(MegagrpoError, match=r"tensor 'w0' holds NaN") as e:
        _sync_streamed(eng, iter([[t] for t in bad]), _Checker(shapes), 1, False, None, 0.0)
    assert eng.calls == [] and "partly" not in str(e.value)

    bad = [(n, t.clone()) for n, t in tensors]
    bad[3][1][0] = float("inf")
    eng = _FakeEngine()
    with pytest.raises(MegagrpoError, match=r"'w3' holds NaN or inf.*2 bucket\(s\) were already sent"):
        _sync_streamed(eng, iter([[t] for t in bad]), _Checker(shapes), 1, False, None, 0.0)
    assert eng.calls == ["begin", "update:flattened_bucket:0", "update:flattened_bucket:0", "end"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_exact_when_the_quick_sum_overflows(dtype):
    from megagrpo.sync.checks import all_finite

    big = torch.full((64,), torch.finfo(dtype).max / 2, dtype=dtype)  # finite; its sum is inf
    assert not torch.isfinite(big.sum()) and all_finite(big)
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(1000).to(dtype)
        t[17] = bad
        assert not all_finite(t), bad
    assert all_finite(torch.randn(1000).to(dtype)) and all_finite(torch.empty(0))
    assert all_finite(torch.tensor([1, 2], dtype=torch.int64))


def test_pack_stages_every_bucket_of_every_sync_in_one_shared_buffer():
    """Issue 29: one shared-memory file per engine, the same on every call and every sync, so that the
    scheduler maps it once (`load_packed`) instead of faulting 205 MB of fresh pages in on every sync."""
    from megagrpo.sync.staging import _Staging

    hf = _moe_layer()
    buckets = list(bucketize(hf.items(), bucket_bytes=1024))
    staging = _Staging()
    first = _pack(buckets, _owner(hf), torch.float32, staging)
    assert len(first) > 1
    second = _pack(buckets, _owner(hf), torch.float32, staging)  # the next sync: same file, same views
    assert len({t.untyped_storage().data_ptr() for b in first + second for _, t in b}) == 1
    assert [(n, t.data_ptr()) for b in second for n, t in b] == [
        (n, t.data_ptr()) for b in first for n, t in b
    ]
    ref = sglang_params(hf)
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for b in second for _, t in b)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two views overlap
    for n, t in (x for b in second for x in b):
        assert torch.equal(t, ref[n])


def test_load_packed_loads_like_direct_and_keeps_the_mapping_until_the_next_load():
    from torch.multiprocessing.reductions import StorageWeakRef

    from megagrpo.sync import staging

    model = torch.nn.Linear(4, 3)
    buf = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(64), 0, (64,))
    w, b = buf[:48].view(torch.float32).view(3, 4), buf[48:60].view(torch.float32)
    w.copy_(torch.arange(12.0).view(3, 4))
    b.copy_(torch.tensor([1.0, 2.0, 3.0]))
    staging.load_packed(model, [("weight", w), ("bias", b)])
    assert torch.equal(model.weight, torch.arange(12.0).view(3, 4)) and torch.equal(model.bias, b)
    held = StorageWeakRef(buf.untyped_storage())
    del buf, w, b
    assert not held.expired()  # the next sync's unpickling finds this mapping in torch's shared cache
    staging.load_packed(model, [("bias", torch.zeros(3))])
    assert held.expired() and torch.equal(model.bias, torch.zeros(3))


def test_cpu_engines_are_started_with_the_packed_loader_and_its_shape_probe(tmp_path):
    from types import SimpleNamespace

    from megagrpo.rollout import RolloutConfig, RolloutEngine
    from megagrpo.sync.shape_probe import SHAPES_PROBE
    from megagrpo.sync.staging import PACKED_LOADER, packed_load_format

    (tmp_path / "config.json").write_text("{}")
    engine = RolloutEngine(RolloutConfig(str(tmp_path), dtype="float32"))
    engine.on_cpu = True
    kw = engine.engine_kwargs()
    assert kw["custom_weight_loader"] == [PACKED_LOADER, SHAPES_PROBE]
    assert packed_load_format(SimpleNamespace(server_args=SimpleNamespace(**kw))) == PACKED_LOADER
    bare = SimpleNamespace(server_args=SimpleNamespace(custom_weight_loader=None))  # a bare sglang.Engine
    assert packed_load_format(bare) == "direct"


# What SGLang 0.5.23's CPU engine holds for layers 0 (dense) and 1 (MoE) of the tiny models, read from the
# engine (its check_weights names), for each family and q_lora_rank (issue 37, part 2).
_HELD_COMMON = [
    "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.input_layernorm.weight", "model.layers.1.mlp.experts.w13_weight",
    "model.layers.1.mlp.experts.w2_weight", "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.1.mlp.shared_experts.gate_up_proj.weight", "model.layers.1.post_attention_layernorm.weight",
]  # fmt: skip
_HELD_ATTN = {
    "deepseek_v3": [
        "fused_qkv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight",
        "q_a_layernorm.weight", "q_b_proj.weight",
    ],
    "deepseek_v3_q_null": [
        "kv_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight",
        "q_proj.weight",
    ],
    "glm4_moe": ["k_norm.weight", "o_proj.weight", "q_norm.weight", "qkv_proj.bias", "qkv_proj.weight"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_HELD_ATTN))
def test_the_families_fuse_as_sglang_holds_them(tiny_model, case):
    from megagrpo.sync.checks import checkpoint_shapes

    arch = case.removesuffix("_q_null")
    model = tiny_model(arch, **({"q_lora_rank": 0} if case.endswith("_q_null") else {}))
    shapes = checkpoint_shapes(str(model))
    plan = sglang_plan(shapes)
    held = _HELD_COMMON + [f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in _HELD_ATTN[case]]
    assert sorted(n for n in plan if n.startswith(("model.layers.0.", "model.layers.1."))) == sorted(held)
    assert sorted(p for fp in plan.values() for p in fp.parts) == sorted(shapes)  # nothing dropped
    if arch == "deepseek_v3" and case == arch:
        fused = plan["model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight"]
        assert fused.parts == (
            "model.layers.1.self_attn.q_a_proj.weight",
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        )
        assert fused.shape == (32 + 16 + 8, 64)  # q_lora_rank + kv_lora_rank + qk_rope_head_dim rows


def test_the_correction_bias_is_packed_in_fp32_in_a_bf16_engine():
    hf = _moe_layer()
    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    hf[bias] = torch.tensor([0.1234567, -0.0456789, 0.01, 0.3], dtype=torch.float32)
    got = {n: t for b in _pack([list(hf.items())], _owner(hf), torch.bfloat16) for n, t in b}
    assert got[bias].dtype == torch.float32 and torch.equal(got[bias], hf[bias])  # bf16 would round it
    assert got["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


def test_a_packed_load_derives_mla_tensors_again():
    """SGLang derives MLA's w_kc/w_vc from kv_b_proj after its own load (`post_load_weights`); the packed
    load copies parameters only, so it must ask for that too, for the layers it loaded."""
    from megagrpo.sync.staging import load_packed

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kv = torch.nn.Linear(2, 4, bias=False)
            self.o = torch.nn.Linear(2, 2, bias=False)
            self.derived: list[list[str]] = []

        def named_parameters(self, *a, **k):
            return iter([
                ("model.layers.3.self_attn.kv_b_proj.weight", self.kv.weight),
                ("model.layers.3.self_attn.o_proj.weight", self.o.weight),
            ])  # fmt: skip

        def post_load_weights(self, is_nextn=False, weight_names=None):
            self.derived.append(list(weight_names))

    m = Model()
    load_packed(m, [("model.layers.3.self_attn.o_proj.weight", torch.ones(2, 2))])
    assert m.derived == []  # nothing derived from o_proj
    load_packed(m, [("model.layers.3.self_attn.kv_b_proj.weight", torch.ones(4, 2))])
    assert m.derived == [["model.layers.3.self_attn.kv_b_proj.weight"]]
    assert torch.equal(m.kv.weight, torch.ones(4, 2))
