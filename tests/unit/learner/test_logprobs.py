"""`token_logprobs_and_entropy` against torch's full-vocab log_softmax (values and grads), in one process.

Vocab sharding is simulated with one thread per shard and an in-memory all-reduce, so any number of
shards (including padding-only shards) is cheap to test; tests/dist/test_checkpoint.py runs the real
2-process gloo TP2 case.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megagrpo.learner import logprobs as lp_mod
from megagrpo.learner.logprobs import token_logprobs_and_entropy


def reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None
):
    """Unsharded, full vocab: (logp [N], entropy [N]) from torch.log_softmax, differentiable."""
    z = logits[..., :vocab_size] if vocab_size is not None else logits
    lsm = torch.log_softmax(z / temperature, dim=-1)
    logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return logp, entropy


def _data(n=37, v=50, *, dtype=torch.float64, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    w = torch.randn(2, n, generator=g, dtype=torch.float64).to(dtype)
    return x, t, w


def _grad(fn, x, t, w):
    x = x.clone().requires_grad_()
    logp, ent = fn(x, t)
    obj = (logp * w[0]).sum() + ((ent * w[1]).sum() if ent is not None else 0.0)
    (g,) = torch.autograd.grad(obj, x)
    return logp.detach(), None if ent is None else ent.detach(), g


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 5, 64, None])
def test_values_and_grads_match_full_log_softmax_fp64(temperature, chunk):
    x, t, w = _data()
    ours = _grad(
        lambda a, b: token_logprobs_and_entropy(a, b, chunk_tokens=chunk, temperature=temperature), x, t, w
    )
    ref = _grad(lambda a, b: reference(a, b, temperature), x, t, w)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fp32_values_and_grads_close_to_exact():
    x, t, w = _data(n=64, v=1000, scale=4.0)
    exact = _grad(reference, x, t, w)
    ours = _grad(lambda a, b: token_logprobs_and_entropy(a, b, chunk_tokens=16), x.float(), t, w.float())
    torch_fp32 = _grad(reference, x.float(), t, w.float())
    for a, b, c in zip(ours, exact, torch_fp32):
        assert a.dtype == torch.float32
        err, torch_err = float((a.double() - b).abs().max()), float((c.double() - b).abs().max())
        assert err <= max(4 * torch_err, 1e-6), (err, torch_err)


def test_gradcheck_both_outputs():
    x, t, _ = _data(n=6, v=9)
    x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a: token_logprobs_and_entropy(a, t, chunk_tokens=4, temperature=0.8), (x,)
    )


def test_leading_dims_are_kept():
    x, t, w = _data(n=24, v=30)
    logp, ent = token_logprobs_and_entropy(x.view(2, 3, 4, 30), t.view(2, 3, 4))
    assert logp.shape == ent.shape == (2, 3, 4)
    ref_lp, ref_ent = reference(x, t)
    torch.testing.assert_close(logp.reshape(-1), ref_lp)
    torch.testing.assert_close(ent.reshape(-1), ref_ent)


def test_without_entropy_returns_none_and_logp_grad():
    x, t, w = _data()
    ours = _grad(lambda a, b: token_logprobs_and_entropy(a, b, with_entropy=False), x, t, w)
    ref = _grad(lambda a, b: (reference(a, b)[0], None), x, t, w)
    assert ours[1] is None
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[2], ref[2])


@pytest.mark.parametrize("use", ["logp", "entropy"])
def test_grad_through_one_output_only(use):
    x, t, _ = _data()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = token_logprobs_and_entropy(x1, t)
    ref = reference(x2, t)
    i = 0 if use == "logp" else 1
    ours[i].sum().backward()
    ref[i].sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_padded_vocab_is_excluded_without_a_copy_of_the_logits():
    x, t, w = _data(v=64)
    x[:, 50:] = 1e4  # megatron's padded vocab columns hold garbage; they must not count
    t = t % 50
    ours = _grad(lambda a, b: token_logprobs_and_entropy(a, b, vocab_size=50, chunk_tokens=7), x, t, w)
    ref = _grad(lambda a, b: reference(a, b, vocab_size=50), x, t, w)
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1])
    torch.testing.assert_close(ours[2][:, :50], ref[2][:, :50])
    assert torch.all(ours[2][:, 50:] == 0)


def test_minus_inf_logits_give_finite_entropy_and_grads():
    x, t, w = _data()
    x[:, ::3] = float("-inf")  # e.g. tokens masked out by a top-k sampler
    t = (t // 3) * 3 + 1
    t = t.clamp(max=x.shape[1] - 1)
    ours = _grad(token_logprobs_and_entropy, x, t, w)
    keep = x[0] > float("-inf")
    ref = _grad(lambda a, b: reference(a[:, keep], torch.searchsorted(keep.nonzero()[:, 0], b)), x, t, w)
    for a in ours:
        assert torch.isfinite(a).all()
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1])
    torch.testing.assert_close(ours[2][:, keep], ref[2][:, keep])
    assert torch.all(ours[2][:, ~keep] == 0)


def test_bf16_input_computes_in_fp32():
    x, t, _ = _data(n=16, v=100)
    xb = x.to(torch.bfloat16).requires_grad_()
    logp, ent = token_logprobs_and_entropy(xb, t)
    assert logp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = reference(xb.detach().double(), t)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-5)
    (logp.sum() + ent.sum()).backward()
    assert xb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(targets=torch.zeros(3, dtype=torch.long)), "targets shape"),
        (dict(targets=torch.full((4,), 10)), r"targets must lie in \[0, 10\)"),
        (dict(targets=torch.full((4,), -1)), "targets must lie"),
        (dict(targets=torch.zeros(4)), "integer tensor"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(vocab_size=11), "vocab_size"),
        (dict(vocab_size=5, targets=torch.full((4,), 7)), r"targets must lie in \[0, 5\)"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    args = dict(logits_shard=torch.randn(4, 10), targets=torch.zeros(4, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        token_logprobs_and_entropy(args.pop("logits_shard"), args.pop("targets"), **args)


# -- simulated vocab sharding -----------------------------------------------------------------------------


class _ThreadGroup:
    """An in-memory process group: rank = thread; all_reduce over the deposits of every member."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.local = threading.local()

    def all_reduce(self, tensor, op=None, group=None):
        me = self.local.rank
        self.slots[me] = tensor.clone()
        self.barrier.wait()
        stack = torch.stack(self.slots)  # type: ignore[arg-type]
        self.barrier.wait()
        tensor.copy_(stack.amax(0) if op == "max" else stack.sum(0))


def _sharded(monkeypatch, x, t, w, shards: int, v_pad: int, vocab_size: int, temperature: float):
    grp = _ThreadGroup(shards)
    fake = SimpleNamespace(
        get_world_size=lambda group=None: grp.size,
        all_reduce=grp.all_reduce,
        ReduceOp=SimpleNamespace(MAX="max", SUM="sum"),
    )
    monkeypatch.setattr(lp_mod, "dist", fake)
    x = torch.nn.functional.pad(x, (0, v_pad - x.shape[1]), value=123.0)  # garbage in the padding
    v_local = v_pad // shards
    out: list = [None] * shards
    errors: list = []

    def run(r):
        try:
            grp.local.rank = r
            shard = x[:, r * v_local : (r + 1) * v_local].clone().requires_grad_()
            logp, ent = token_logprobs_and_entropy(
                shard, t, tp_group=grp, vocab_start=r * v_local, chunk_tokens=5, temperature=temperature,
                vocab_size=vocab_size,
            )  # fmt: skip
            (g,) = torch.autograd.grad((logp * w[0]).sum() + (ent * w[1]).sum(), shard)
            out[r] = (logp.detach(), ent.detach(), g)
        except BaseException as e:  # surfaced below; a dead thread would otherwise hang the barrier
            errors.append(e)
            grp.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(shards)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    if errors:
        raise errors[0]
    return out, v_local


@settings(max_examples=25, deadline=None)
@example(n=3, vocab=2, shards=4, extra_pad=12, temperature=0.6, seed=1)  # three padding-only shards
@given(
    n=st.integers(1, 12),
    vocab=st.integers(2, 40),
    shards=st.sampled_from([1, 2, 3, 4]),
    extra_pad=st.integers(0, 12),
    temperature=st.sampled_from([1.0, 0.6, 1.5]),
    seed=st.integers(0, 1000),
)
def test_any_vocab_sharding_equals_the_full_vocab(
    monkeypatch_session, n, vocab, shards, extra_pad, temperature, seed
):
    """Padding may leave whole shards without real tokens; every rank gets the same exact values."""
    v_pad = -(-(vocab + extra_pad) // shards) * shards
    x, t, w = _data(n=n, v=vocab, seed=seed)
    out, v_local = _sharded(monkeypatch_session, x, t, w, shards, v_pad, vocab, temperature)
    ref = _grad(lambda a, b: reference(a, b, temperature), x, t, w)
    ref_grad = torch.nn.functional.pad(ref[2], (0, v_pad - vocab))
    for r, (logp, ent, g) in enumerate(out):
        torch.testing.assert_close(logp, ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent, ref[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, ref_grad[:, r * v_local : (r + 1) * v_local], rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def monkeypatch_session():
    # hypothesis forbids function-scoped fixtures in @given tests; each example re-sets the same attribute.
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
