"""The disaggregated weight path without learners: one engine server (`engine_server`, SGLang's HTTP server
in a subprocess, tiny Qwen3-MoE, fp32 on the CPU), fed over its gloo weights group by this process through
`sync.broadcast` with the checkpoint's own tensors. The model's moe_intermediate_size is 20, which the
CPU engine pads to 32: SGLang's loader lays the broadcast HF tensors into the padded parameters, and the
checksum lays them out as the engine holds them (issue 37).

- a NaN in the first bucket is refused, naming the tensor, before anything reaches the engine: it still
  hashes like the checkpoint and generates the same greedy ids;
- perturbed weights arrive (the checksum holds, the checkpoint's hashes no longer match, generation changes
  and equals transformers' greedy generation with the perturbed weights);
- a bucket that breaks its checks after a first one was sent names the engine and says it is partly updated;
- a sync of many buckets in the two reused send buffers (each sent while the next is copied) arrives bit
  for bit, without the checksum's buffer per bucket;
- a bucket that the engine fails to load while the owner copies the next is reported by the next send,
  naming the engine, the bucket and that it is partly updated;
- an engine of tp_size 2 over two "nodes" of one rank each (`engine_server(nnodes=2)`: megagrpo's own
  multi-node start, node 0 publishing `dist_init_addr` in the store, node 1 joining it; SGLang's TP group
  over gloo, `compat.sglang_cpu`) samples the greedy ids, logprobs (fp32 round-off) and routed experts of
  the one-rank engine, before and after perturbed weights are broadcast to both (the TP2 engine's group
  has 3 ranks, and both of its shards load them); its checksum is refused by name (TP 1 only);
- the server listens on its advertised address only and refuses every request without the launch's key;
- the server exits 0 when the store says stop, and leaves no SGLang process behind.

One server start for the module (20 s of the 33 s the module takes here), and one of the engine over two
nodes, with its two tests (+66 s: 64 s without them, 131 s with them, run side by side on a shared host); tests that change the weights put
the checkpoint back.
"""

from __future__ import annotations

import dataclasses
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import SamplingConfig
from megagrpo.sync.buckets import NamedTensor, bucketize
from tests.integration.engine_server import EngineServer, engine_server, rollout_config

TIMEOUT_S = 600.0
GREEDY = SamplingConfig(temperature=0, max_new_tokens=8, seed=0)
PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202]]
SMALL_BUCKET = 64 << 10  # many buckets: 18 for this model
# The same weights give the same greedy ids, and logprobs equal up to fp32 round-off: a repeated prompt is
# served from the prefix cache, whose prefill ran in another batch shape.
ROUND_OFF = 1e-5
MOE_INTERMEDIATE = 20  # no multiple of 32: the CPU engine pads it to 32


@dataclasses.dataclass
class Served:
    server: EngineServer
    engine: object  # RemoteEngine
    transport: object  # BroadcastTransport
    original: list[NamedTensor]
    ids: list[list[int]]  # greedy ids of PROMPTS under the checkpoint's weights
    logprobs: list[torch.Tensor]


def _greedy(engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    groups = engine.generate(PROMPTS, GREEDY)
    done = [c for g in groups for c in g]
    return [c.output_ids.tolist() for c in done], [c.logprobs for c in done]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)  # BroadcastTransport imports sglang.srt
    from megagrpo.rollout.engines.remote import RemoteEngine
    from megagrpo.sync.broadcast import BroadcastTransport
    from megagrpo.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("weights_broadcast")
    model = make_tiny_model(tmp / "model", "qwen3_moe", seed=1, moe_intermediate=MOE_INTERMEDIATE)
    original = list(load_file(model / "model.safetensors").items())
    t0 = time.monotonic()
    with engine_server(model, tmp / "server.log", timeout_s=TIMEOUT_S) as server:
        print(f"engine server up in {time.monotonic() - t0:.1f} s at {server.url}")
        engine = RemoteEngine(
            rollout_config(model), index=0, url=server.url, where=server.where, key=server.key,
            timeout_s=TIMEOUT_S,
        ).start()  # fmt: skip
        transport = BroadcastTransport(engine, timeout_s=TIMEOUT_S)
        try:
            yield Served(server, engine, transport, original, *_greedy(engine))
        finally:
            transport.close()
            engine.shutdown()


@pytest.fixture
def restore(served):
    """Put the checkpoint's weights back after a test that changed them."""
    from megagrpo.sync.broadcast import sync_remote, verify_remote

    yield
    sync_remote(served.transport, bucketize(served.original))
    assert verify_remote(served.engine, [served.original])


def _moved(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _perturbed(tensors: list[NamedTensor], seed: int = 0) -> list[NamedTensor]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 1e-3 * torch.randn(t.shape, generator=g, dtype=t.dtype)) for n, t in tensors]


def test_a_nan_in_the_first_bucket_is_refused_before_any_write(served, tmp_path):
    from megagrpo.sync.broadcast import sync_remote, verify_remote

    buckets = list(bucketize(served.original, SMALL_BUCKET))
    name, t = buckets[0][0]
    bad = t.clone()
    bad.view(-1)[7] = float("nan")
    buckets[0][0] = (name, bad)
    with pytest.raises(MegagrpoError, match=name.replace(".", r"\.")):
        sync_remote(served.transport, buckets)
    assert verify_remote(served.engine, [served.original])
    ids, logprobs = _greedy(served.engine)
    assert ids == served.ids
    assert _moved(logprobs, served.logprobs) < ROUND_OFF
    assert ids == _hf_greedy(served.engine.cfg.model_path, served.original, tmp_path)  # padded, yet exact


def test_perturbed_weights_arrive_over_gloo_and_the_checksum_tells_them_apart(served, restore, tmp_path):
    from megagrpo.sync.broadcast import sync_remote, verify_remote

    perturbed = _perturbed(served.original)
    stats = sync_remote(served.transport, bucketize(perturbed, SMALL_BUCKET), checksum=True)
    assert served.transport.group is not None and served.transport.group_name == "megagrpo-weights-0"
    assert stats.checksum_ok is True and stats.buckets > 2 and stats.tensors == len(perturbed)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in perturbed)
    assert verify_remote(served.engine, [perturbed])
    assert not verify_remote(served.engine, [served.original])  # the checksum can fail
    ids, logprobs = _greedy(served.engine)
    moved = _moved(logprobs, served.logprobs)
    print(f"perturbed weights: greedy ids changed: {ids != served.ids}, max |logprob change| {moved:.2e}")
    assert ids != served.ids or moved > 100 * ROUND_OFF, moved
    assert ids == _hf_greedy(
        served.engine.cfg.model_path, perturbed, tmp_path
    )  # zero-padded: logits unchanged


def _hf_greedy(model_dir, tensors: list[NamedTensor], tmp) -> list[list[int]]:
    """transformers' greedy ids for PROMPTS with `tensors` (checkpoint names) in place of the model's."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
    save_file(dict(tensors), tmp / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=GREEDY.max_new_tokens)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]


def test_a_bucket_broken_after_a_send_names_the_partly_updated_engine(served, restore):
    from megagrpo.sync.broadcast import sync_remote, verify_remote

    buckets = list(bucketize(_perturbed(served.original, seed=1), SMALL_BUCKET))
    # Bucket N is sent once N + 1 has passed its checks, so a broken second bucket would still be caught
    # before any send: the third is the first whose failure finds one bucket on the engine.
    assert len(buckets) >= 3
    name, t = buckets[2][0]
    buckets[2][0] = (name, t.reshape(1, -1))
    with pytest.raises(MegagrpoError) as err:
        sync_remote(served.transport, buckets)  # no announcement: the shapes are checked bucket by bucket
    message = str(err.value)
    assert "engine 0" in message and "partly updated" in message, message
    assert name in message and "1 bucket(s) were already sent" in message, message
    assert not verify_remote(served.engine, [served.original])  # the first bucket did arrive


def test_many_buckets_in_the_reused_send_buffers_arrive_bit_for_bit(served, restore):
    from megagrpo.sync.broadcast import sync_remote, verify_remote

    perturbed = _perturbed(served.original, seed=2)
    stats = sync_remote(served.transport, bucketize(perturbed, SMALL_BUCKET))  # no checksum: no fresh buffers
    assert stats.buckets >= 3 and stats.checksum_ok is None
    # a bucket overwritten in flight by the next one's copy would arrive with the next one's bytes
    assert verify_remote(served.engine, [perturbed])
    assert not verify_remote(served.engine, [served.original])


def test_a_bucket_the_engine_fails_to_load_is_reported_by_the_next_send(served, restore):
    t = served.transport
    buckets = list(bucketize(served.original, SMALL_BUCKET))
    name, norm = next((n, x) for n, x in served.original if n == "model.norm.weight")
    wrong = [(name, torch.ones(2 * norm.numel()))]  # the receive takes it, SGLang's load refuses its shape
    t.begin()
    try:
        t.send(t.flatten(buckets[0], torch.float32), last=False)
        t.send(t.flatten(wrong, torch.float32), last=False)  # returns while the engine receives and loads
        with pytest.raises(MegagrpoError) as err:
            t.send(t.flatten(buckets[1], torch.float32), last=False)
    finally:
        t.end()
    message = str(err.value)
    assert "engine 0" in message and "partly updated" in message, message
    assert "bucket 2 of this sync" in message and "Failed to update parameter online" in message, message


def test_only_this_launch_drives_the_engine(served):
    """Issue 36, item 7: the server listens on its advertised address only, and refuses every request
    without the launch's key: generation, information and, above all, its weights (SGLang's api_key and
    admin_api_key); only the health probe answers."""
    from urllib.parse import urlsplit

    from megagrpo.rollout.engines.remote import EngineUnreachable, RemoteEngine

    where = urlsplit(served.server.url)
    listening = {
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == where.port
    }
    assert listening == {where.hostname}, listening  # not 0.0.0.0
    cfg = rollout_config(served.engine.cfg.model_path)
    for key in (None, "not-the-launch-key"):
        stranger = RemoteEngine(
            cfg, index=0, url=served.server.url, where="a stranger", key=key, timeout_s=60
        )
        asked = [
            ("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1}}),
            ("/server_info", None),
            ("/weights_checker", {"action": "checksum"}),
            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                            "world_size": 2, "group_name": "stranger", "backend": "gloo"}),
            ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "group_name": "x"}),
        ]  # fmt: skip
        for path, body in asked:
            with pytest.raises(EngineUnreachable, match=rf"{path} failed with HTTP 401.*not this launch's"):
                stranger.call(path, body, method="GET" if body is None else "POST")
        assert stranger.get("/health") is None  # SGLang's probes stay open
    ids, _ = _greedy(served.engine)  # the launch's own client, with its key, still drives it
    assert ids == served.ids


@dataclasses.dataclass
class OverNodes:
    server: EngineServer
    engine: object  # RemoteEngine, engine 1: its weights group is megagrpo-weights-1
    transport: object  # BroadcastTransport


@pytest.fixture(scope="module")
def over_nodes(served, tmp_path_factory):
    """The same checkpoint on an engine of tp_size 2 over two nodes of one rank each (module doc)."""
    from megagrpo.rollout.engines.remote import RemoteEngine
    from megagrpo.sync.broadcast import BroadcastTransport

    model = served.engine.cfg.model_path
    t0 = time.monotonic()
    log = tmp_path_factory.mktemp("over_nodes") / "server.log"
    with engine_server(model, log, timeout_s=TIMEOUT_S, nnodes=2) as server:
        print(f"engine over 2 nodes up in {time.monotonic() - t0:.1f} s at {server.url}")
        engine = RemoteEngine(
            rollout_config(model, tp_size=2), index=1, url=server.url, where=server.where, key=server.key,
            timeout_s=TIMEOUT_S,
        ).start()  # fmt: skip
        transport = BroadcastTransport(engine, timeout_s=TIMEOUT_S)
        try:
            yield OverNodes(server, engine, transport)
        finally:
            transport.close()
            engine.shutdown()
            assert server.stop() == 0, server.tail()


def _greedy_routes(engine) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    done = [c for g in engine.generate(PROMPTS, GREEDY) for c in g]
    return [c.output_ids.tolist() for c in done], [c.logprobs for c in done], [c.routes for c in done]


def _same_sampling(one, two) -> None:
    """Engines `one` (TP 1) and `two` (TP 2 over two nodes) sample alike: greedy ids, routed experts, and
    logprobs to fp32 round-off (TP 2 sums each row-parallel matmul's halves in another order)."""
    ids1, lp1, routes1 = _greedy_routes(one)
    ids2, lp2, routes2 = _greedy_routes(two)
    assert ids2 == ids1
    assert _moved(lp2, lp1) < ROUND_OFF, _moved(lp2, lp1)
    assert all(r is not None for r in routes1 + routes2)
    for a, b in zip(routes1, routes2):
        assert torch.equal(a, b)


def test_an_engine_over_two_nodes_samples_what_one_rank_does(served, over_nodes):
    # both nodes run a scheduler: node 0 under the server's process, node 1 under its own
    for proc in (over_nodes.server.proc, *over_nodes.server.nodes):
        titles = [" ".join(_cmdline(p)) for p in psutil.Process(proc.pid).children(recursive=True)]
        assert sum("sglang::scheduler" in t for t in titles) == 1, titles
    _same_sampling(served.engine, over_nodes.engine)


def test_weights_broadcast_to_an_engine_over_two_nodes_reach_both_shards(served, over_nodes, restore):
    from megagrpo.sync.broadcast import sync_remote, verify_remote

    perturbed = _perturbed(served.original)
    sync_remote(served.transport, bucketize(perturbed, SMALL_BUCKET))
    stats = sync_remote(over_nodes.transport, bucketize(perturbed, SMALL_BUCKET))
    assert over_nodes.transport.group_name == "megagrpo-weights-1" and stats.tensors == len(perturbed)
    ids, logprobs = _greedy(over_nodes.engine)
    assert ids != served.ids or _moved(logprobs, served.logprobs) > 100 * ROUND_OFF  # they did change
    _same_sampling(served.engine, over_nodes.engine)  # and equally on both shards of TP 2
    with pytest.raises(MegagrpoError, match="engine_tp=1 only"):
        verify_remote(over_nodes.engine, [perturbed])


def test_the_server_exits_0_when_the_store_says_stop(served):
    children = psutil.Process(served.server.proc.pid).children(recursive=True)
    assert any("sglang::scheduler" in " ".join(_cmdline(p)) for p in children), [
        _cmdline(p) for p in children
    ]
    assert served.server.stop() == 0, served.server.tail()
    alive = [p.pid for p in children if _alive(p)]
    assert not alive, f"SGLang processes outlived the server: {alive}"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
