"""SGLang's padded parameter shapes (issue 37), the layout math of `sync.sglang_layout` against references
built part by part, and the GPU IPC path against SGLang's per-shard padding.

SGLang's CPU engine rounds every MLP intermediate size up to `tp_size * 32` (20 -> 32 here, no multiple of
32 on purpose) and puts each HF part at the start of a zeroed slot; GPU MoE kernels round each TP shard
(GLM-4.5's 1408 over TP 8 is 176 a shard; flashinfer_trtllm rounds it to 256)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.sync.sglang_layout import (
    FusedParam,
    fuse_into,
    laid_out,
    padded_mlp_shapes,
    sglang_params,
    sglang_plan,
)

H, INTER, PADDED, E, V = 16, 20, 32, 3, 50


def _hf(moe: str = "mlp", names=("gate_proj", "up_proj", "down_proj"), dense: bool = True):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)

    gate, up, down = names
    p = "model.layers.0"
    t = {
        "model.embed_tokens.weight": r(V, H),
        f"{p}.self_attn.q_proj.weight": r(H, H),
        f"{p}.self_attn.k_proj.weight": r(H // 2, H),
        f"{p}.self_attn.v_proj.weight": r(H // 2, H),
    }
    for e in range(E):
        t[f"{p}.{moe}.experts.{e}.{gate}.weight"] = r(INTER, H)
        t[f"{p}.{moe}.experts.{e}.{up}.weight"] = r(INTER, H)
        t[f"{p}.{moe}.experts.{e}.{down}.weight"] = r(H, INTER)
    if dense:  # a dense MLP layer (Qwen3-MoE's mlp_only_layers, DeepSeek-V3's first layers)
        t["model.layers.1.mlp.gate_proj.weight"] = r(INTER, H)
        t["model.layers.1.mlp.up_proj.weight"] = r(INTER, H)
        t["model.layers.1.mlp.down_proj.weight"] = r(H, INTER)
    return t


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` with zero rows appended up to n."""
    return torch.cat([t, torch.zeros(n - t.shape[0], *t.shape[1:])])


def _held(hf) -> dict[str, tuple[int, ...]]:
    return {fp.name: fp.shape for fp in sglang_plan(padded_mlp_shapes(_shapes(hf), 32)).values()}


def _shapes(hf):
    return {n: tuple(t.shape) for n, t in hf.items()}


def test_the_cpu_engines_shapes_pad_every_mlp_intermediate_size_and_nothing_else():
    hf = _hf()
    held = _held(hf)
    p = "model.layers.0.mlp.experts"
    assert held[f"{p}.w13_weight"] == (E, 2 * PADDED, H) and held[f"{p}.w2_weight"] == (E, H, PADDED)
    assert held["model.layers.1.mlp.gate_up_proj.weight"] == (2 * PADDED, H)
    assert held["model.layers.1.mlp.down_proj.weight"] == (H, PADDED)
    assert held["model.layers.0.self_attn.qkv_proj.weight"] == (2 * H, H)
    assert held["model.embed_tokens.weight"] == (V, H)
    # GLM-4.5's 1408 is 44 x 32: a CPU engine at TP 1 keeps it, at TP 8 (multiple 256) holds 1536
    glm = {"m.experts.0.gate_proj.weight": (1408, 5120), "m.experts.0.down_proj.weight": (5120, 1408)}
    assert padded_mlp_shapes(glm, 32) == glm
    assert padded_mlp_shapes(glm, 8 * 32) == {
        "m.experts.0.gate_proj.weight": (1536, 5120),
        "m.experts.0.down_proj.weight": (5120, 1536),
    }


@pytest.mark.parametrize(
    "moe,names", [("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2"))]
)
def test_each_part_sits_at_the_start_of_a_zeroed_slot_as_sglangs_loader_leaves_it(moe, names):
    hf = _hf(moe, names, dense=moe == "mlp")
    gate, up, down = names
    out = sglang_params(hf, _held(hf))
    p = f"model.layers.0.{moe}.experts"
    for e in range(E):  # w13: [g_e; 0; u_e; 0], each in an [PADDED, H] slot; w2: [d_e, 0]
        want = torch.cat(
            [_rows(hf[f"{p}.{e}.{gate}.weight"], PADDED), _rows(hf[f"{p}.{e}.{up}.weight"], PADDED)]
        )
        assert torch.equal(out[f"{p}.w13_weight"][e], want)
        assert torch.equal(out[f"{p}.w2_weight"][e], _rows(hf[f"{p}.{e}.{down}.weight"].T, PADDED).T)
    if moe == "mlp":
        d = "model.layers.1.mlp"
        want = torch.cat(
            [_rows(hf[f"{d}.gate_proj.weight"], PADDED), _rows(hf[f"{d}.up_proj.weight"], PADDED)]
        )
        assert torch.equal(out[f"{d}.gate_up_proj.weight"], want)
        assert torch.equal(out[f"{d}.down_proj.weight"], _rows(hf[f"{d}.down_proj.weight"].T, PADDED).T)
    unpadded = sglang_params(hf)
    q = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(out[q], unpadded[q])


def _swiglu(x, gate_up, down):
    gate, up = gate_up.chunk(2, dim=0)
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_zero_padded_experts_compute_what_the_checkpoints_do():
    hf = _hf()
    padded, unpadded = sglang_params(hf, _held(hf)), sglang_params(hf)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    for name_13, name_2 in [
        ("model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"),
        ("model.layers.1.mlp.gate_up_proj.weight", "model.layers.1.mlp.down_proj.weight"),
    ]:
        a, b = padded[name_13], padded[name_2]
        c, d = unpadded[name_13], unpadded[name_2]
        if a.dim() == 2:
            a, b, c, d = a[None], b[None], c[None], d[None]
        for e in range(a.shape[0]):
            assert torch.allclose(_swiglu(x, a[e], b[e]), _swiglu(x, c[e], d[e]), atol=1e-5, rtol=1e-5)


def test_fuse_into_overwrites_every_padded_slot_and_casts():
    """A resumed memory-saver region holds garbage until written: the tails are written too."""
    hf = _hf()
    plan = sglang_plan(_shapes(hf))
    fp = laid_out(plan["model.layers.0.mlp.experts.w13_weight"], (E, 2 * PADDED, H), _shapes(hf))
    assert fp.slot == (PADDED, H) and fp.shape == (E, 2 * PADDED, H)
    out = torch.full(fp.shape, float("nan"), dtype=torch.bfloat16)
    fuse_into(out, [hf[p] for p in fp.parts], fp.slot)
    ref = sglang_params(hf, _held(hf))["model.layers.0.mlp.experts.w13_weight"]
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_shapes_that_are_no_padding_are_not_laid_out():
    hf = _hf()
    shapes = _shapes(hf)
    plan = sglang_plan(shapes)
    w13, w2 = plan["model.layers.0.mlp.experts.w13_weight"], plan["model.layers.0.mlp.experts.w2_weight"]
    qkv = plan["model.layers.0.self_attn.qkv_proj.weight"]
    assert laid_out(w13, w13.shape, shapes) is w13  # the checkpoint's shape: unchanged, no slot
    assert laid_out(w13, (E, 2 * INTER - 2, H), shapes) is None  # smaller
    assert laid_out(w13, (E + 1, 2 * PADDED, H), shapes) is None  # another number of experts
    assert laid_out(w13, (E, 2 * PADDED + 1, H), shapes) is None  # gate and up slots of unequal size
    assert laid_out(w13, (E, 2 * PADDED, H, 1), shapes) is None
    assert laid_out(w2, (E, H + 1, PADDED), shapes).slot == (
        H + 1,
        PADDED,
    )  # a padding on any dim of the part
    assert laid_out(qkv, (3 * H, H), shapes) is None  # parts of unequal shapes: no slot to grow
    embed = plan["model.embed_tokens.weight"]
    assert laid_out(embed, (64, H), shapes) == FusedParam(embed.name, embed.parts, (64, H), (64, H))


# ---------------------------------------------------------------- the GPU IPC path, TP 2


class _PaddedShardEngine:
    """A GPU engine at TP 2 whose MoE kernel rounds each shard of the intermediate size (SGLang 0.5.23,
    `FusedMoE._load_w13` / `_load_w2`). `update_weights_from_tensor` takes the flattened bucket of each
    TP rank (CUDA-IPC handles on a GPU) and loads the HF-named tensors as SGLang's `load_weights` does:
    - `global_pad` (flashinfer_trtllm, `use_padded_loading`): shard r of size S (the padded shard) reads
      HF rows [r*S, r*S + S) clipped to I (`narrow_padded_param_and_loaded_weight`), tail zeroed;
    - otherwise (a padded buffer, e.g. MXFP4): shard r reads rows [r*I/tp, (r+1)*I/tp) into the start of
      its S rows and zeroes the tail."""

    def __init__(self, shard: int, tp: int, global_pad: bool):
        self.tp, self.shard, self.global_pad = tp, shard, global_pad
        nan = float("nan")  # a fresh (or resumed) region: garbage until loaded
        self.w13 = [torch.full((E, 2 * shard, H), nan) for _ in range(tp)]
        self.w2 = [torch.full((E, H, shard), nan) for _ in range(tp)]
        self.formats: list[str] = []

    def begin_weight_update(self):
        return True, ""

    def end_weight_update(self):
        return True, ""

    def _rows(self, t: torch.Tensor, r: int, dim: int) -> torch.Tensor:
        size = t.shape[dim]
        start, n = (r * self.shard, self.shard) if self.global_pad else (r * size // self.tp, size // self.tp)
        n = max(0, min(n, size - start))
        return t.narrow(dim, min(start, size), n)

    def update_weights_from_tensor(self, payload, load_format, flush_cache):
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        self.formats.append(load_format)
        for r in range(self.tp):
            got = MultiprocessingSerializer.deserialize(payload[r])
            flat = FlattenedTensorBucket(flattened_tensor=got["flattened_tensor"], metadata=got["metadata"])
            for name, t in flat.reconstruct_tensors():
                e, kind = int(name.split(".")[-3]), name.split(".")[-2]
                if kind == "down_proj":
                    dst, part = self.w2[r][e], self._rows(t, r, 1)
                    dst.narrow(1, part.shape[1], self.shard - part.shape[1]).zero_()
                    dst.narrow(1, 0, part.shape[1]).copy_(part)
                else:
                    dst = self.w13[r][e].narrow(0, 0 if kind == "gate_proj" else self.shard, self.shard)
                    part = self._rows(t, r, 0)
                    dst.narrow(0, part.shape[0], self.shard - part.shape[0]).zero_()
                    dst.narrow(0, 0, part.shape[0]).copy_(part)
        return True, ""


@pytest.mark.parametrize("global_pad", [True, False], ids=["flashinfer_trtllm", "padded_buffer"])
def test_the_ipc_path_sends_hf_tensors_that_sglang_lays_into_padded_shards_exactly(global_pad):
    """The GPU transport sends every TP rank the full HF tensors (one flattened bucket, `IpcTransport`),
    and SGLang's loader shards and pads them; megagrpo neither shards nor pads there, so the per-rank
    cost stays one bucket of the checkpoint's bytes. I = 20 over TP 2 is 10 a shard, padded to 16: the
    sum of the shards' outputs equals the checkpoint's experts."""
    import time

    from megagrpo.sync.checks import _Checker
    from megagrpo.sync.streaming import _sync_streamed

    hf = {n: t for n, t in _hf(dense=False).items() if ".experts." in n}
    eng = _PaddedShardEngine(shard=16, tp=2, global_pad=global_pad)
    stats = _sync_streamed(
        eng, iter([list(hf.items())]), _Checker(_shapes(hf)), 2, False, None, time.perf_counter()
    )
    assert stats.tensors == len(hf) and eng.formats == ["flattened_bucket"]
    ref = sglang_params(hf)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    for e in range(E):
        want = _swiglu(
            x, ref["model.layers.0.mlp.experts.w13_weight"][e], ref["model.layers.0.mlp.experts.w2_weight"][e]
        )
        got = sum(_swiglu(x, eng.w13[r][e], eng.w2[r][e]) for r in range(2))
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        for r in range(2):  # every padded row and column holds zero, none the garbage it started with
            assert torch.isfinite(eng.w13[r][e]).all() and torch.isfinite(eng.w2[r][e]).all()


# ---------------------------------------------------------------- the disaggregated engine's checksum


class _Remote:
    """A disaggregated engine at TP 1 as `verify_remote` sees it over HTTP: its device and its hashes."""

    def __init__(self, device: str, params: dict[str, torch.Tensor]):
        from megagrpo.sync.checksums import _hash

        self.device, self.name = device, "engine 0"
        self.cfg = type("Cfg", (), {"tp_size": 1})()
        self.checksums = {n: _hash(t) for n, t in params.items()}

    def get(self, path):
        assert path == "/server_info"
        return {"device": self.device, "tp_size": 1}

    def call(self, path, body):
        assert path == "/weights_checker" and body == {"action": "checksum"}
        return {"success": True, "ranks": [{"checksums": self.checksums}]}


def test_a_cpu_engines_checksum_lays_the_sent_tensors_out_as_it_pads_them():
    """The broadcast's checksum (issue 37): a CPU engine holds every MLP intermediate size padded to 32
    (its shapes cannot be asked over HTTP, so SGLang's rule is applied), a GPU engine at TP 1 the
    checkpoint's. Before, the CPU engine's padded experts never matched: checksum_ok was False."""
    from megagrpo.sync.broadcast import verify_remote

    hf = _hf()
    sent = [list(hf.items())]
    cpu = _Remote("cpu", sglang_params(hf, _held(hf)))
    assert verify_remote(cpu, sent)
    changed = dict(
        hf, **{"model.layers.1.mlp.down_proj.weight": hf["model.layers.1.mlp.down_proj.weight"] + 1}
    )
    assert not verify_remote(cpu, [list(changed.items())])  # and it can fail
    assert verify_remote(_Remote("cuda", sglang_params(hf)), sent)
