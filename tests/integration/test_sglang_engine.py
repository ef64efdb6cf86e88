"""Smoke proof (b): a CPU sglang.Engine on a tiny Qwen3-MoE generates with logprobs and routed experts,
and the CPU-compat patches are the code paths actually hit (in this process and in the engine's children).
"""

from __future__ import annotations

import json
import re
import shutil
import signal

import psutil
import pytest
import torch

from megagrpo.compat import HITS
from megagrpo.rollout import NO_ROUTE, SamplingConfig


def test_generate_with_logprobs_and_routes(sglang_engine):
    groups = sglang_engine.generate(
        [[5, 6, 7, 8]], SamplingConfig(max_new_tokens=6, ignore_eos=True), group_size=2
    )
    assert len(groups) == 1 and len(groups[0]) == 2
    for c in groups[0]:
        assert c.output_ids.shape == (6,) and c.logprobs.shape == (6,)
        assert c.finish_reason == "length"
        assert bool((c.logprobs < 0).all()) and bool(torch.isfinite(c.logprobs).all())
        assert c.routes.shape == (4 + 6, 2, 2) and c.routes.dtype == torch.int32
        assert bool((c.routes[:-1] >= 0).all()) and bool((c.routes[:-1] < 8).all())
        assert bool((c.routes[-1] == NO_ROUTE).all())
        assert c.output_routes.shape == (6, 2, 2)
        # the two top-k experts of a token are distinct
        assert bool((c.routes[:-1, :, 0] != c.routes[:-1, :, 1]).all())
    # both samples share the prompt, so they share its routes (prefill, possibly from the prefix cache)
    assert torch.equal(groups[0][0].routes[:4], groups[0][1].routes[:4])


def test_scheduler_processes_are_the_engines(sglang_engine):
    names = {psutil.Process(p).name() for p in sglang_engine.pids}
    assert any(n.startswith("sglang::scheduler") for n in names), names
    assert any(n.startswith("sglang::detokenizer") for n in names), names


def test_compat_patches_hit_in_engine_children(sglang_engine, sglang_hits_dir):
    from megagrpo.compat.sglang_cpu import read_child_hits

    sglang_engine.generate([[3, 4, 5]], SamplingConfig(max_new_tokens=2), group_size=1)
    sglang_engine.release()
    sglang_engine.resume()
    hits = read_child_hits(sglang_hits_dir)
    sched = set(hits.get("Engine.run_scheduler_process_func", ()))
    detok = set(hits.get("Engine.run_detokenizer_process_func", ()))
    assert sched and detok and not sched & detok
    # the routed-experts host buffer was allocated by the plain allocator, in the scheduler
    assert sched & hits["sglang.srt.mem_cache.pool_host.common.alloc_with_host_register"]
    # release_memory_occupation's torch.get_device_module().synchronize() went through the patch
    assert sched & hits["torch.get_device_module"]
    # plain generation never calls assign_req_to_token_pool_cpu (only speculative decoding does)
    assert "sgl_kernel.assign_req_to_token_pool_cpu" not in hits


def test_compat_patches_in_process(sglang_engine):
    """The patched functions themselves, called here so their hits count in this process."""
    import sgl_kernel

    from megagrpo.compat.sglang_cpu import assign_req_to_token_pool_cpu

    before = HITS["sgl_kernel.assign_req_to_token_pool_cpu"]
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 0]),
        torch.tensor([3, 3]),
        torch.arange(10, 20),
        8,
    )
    assert HITS["sgl_kernel.assign_req_to_token_pool_cpu"] == before + 1
    assert req_to_token[2, 1:3].tolist() == [10, 11] and req_to_token[0, 0:3].tolist() == [12, 13, 14]
    assert sgl_kernel.assign_req_to_token_pool_cpu.__wrapped__ is assign_req_to_token_pool_cpu
    # the vocabulary-shard mask of a TP 2+ engine runs eagerly (no inductor C++ build in its schedulers), and
    # maps rank 1's ids of a 10-token vocabulary (5-9, none added) into its shard, others to 0 and masked
    from sglang.srt.layers import vocab_parallel_embedding

    masked_input = vocab_parallel_embedding.get_masked_input_and_mask
    assert not hasattr(masked_input, "_torchdynamo_orig_callable")
    ids, mask = masked_input(torch.tensor([0, 4, 5, 9]), 5, 10, 0, 10, 10)
    assert ids.tolist() == [0, 0, 0, 4] and mask.tolist() == [True, True, False, False]
    with pytest.raises(RuntimeError, match="copy_all_layer_kv_cache_cpu is not available"):
        sgl_kernel.copy_all_layer_kv_cache_cpu()
    before = HITS["torch.get_device_module"]
    assert torch.get_device_module() is torch.cpu
    assert torch.get_device_module("cuda") is torch.cuda
    assert HITS["torch.get_device_module"] >= before + 2  # the engine's threads may call it too


def test_tp_groups_ask_no_pynccl_on_cpu(sglang_engine, monkeypatch):
    """SGLang asks PyNccl for every model-parallel group whose caller does not choose, on the CPU platform
    too, and PyNccl fails there ("Expected a cuda device, but got: cpu") as a group of 2+ ranks starts; the
    compat layer turns it off. The TP group's call, as `initialize_model_parallel` makes it, here (a TP 2
    engine itself runs in test_weights_broadcast.py)."""
    from sglang.srt.distributed import parallel_state

    seen = {}
    monkeypatch.setattr(parallel_state, "GroupCoordinator", lambda **kw: seen.update(kw))
    before = HITS["sglang.srt.distributed.parallel_state.init_model_parallel_group"]
    parallel_state.init_model_parallel_group([[0, 1]], 0, "gloo", group_name="tp")
    assert seen["use_pynccl"] is False and seen["group_ranks"] == [[0, 1]]
    assert HITS["sglang.srt.distributed.parallel_state.init_model_parallel_group"] == before + 1


def test_seeded_requests_repeat_and_group_members_differ(sglang_engine, sglang_hits_dir):
    """Request k of a call samples with seed + k (the compat layer honours SGLang's sampling_seed on CPU):
    the same call repeats token for token, group members differ, and another seed gives other samples."""
    from megagrpo.compat.sglang_cpu import read_child_hits

    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    def outputs(seed):
        cfg = SamplingConfig(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=seed)
        groups = sglang_engine.generate(prompts, cfg, group_size=4)
        return [c.output_ids.tolist() for g in groups for c in g], [c.logprobs for g in groups for c in g]

    ids_a, lp_a = outputs(1234)
    ids_b, lp_b = outputs(1234)
    ids_c, _ = outputs(98765)
    assert ids_a == ids_b
    assert all(torch.equal(x, y) for x, y in zip(lp_a, lp_b))
    assert len({tuple(x) for x in ids_a[:4]}) > 1  # members of one group are independent draws
    assert ids_c != ids_a
    hits = read_child_hits(sglang_hits_dir)
    assert hits.get("SamplingBatchInfo.from_schedule_batch")
    assert hits.get("sglang.srt.layers.sampler.murmur_hash32")


def test_the_host_keeps_sigterm_after_a_request(sglang_engine):
    """SGLang registers a drain-and-exit SIGTERM callback on its loop at the first request; the engine
    removes it, so the trainer's own handler (checkpoint, then exit 75) is the one installed afterwards."""
    import signal

    def host(signum, frame):  # pragma: no cover - never delivered here
        raise AssertionError("not expected")

    old = signal.signal(signal.SIGTERM, host)
    try:
        sglang_engine.generate([[5, 6, 7]], SamplingConfig(max_new_tokens=2), group_size=1)
        assert signal.getsignal(signal.SIGTERM) is host
        sglang_engine.score([[5, 6, 7, 8]])
        assert signal.getsignal(signal.SIGTERM) is host
        loop = sglang_engine.engine.tokenizer_manager.event_loop

        async def still_registered() -> bool:  # uvloop removes (and reports) a handler only while running
            return loop.remove_signal_handler(signal.SIGTERM) or loop.remove_signal_handler(signal.SIGQUIT)

        assert loop.run_until_complete(still_registered()) is False
        # SGLang's SIGQUIT callback (kill this process's whole tree when a child dies) is replaced by the
        # engine's own (issue 36, item 9: EngineFailed instead of exit 137)
        assert signal.getsignal(signal.SIGQUIT) == sglang_engine._child_failed
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_families_generate_as_transformers_does(family_engine):
    """DeepSeek-V3 (MLA through the torch-native path of compat/sglang_cpu.py) and GLM-4.5 served on this
    CPU in fp32: greedy output equal to transformers' argmax, the sampler's logprob of every token equal to
    transformers' to fp32 round-off, and routes for every MoE layer (issue 37, part 2). Before the
    torch-native MLA path, DeepSeek-V3's prefill attended over the latent KV pool: off by 0.55 nats.
    DeepSeek-V3's model is saved as transformers saves it (issue 43), with Moonlight's plain rope, which
    SGLang's CPU rope refused, and no `topk_method`/`scoring_func`/`moe_layer_freq`, without which SGLang's model
    raised AttributeError; either way the engine's start killed this process (exit 137)."""
    engine, hf = family_engine.engine, family_engine.reference
    saved = json.loads((family_engine.model_dir / "config.json").read_text())
    if family_engine.family == "deepseek_v3":
        assert not {"topk_method", "scoring_func", "moe_layer_freq"} & saved.keys()
        assert saved["q_lora_rank"] and saved["rope_parameters"]["rope_type"] == "default"
    prompts = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202, 44, 45, 46, 47, 48, 49, 50, 51]]
    groups = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True), 1)
    layers, topk = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    for prompt, (c,) in zip(prompts, groups):
        ids = torch.cat([c.prompt_ids, c.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)[len(prompt) - 1 : -1]
        assert torch.equal(logp.argmax(-1), c.output_ids), family_engine.family
        gap = (logp.gather(1, c.output_ids[:, None])[:, 0] - c.logprobs).abs().max().item()
        assert gap < 1e-5, (family_engine.family, gap)  # measured 4.8e-7 (one fp32 ulp of a logprob)
        assert c.routes.shape == (len(ids), layers, topk)
        moe = c.routes[:-1, hf.config.first_k_dense_replace :]  # the dense first layer routes nothing
        assert bool((moe >= 0).all()) and bool((moe < hf.config.n_routed_experts).all())
        assert bool((moe[..., 0] != moe[..., 1]).all())
    # MLA's attention took the latent-as-value path (extend and decode); GLM-4.5's attention is upstream's
    from megagrpo.compat.sglang_cpu import read_child_hits

    hits = read_child_hits(family_engine.hits_dir)
    sdpa = {f"TorchNativeAttnBackend._run_sdpa_forward_{m}" for m in ("extend", "decode")}
    assert (sdpa <= hits.keys()) == (family_engine.family == "deepseek_v3"), (family_engine.family, hits)
    assert not sdpa & hits.keys() or family_engine.family == "deepseek_v3"
    # MLA's plain rope is SGLang's own plain RotaryEmbedding (GLM-4.5's GQA never asks the MLA factory)
    assert ("factory.get_rope_cpu" in hits) == (family_engine.family == "deepseek_v3"), hits


def test_an_engine_that_cannot_start_is_an_error_naming_it_and_the_cause(tiny_model, tmp_path):
    """Issue 43: a scheduler that fails while it builds the model (here SGLang's DeepSeek MoE refuses a
    non-SiLU activation) signals its parent, whose SGLang handler killed its whole process tree: the
    trainer ended with exit 137 at start and no word of the cause. Now the start raises `EngineFailed`,
    naming the engine, the model and the scheduler's exception, and leaves none of its processes."""
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from megagrpo.rollout import RolloutConfig, RolloutEngine
    from megagrpo.rollout.engines.engine import EngineFailed, _is_mp_helper, open_zmq_contexts

    model = tmp_path / "model"
    shutil.copytree(tiny_model("deepseek_v3", yarn=False), model)  # the family engine's
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    name = "engine 3 of 4: rank 6 on node-x, cores [0, 1]"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    contexts = {id(c) for c in open_zmq_contexts()}
    handler = signal.getsignal(signal.SIGQUIT)  # a session engine's, put back (one handler per process)
    try:
        with pytest.raises(EngineFailed) as e:
            RolloutEngine(
                RolloutConfig(str(model), dtype="float32", max_total_tokens=1024), name=name
            ).start()
    finally:
        signal.signal(signal.SIGQUIT, handler)
    msg = str(e.value)
    assert msg.startswith(
        f"{name}: SGLang could not start on {model} (tp_size=1): its scheduler failed with "
    ), msg
    assert "ValueError: Unsupported activation: relu. Only silu is supported for now. (at File " in msg, msg
    assert re.search(r'models/deepseek_v2\.py", line \d+, in __init__\)$', msg), msg  # where SGLang raised
    left = [
        p for p in psutil.Process().children(recursive=True)
        if p.pid not in before and not _is_mp_helper(p) and p.status() != psutil.STATUS_ZOMBIE
    ]  # fmt: skip
    assert not left, left
    # nor its ZMQ contexts: left to the garbage collector with requests for the dead scheduler queued, their
    # default linger blocked this test process at a later allocation, for ever
    assert not [c for c in open_zmq_contexts() if id(c) not in contexts]
