"""A CPU engine whose parameters depart from its checkpoint's shapes. SGLang's CPU MoE pads the expert
intermediate size (a tiny Qwen3-MoE with moe_intermediate_size 20 holds w13_weight (8, 64, 80) where the
learner packs (8, 40, 80)): the packed sync asks the engine its shapes before packing and lays each
parameter out zero-padded, as SGLang's own loader does (issue 37). A shape that is no padding stops the
sync with an error naming the parameter and both shapes, before anything is sent (issue 36, item 9).
Before, `load_packed` raised inside SGLang's scheduler, which died and SIGQUIT the trainer (exit 137).

The fake engine runs the scheduler's side in this process: the custom loaders `sync.staging` and `sync.shape_probe` name, on a
model with SGLang's parameter names."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from megagrpo.errors import MegagrpoError
from megagrpo.sync import bucketize, checksums, shape_probe, staging, sync_weights
from megagrpo.sync.sglang_layout import sglang_params, sglang_plan
from tests.unit.test_sync_layout import INTER, E, H, _moe_layer

PAD = 8  # the padded intermediate size (INTER = 6 in the checkpoint)


class _Model:
    def __init__(self, shapes):
        self.params = {n: torch.nn.Parameter(torch.zeros(s), requires_grad=False) for n, s in shapes.items()}

    def named_parameters(self):
        return iter(self.params.items())


class _Engine:
    """The parts of `sglang.Engine` the packed sync uses; a loader that raises is the scheduler dying."""

    def __init__(self, model_dir, params):
        self.model = _Model(params)
        self.calls: list[str] = []
        self.server_args = SimpleNamespace(
            model_path=str(model_dir),
            tp_size=1,
            custom_weight_loader=[staging.PACKED_LOADER, shape_probe.SHAPES_PROBE],
        )
        self.tokenizer_manager = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    def begin_weight_update(self):
        self.calls.append("begin")
        return True, ""

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        loader = {
            staging.PACKED_LOADER: staging.load_packed,
            shape_probe.SHAPES_PROBE: shape_probe.report_shape_mismatches,
        }[load_format]
        self.calls.append("probe" if loader is shape_probe.report_shape_mismatches else "load")
        try:
            loader(self.model, named)
        except Exception as e:  # noqa: BLE001 - what the scheduler does: it dies
            raise RuntimeError(f"the scheduler died: {e}") from None
        return True, ""

    def end_weight_update(self):
        self.calls.append("end")
        return True, ""


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    # The engine's parameter names (SGLang's checksum pass; importing SGLang for it costs minutes here).
    monkeypatch.setattr(
        checksums,
        "engine_checksums",
        lambda eng: {n: checksums._hash(p) for n, p in eng.model.params.items()},
    )
    tensors = {n: t.contiguous() for n, t in _moe_layer().items()}
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path, list(tensors.items())


def _engine_params(tensors, pad: bool):
    plan = sglang_plan({n: tuple(t.shape) for n, t in tensors})
    shapes = {fp.name: fp.shape for fp in plan.values()}
    if pad:
        for name, shape in shapes.items():
            if name.endswith("w13_weight"):
                shapes[name] = (shape[0], 2 * PAD, shape[2])
            elif name.endswith("w2_weight"):
                shapes[name] = (shape[0], shape[1], PAD)
    return shapes


def _moe(x, w13, w2):
    """One expert's SwiGLU MLP for every expert, as SGLang's fused MoE computes it: [E, T, H]."""
    gate, up = w13.chunk(2, dim=1)
    return torch.einsum(
        "eih,eti->eth", w2.transpose(1, 2), torch.nn.functional.silu(x @ gate.mT) * (x @ up.mT)
    )


def test_a_padded_engine_gets_each_part_in_a_zeroed_slot_and_computes_the_same(checkpoint):
    """Issue 37: the engine's parameters are zero-padded where SGLang pads (the parts at the start of
    their slots), even over garbage (a resumed memory-saver region), and its experts compute what the
    checkpoint's do. Before: the packed sync refused the engine (sync.pack=false was the way out)."""
    model_dir, tensors = checkpoint
    eng = _Engine(model_dir, _engine_params(tensors, pad=True))
    for p in eng.model.params.values():
        p.data.fill_(float("nan"))
    stats = sync_weights(eng, bucketize(tensors, bucket_bytes=256))
    assert stats.packed
    assert eng.calls[:3] == ["begin", "probe", "end"]  # asked before packing, in a session of its own
    assert eng.calls[3] == "begin" and set(eng.calls[4:-1]) == {"load"} and eng.calls[-1] == "end"
    hf = dict(tensors)
    p = "model.layers.0.mlp.experts"
    w13, w2 = eng.model.params[f"{p}.w13_weight"], eng.model.params[f"{p}.w2_weight"]
    zeros = torch.zeros(PAD - INTER, H)
    for e in range(E):  # [g_e; 0; u_e; 0] and [d_e, 0], built part by part
        want = torch.cat([hf[f"{p}.{e}.gate_proj.weight"], zeros, hf[f"{p}.{e}.up_proj.weight"], zeros])
        assert torch.equal(w13[e], want)
        assert torch.equal(w2[e], torch.cat([hf[f"{p}.{e}.down_proj.weight"], zeros.T], dim=1))
    unpadded = sglang_params(hf)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(
        _moe(x, w13, w2),
        _moe(x, unpadded[f"{p}.w13_weight"], unpadded[f"{p}.w2_weight"]),
        atol=1e-5,
        rtol=1e-5,
    )
    q = eng.model.params["model.layers.0.self_attn.qkv_proj.weight"]  # unpadded parameters as before
    assert torch.equal(q, unpadded["model.layers.0.self_attn.qkv_proj.weight"])
    eng.calls.clear()
    assert checksums.verify_checksum(
        eng, [tensors]
    )  # the checksum lays the sent tensors out as the engine holds them
    assert eng.calls == []  # the engine's shapes are fixed for its lifetime: asked once
    hf[f"{p}.3.up_proj.weight"] = hf[f"{p}.3.up_proj.weight"] + 1
    assert not checksums.verify_checksum(eng, [list(hf.items())])  # and it can fail


def test_a_shape_that_is_no_padding_is_named_before_anything_is_sent(checkpoint):
    model_dir, tensors = checkpoint
    params = _engine_params(tensors, pad=False)
    params["model.layers.0.mlp.experts.w13_weight"] = (E, 2 * INTER - 2, H)  # smaller: no padding
    eng = _Engine(model_dir, params)
    with pytest.raises(MegagrpoError) as e:
        sync_weights(eng, bucketize(tensors, bucket_bytes=256))
    msg = str(e.value)
    assert msg.startswith(
        "weight sync: the engine's parameter 'model.layers.0.mlp.experts.w13_weight': the learner's export "
        "packs (4, 12, 8), the engine holds (4, 10, 8), which is no zero-padding of it (1 parameter(s) "
        "differ; nothing was sent"
    )
    assert "sync.pack=false" in msg
    assert eng.calls == ["begin", "probe", "end"]  # no weight sent, the session closed
    assert all(not p.any() for p in eng.model.params.values())


def test_an_engine_holding_the_checkpoints_shapes_is_asked_once(checkpoint):
    model_dir, tensors = checkpoint
    eng = _Engine(model_dir, _engine_params(tensors, pad=False))
    stats = sync_weights(eng, bucketize(tensors, bucket_bytes=256))
    assert stats.packed and eng.calls[:4] == ["begin", "probe", "end", "begin"] and eng.calls[-1] == "end"
    assert set(eng.calls[4:-1]) == {"load"}
    q = eng.model.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(q[: tensors[0][1].shape[0]], tensors[0][1])
    eng.calls.clear()
    sync_weights(eng, bucketize(tensors, bucket_bytes=256))
    assert "probe" not in eng.calls  # the engine's shapes are fixed for its lifetime


class _DyingEngine(_Engine):
    """Its scheduler dies while loading a bucket: SGLang's scheduler SIGQUITs its parent, this process, and
    the reply the sync waits for never comes."""

    def __init__(self, model_dir, params):
        super().__init__(model_dir, params)
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager._subprocess_watchdog = None

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        if load_format == shape_probe.SHAPES_PROBE:
            return super().update_weights_from_tensor(named, load_format, flush_cache)
        self.calls.append("load")
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGQUIT)).start()
        self.loop.run_until_complete(asyncio.sleep(60))  # a reply that never comes
        raise AssertionError("the SIGQUIT did not interrupt the wait")


@pytest.fixture
def sigquit():
    before = signal.getsignal(signal.SIGQUIT)
    yield
    signal.signal(signal.SIGQUIT, before)


def test_a_scheduler_that_dies_mid_sync_is_an_error_naming_the_engine_and_its_tensors(checkpoint, sigquit):
    """The safety net under the shape probe: any failure of the engine's loader (before, SGLang's SIGQUIT
    handler killed the trainer's whole process tree: exit 137, no checkpoint, no line naming anything)."""
    from megagrpo.rollout import RolloutConfig, RolloutEngine
    from megagrpo.rollout.engines.engine import EngineFailed

    model_dir, tensors = checkpoint
    (model_dir / "config.json").write_text("{}")
    engine = RolloutEngine(RolloutConfig(str(model_dir), dtype="float32"))
    engine._engine = fake = _DyingEngine(model_dir, _engine_params(tensors, pad=False))
    child = subprocess.Popen(["sleep", "60"])  # stands for the engine's scheduler and detokenizer
    engine._child_pids = [child.pid]
    engine._catch_child_failure()
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as e:
        sync_weights(engine, bucketize(tensors, bucket_bytes=256))
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert msg.startswith(
        f"weight sync: the SGLang engine serving {model_dir} stopped: one of its processes failed"
    )
    assert "It failed loading bucket 1 of " in msg and "model.layers.0." in msg and "partly updated" in msg
    # the probe's own session, then no end_weight_update: it would wait forever
    assert fake.calls == ["begin", "probe", "end", "begin", "load"]
    assert child.poll() is not None  # the engine's own processes are stopped (reaped there: no status here)
    with pytest.raises(EngineFailed, match="stopped: one of its processes failed"):
        engine.release(["kv_cache"])  # every later use fails at once
    fake.loop.close()
