"""Weight sync into the running engine: new weights take effect, a no-op sync changes nothing, the checksum
holds, and a bad export is refused before anything is sent (the engine keeps the old weights).

The HF-named tensors come from a perturbed transformers model saved in checkpoint layout (the names and
shapes the bridge's streaming export yields).

The shared engine serves the tiny Qwen3-MoE with moe_intermediate_size 20 (`conftest.ENGINE_MODEL`), which
SGLang's CPU engine pads to 32, so every transport here (packed, HF-named, partial) and the checksums run on
padded parameters (issue 37). The engine is one per session, shared by every engine file in one pytest
process (the Makefile), so its model is chosen in conftest, not overridden per module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from megagrpo.errors import MegagrpoError
from megagrpo.sync import bucketize, sync_weights
from tests.integration.conftest import ENGINE_MODEL

MOE_INTERMEDIATE = ENGINE_MODEL["moe_intermediate"]  # no multiple of 32: SGLang's CPU engine pads it to 32

LOGPROB_TOL_FP32 = 2e-4  # fp32 engine vs fp32 transformers; measured max |delta| 4.8e-7 here
SEQS = [[5, 17, 33, 2, 90, 14, 200, 7, 61, 8], [1, 307, 260, 202, 90, 301, 314, 224]]


def _checkpoint_tensors(model, tmp_path) -> list[tuple[str, torch.Tensor]]:
    model.save_pretrained(tmp_path, safe_serialization=True)
    return list(load_file(tmp_path / "model.safetensors").items())


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _max_diff(engine, model):
    return max(float((e - _hf_logprobs(model, s)).abs().max()) for e, s in zip(engine.score(SEQS), SEQS))


def _hf_greedy(model, n: int = 6) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(torch.tensor([s[:5]]), do_sample=False, max_new_tokens=n)[0, 5:].tolist()
            for s in SEQS
        ]


def _perturbed(model, seed: int):
    """A copy of `model` with every parameter moved by 0.05 standard normal noise."""
    out = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return out


@pytest.fixture
def original_tensors(hf_reference, tmp_path_factory):
    return _checkpoint_tensors(hf_reference, tmp_path_factory.mktemp("orig"))


@pytest.fixture
def restore(sglang_engine, original_tensors):
    yield
    sync_weights(sglang_engine, bucketize(original_tensors))


def test_sync_changes_weights_and_second_sync_is_a_noop(
    sglang_engine, hf_reference, original_tensors, restore, tmp_path
):
    assert _max_diff(sglang_engine, hf_reference) < LOGPROB_TOL_FP32
    updated = copy.deepcopy(hf_reference)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tensors = _checkpoint_tensors(updated, tmp_path)

    stats = sync_weights(sglang_engine, bucketize(tensors, bucket_bytes=64 << 10), checksum=True)
    assert stats.checksum_ok is True and stats.buckets > 1 and stats.tensors == len(tensors)
    assert stats.packed  # CPU engine: sent in SGLang's parameter layout (load_format="direct")
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    m = stats.metrics()
    assert set(m) == {"sync/bytes", "sync/seconds", "sync/gbps", "sync/checksum_ok"} and m["sync/gbps"] > 0

    assert _max_diff(sglang_engine, updated) < LOGPROB_TOL_FP32
    assert _max_diff(sglang_engine, hf_reference) > 100 * LOGPROB_TOL_FP32
    assert _greedy(sglang_engine) == _hf_greedy(updated)  # the padded slots hold zeros: logits unchanged
    first = sglang_engine.score(SEQS)

    again = sync_weights(sglang_engine, bucketize(tensors), checksum=True)
    assert again.checksum_ok is True and again.buckets == 1
    for a, b in zip(first, sglang_engine.score(SEQS)):
        assert torch.equal(a, b)

    # HF-named transport (SGLang's load_weights) holds the same weights as the packed one
    hf_path = sync_weights(
        sglang_engine, bucketize(tensors, bucket_bytes=64 << 10), checksum=True, pack=False
    )
    assert hf_path.checksum_ok is True and not hf_path.packed
    for a, b in zip(first, sglang_engine.score(SEQS)):
        assert torch.equal(a, b)


def test_partial_sync_with_an_incomplete_group_goes_through_load_weights(
    sglang_engine, original_tensors, restore
):
    baseline = sglang_engine.score(SEQS)
    experts = [(n, t * 1.5) for n, t in original_tensors if n.startswith("model.layers.1.mlp.experts.")]
    q_proj = [(n, t * 1.5) for n, t in original_tensors if n == "model.layers.0.self_attn.q_proj.weight"]
    stats = sync_weights(sglang_engine, bucketize(experts + q_proj), partial=True, checksum=True)
    assert not stats.packed  # q_proj without k/v cannot fill qkv_proj alone
    assert stats.checksum_ok is True  # layer 1's w13/w2 (the complete groups) hold the new values
    assert all(not torch.equal(a, b) for a, b in zip(baseline, sglang_engine.score(SEQS)))

    with pytest.raises(MegagrpoError, match="missing"):
        sync_weights(sglang_engine, bucketize(experts))  # not partial: the rest of the model is missing


def test_bad_export_is_refused_before_sending(sglang_engine, hf_reference, original_tensors, restore):
    baseline = sglang_engine.score(SEQS)
    perturbed = [(n, t + 1.0) for n, t in original_tensors]  # would change every logprob if it were sent

    missing = [(n, t) for n, t in perturbed if n != "model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(MegagrpoError, match=r"missing.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        sync_weights(sglang_engine, bucketize(missing, bucket_bytes=4096))

    name = "model.layers.0.self_attn.k_proj.weight"
    misshapen = [(n, t[:-1] if n == name else t) for n, t in perturbed]
    with pytest.raises(MegagrpoError, match=rf"{name}.*shape \(31, 64\).*expects \(32, 64\)"):
        sync_weights(sglang_engine, bucketize(misshapen, bucket_bytes=4096))

    unknown = [*perturbed, ("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(64, 64))]
    with pytest.raises(MegagrpoError, match="experts.99.up_proj.weight.*not in the engine's checkpoint"):
        sync_weights(sglang_engine, [unknown])

    for a, b in zip(baseline, sglang_engine.score(SEQS)):
        assert torch.equal(a, b)
    assert _max_diff(sglang_engine, hf_reference) < LOGPROB_TOL_FP32


def test_the_engine_names_the_parameters_it_holds_in_other_shapes(sglang_engine, original_tensors):
    """The packed sync's shape probe runs in SGLang's scheduler and answers through shared memory (issue 36,
    item 9): a parameter planned in a shape the engine does not hold comes back named with both shapes,
    and the scheduler lives on. Here the engine pads moe_intermediate_size 20 to 32: w13_weight is
    (8, 64, 64) and w2_weight (8, 64, 32) where the checkpoint packs (8, 40, 64) and (8, 64, 20), which
    the packed sync lays out zero-padded (issue 37)."""
    from megagrpo.sync.sglang_layout import FusedParam, sglang_plan
    from megagrpo.sync.shape_probe import engine_shape_mismatches

    baseline = sglang_engine.score(SEQS)
    plan = sglang_plan({n: tuple(t.shape) for n, t in original_tensors})
    w13 = "model.layers.0.mlp.experts.w13_weight"
    e, two_i, h = plan[w13].shape
    assert two_i == 2 * MOE_INTERMEDIATE
    other = {n: fp for n, fp in plan.items() if not n.endswith(("w13_weight", "w2_weight"))}
    other["model.no_such.weight"] = FusedParam("model.no_such.weight", ("model.no_such.weight",), (3,))
    eng = sglang_engine.engine
    assert eng.begin_weight_update()[0]
    try:
        padded = engine_shape_mismatches(eng, plan)
        bad = engine_shape_mismatches(eng, other)
    finally:
        assert eng.end_weight_update()[0]
    assert sorted(padded) == sorted(
        [(f"model.layers.{i}.mlp.experts.w13_weight", (e, two_i, h), (e, 64, h)) for i in range(2)]
        + [
            (f"model.layers.{i}.mlp.experts.w2_weight", (e, h, MOE_INTERMEDIATE), (e, h, 32))
            for i in range(2)
        ]
    )
    assert bad == [("model.no_such.weight", (3,), None)]
    for a, b in zip(baseline, sglang_engine.score(SEQS)):  # alive, and nothing was loaded
        assert torch.equal(a, b)


def _greedy(engine) -> list[list[int]]:
    from megagrpo.rollout import SamplingConfig

    groups = engine.generate([s[:5] for s in SEQS], SamplingConfig(temperature=0.0, max_new_tokens=6), 1)
    return [g[0].output_ids.tolist() for g in groups]


@pytest.mark.parametrize("pack", [True, False])
def test_bad_values_are_caught_before_the_released_weights_are_resumed(
    sglang_engine, original_tensors, restore, pack
):
    """The trainer's order (issue 16, item 5): the engine's weights are released during training; the
    export is checked before `before_send` resumes them (with the memory saver a resumed region holds
    garbage until written), so a NaN leaves the engine released, untouched, and serving its old weights
    once resumed."""
    from megagrpo.sync import engine_state, shape_probe

    baseline, baseline_ids = sglang_engine.score(SEQS), _greedy(sglang_engine)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    bad = []
    for n, t in original_tensors:
        t = t + 1.0
        if n == name:
            t[3, 5] = float("nan")
        bad.append((n, t))
    events: list[str] = []

    def resume_weights():
        events.append("resume")
        sglang_engine.resume(["weights"])

    eng = sglang_engine.engine
    update = eng.update_weights_from_tensor

    def update_counted(*a, **k):  # the shape probe (asked before packing) loads nothing: not an update
        events.append("probe" if k.get("load_format") == shape_probe.SHAPES_PROBE else "update")
        return update(*a, **k)

    eng.update_weights_from_tensor = update_counted
    try:
        sglang_engine.release(["kv_cache", "weights"])
        engine_state._PER_ENGINE.pop(eng, None)  # the packing plan's lookups run while released
        with pytest.raises(MegagrpoError, match=rf"tensor '{name}' holds NaN"):
            sync_weights(  # an iterator, as the streaming export yields: the NaN is in a later bucket
                sglang_engine, iter(bucketize(bad, bucket_bytes=4096)), pack=pack, before_send=resume_weights
            )
        assert events == (["probe"] if pack else []) and sglang_engine.asleep
        events.clear()
        sglang_engine.resume()
        assert _greedy(sglang_engine) == baseline_ids
        for a, b in zip(baseline, sglang_engine.score(SEQS)):
            assert torch.equal(a, b)

        # A good export goes through in that order: checked, then resumed, then written.
        sglang_engine.release(["kv_cache", "weights"])
        good = [(n, t + 0.5) for n, t in original_tensors]
        stats = sync_weights(
            sglang_engine, bucketize(good, bucket_bytes=64 << 10), pack=pack, checksum=True,
            before_send=resume_weights,
        )  # fmt: skip
        assert stats.checksum_ok is True and stats.packed == pack
        assert events[0] == "resume" and events.count("resume") == 1
        assert events.count("update") == stats.buckets
    finally:
        eng.update_weights_from_tensor = update
        sglang_engine.resume()
    assert all(not torch.equal(a, b) for a, b in zip(baseline, sglang_engine.score(SEQS)))


def test_the_families_sync_packed_and_hf_named(family_engine, tmp_path):
    """DeepSeek-V3 and GLM-4.5 (issue 37, part 2): a perturbed model, correction bias included, synced in
    SGLang's layout (MLA's fused q_a/kv_a, shared experts' gate_up, w_kc/w_vc derived again from kv_b_proj)
    serves as transformers does with those weights, greedy output included; the HF-named transport holds
    the same weights. Before, the packed plan missed the fused names and fell back to load_weights, and a
    packed load left w_kc/w_vc stale."""
    from megagrpo.rollout import SamplingConfig

    engine, hf = family_engine.engine, family_engine.reference
    original = _checkpoint_tensors(hf, tmp_path / "orig")
    updated = _perturbed(hf, seed=2)
    with torch.no_grad():
        for name, b in updated.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(b.flip(0) * 3)  # a bias that reorders the selection
    tensors = _checkpoint_tensors(updated, tmp_path / "new")
    biases = [n for n, _ in tensors if n.endswith("e_score_correction_bias")]
    assert biases and all(t.dtype == torch.float32 for n, t in tensors if n in biases)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    prompts = [s[:5] for s in SEQS]
    try:
        stats = sync_weights(engine, bucketize(tensors, bucket_bytes=64 << 10), checksum=True)
        assert stats.packed and stats.checksum_ok is True, family_engine.family
        assert _max_diff(engine, updated) < 1e-5
        assert _max_diff(engine, hf) > 100 * 1e-5
        for prompt, (c,) in zip(prompts, engine.generate(prompts, sampling, 1)):
            with torch.no_grad():
                logits = updated(torch.cat([c.prompt_ids, c.output_ids])[None]).logits[
                    0, len(prompt) - 1 : -1
                ]
            assert torch.equal(logits.argmax(-1), c.output_ids), (
                family_engine.family
            )  # greedy, token by token
        first = engine.score(SEQS)
        hf_path = sync_weights(engine, bucketize(tensors, bucket_bytes=64 << 10), checksum=True, pack=False)
        assert hf_path.checksum_ok is True and not hf_path.packed
        for a, b in zip(first, engine.score(SEQS)):
            assert torch.equal(a, b)
    finally:
        sync_weights(engine, bucketize(original))
    assert _max_diff(engine, hf) < 1e-5


def test_the_bridge_export_in_tiny_buckets_keeps_fused_groups_whole(family_engine, tmp_path):
    """Issue 43: the bridge's export cut into 1 KiB buckets, in its map order, reaches the engine with
    every group SGLang fuses at load whole (DeepSeek-V3's q_a/kv_a pair, which its loader drops when it
    arrives over two calls; q/k/v, gate/up), through SGLang's `load_weights` and through the flattened
    buckets of the GPU transport: the engine serves exactly the export, checksum true. The same export
    cut on bytes alone, as before, is refused by name before anything is sent (before: sent, the engine
    5.2 nats from the learner on DeepSeek-V3, checksum false)."""
    from megagrpo.bridge.export import iter_hf_buckets
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.bridge.maps import param_maps
    from megagrpo.bridge.transforms import to_megatron
    from megagrpo.sync.checksums import verify_checksum
    from megagrpo.trainer.weights import fused_groups

    engine, hf = family_engine.engine, family_engine.reference
    original = _checkpoint_tensors(hf, tmp_path / "orig")
    updated = _perturbed(hf, seed=3)
    new = dict(_checkpoint_tensors(updated, tmp_path / "new"))
    arch = arch_from_hf(family_engine.model_dir)
    learner = {
        pm.mcore: to_megatron(pm, [new[n] for n in pm.hf], arch, arch.vocab_size) for pm in param_maps(arch)
    }
    together = fused_groups(arch)
    if arch.is_mla:
        assert "model.layers.0.self_attn.q_a_proj.weight" in together

    def export(**kw):
        return iter_hf_buckets(learner, arch, bucket_bytes=1 << 10, **kw)

    try:
        with pytest.raises(MegagrpoError, match="later bucket"):
            sync_weights(engine, export(), pack=False)  # cut on bytes alone: a group is split
        assert _max_diff(engine, hf) < 1e-5  # refused before anything was sent
        for transport in (dict(pack=False), dict(streamed=True)):
            stats = sync_weights(engine, export(together=together), **transport)
            assert stats.buckets > 20 and not stats.packed, transport
            assert verify_checksum(engine, list(export(together=together))) is True, transport
            assert _max_diff(engine, updated) < 1e-5, transport
            sync_weights(engine, bucketize(original))  # back, so that a stale half would show next time
    finally:
        sync_weights(engine, bucketize(original))
    assert _max_diff(engine, hf) < 1e-5
