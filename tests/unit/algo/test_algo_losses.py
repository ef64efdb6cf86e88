"""policy_loss: on-policy equivalence, GRPO fixes, the GSPO toy, CISPO gradients, metrics, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.algo.aggregation import AGG_MODES
from megagrpo.algo.losses import VARIANTS, policy_loss

F64 = torch.float64
CLIPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "gmpo": (0.4, 0.4)}


def clip_kw(variant: str) -> dict:
    lo, hi = CLIPS.get(variant, (0.2, 0.28))
    return {"clip_low": lo, "clip_high": hi}


def agg_weights(m: torch.Tensor, agg: str, c: float) -> torch.Tensor:
    """Per-token weight of each mode, written out independently of the implementation."""
    n = m.sum(-1, keepdim=True).to(F64)
    seqs = float((n > 0).sum())
    if agg == "token-mean":
        w = torch.full(m.shape, 1.0 / float(m.sum()), dtype=F64)
    elif agg == "seq-mean-token-mean":
        w = 1.0 / (seqs * n.clamp_min(1)).expand(m.shape)
    elif agg == "seq-mean-token-sum":
        w = torch.full(m.shape, 1.0 / seqs, dtype=F64)
    else:
        w = torch.full(m.shape, 1.0 / (seqs * c), dtype=F64)
    return torch.where(m, w, 0.0)


@st.composite
def batches(draw, min_b=1, max_b=4, max_t=6):
    b = draw(st.integers(min_b, max_b))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    if sum(lengths) == 0:
        lengths[0] = 1
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    m = torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.01
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp, adv, m


# ---- on-policy equivalence -------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(batch=batches(), c=st.floats(1.0, 64.0))
def test_on_policy_gradient_equals_reinforce_times_agg_weight(batch, c):
    logp0, adv, m = batch
    for variant in VARIANTS:
        for agg in AGG_MODES:
            logp = logp0.clone().requires_grad_()
            extra = {"clip_ratio_c": 3.0} if variant in ("grpo", "gspo", "gspo_token") else {}
            loss, met = policy_loss(
                logp,
                logp0.clone(),
                adv,
                m,
                variant=variant,
                agg=agg,
                agg_constant=c,
                **clip_kw(variant),
                **extra,
            )
            (grad,) = torch.autograd.grad(loss, logp)
            expected = -adv.unsqueeze(-1) * agg_weights(m, agg, c)  # d(-A log p)/d log p, aggregated
            torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12, msg=f"{variant} {agg}")
            assert float(met["loss/clip_frac_low"]) == float(met["loss/clip_frac_high"]) == 0.0
            assert float(met["loss/ratio_min"]) == pytest.approx(1.0) == float(met["loss/ratio_max"])
            assert float(met["loss/approx_kl"]) == pytest.approx(0.0, abs=1e-15)


# ---- GRPO fixes --------------------------------------------------------------------------------------------


def test_token_mean_vs_seq_mean_token_mean_on_uneven_lengths():
    # 10 tokens of loss 0.5 and 100 tokens of loss 0.1: -A * logp with A = 1.
    logp = torch.zeros(2, 100, dtype=F64)
    logp[0, :10] = -0.5
    logp[1, :] = -0.1
    m = torch.zeros(2, 100, dtype=torch.bool)
    m[0, :10] = True
    m[1, :] = True
    adv = torch.ones(2, dtype=F64)
    tok, _ = policy_loss(logp, logp, adv, m, variant="reinforce", agg="token-mean")
    seq, _ = policy_loss(logp, logp, adv, m, variant="reinforce", agg="seq-mean-token-mean")
    # by hand: (10 * 0.5 + 100 * 0.1) / 110 = 15 / 110 and (0.5 + 0.1) / 2
    assert float(tok) == pytest.approx(15 / 110) == pytest.approx(0.136, abs=5e-4)
    assert float(seq) == pytest.approx(0.300)
    ssum, _ = policy_loss(logp, logp, adv, m, variant="reinforce", agg="seq-mean-token-sum")
    snorm, _ = policy_loss(
        logp, logp, adv, m, variant="reinforce", agg="seq-mean-token-sum-norm", agg_constant=100.0
    )
    assert float(ssum) == pytest.approx((5 + 10) / 2)
    assert float(snorm) == pytest.approx((5 + 10) / (2 * 100))


def _token_grad(ratio: float, adv: float, clip_low: float, clip_high: float, c=None) -> float:
    old = torch.tensor([[-1.0]], dtype=F64)
    logp = (old + math.log(ratio)).requires_grad_()
    loss, _ = policy_loss(
        logp,
        old,
        torch.tensor([adv], dtype=F64),
        torch.ones(1, 1, dtype=torch.bool),
        variant="grpo",
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=c,
        agg="token-mean",
    )
    (g,) = torch.autograd.grad(loss, logp)
    return float(g)


def test_clip_higher_lets_positive_advantage_go_further():
    # A > 0: the objective keeps growing (gradient != 0) up to 1 + clip_high, then the clip stops it.
    sym = [r for r in (1.1, 1.19, 1.21, 1.25, 1.27, 1.29, 1.35) if _token_grad(r, 1.0, 0.2, 0.2) != 0]
    higher = [r for r in (1.1, 1.19, 1.21, 1.25, 1.27, 1.29, 1.35) if _token_grad(r, 1.0, 0.2, 0.28) != 0]
    assert sym == [1.1, 1.19]
    assert higher == [1.1, 1.19, 1.21, 1.25, 1.27]
    # the lower side is unchanged by clip-higher: A < 0 stops at 1 - clip_low in both
    assert _token_grad(0.79, -1.0, 0.2, 0.28) == 0 == _token_grad(0.79, -1.0, 0.2, 0.2)
    assert _token_grad(0.81, -1.0, 0.2, 0.28) != 0


def test_dual_clip_bounds_negative_advantage_ratio():
    assert _token_grad(2.5, -1.0, 0.2, 0.2) != 0  # plain PPO: unbounded for A < 0
    assert _token_grad(2.5, -1.0, 0.2, 0.2, c=3.0) != 0
    assert _token_grad(3.5, -1.0, 0.2, 0.2, c=3.0) == 0
    # value: max(min(rA, clip(r)A), cA) = -3 for r = 3.5, A = -1 -> loss +3
    old = torch.tensor([[-1.0]], dtype=F64)
    loss, met = policy_loss(
        old + math.log(3.5),
        old,
        torch.tensor([-1.0], dtype=F64),
        torch.ones(1, 1, dtype=torch.bool),
        variant="grpo",
        clip_low=0.2,
        clip_high=0.2,
        clip_ratio_c=3.0,
        agg="token-mean",
    )
    assert float(loss.detach()) == pytest.approx(3.0)
    assert float(met["loss/clip_frac_dual"]) == 1.0
    assert float(met["loss/zero_grad_frac"]) == 1.0


# ---- GSPO toy ----------------------------------------------------------------------------------------------

NEW = [
    [-1.2, -0.8, -1.5, -0.4, -2.1, -1.0],
    [-0.9, -1.3, -0.7, -1.8, -0.6, 0],
    [-1.1, -0.5, -1.4, -0.9, 0, 0],
]
OLD = [
    [-1.3, -0.9, -1.4, -0.5, -2.0, -1.1],
    [-1.0, -1.2, -0.8, -1.7, -0.7, 0],
    [-1.0, -0.6, -1.3, -1.0, 0, 0],
]


def test_gspo_toy_sequence_ratios_and_clip_counts():
    new, old = torch.tensor(NEW, dtype=F64), torch.tensor(OLD, dtype=F64)
    m = torch.arange(6).unsqueeze(0) < torch.tensor([[6], [5], [4]])
    # By hand: token log-ratios are +-0.1. Sums: seq 0: +.1+.1-.1+.1-.1+.1 = 0.2 over 6 tokens,
    # seq 1: +.1-.1+.1-.1+.1 = 0.1 over 5, seq 2: -.1+.1-.1+.1 = 0 over 4.
    s_hand = [math.exp(0.2 / 6), math.exp(0.1 / 5), 1.0]  # 1.03390, 1.02020, 1.0
    adv = torch.ones(3, dtype=F64)

    # GRPO at eps = 0.2: every token ratio is e^{+-0.1} in [0.905, 1.105], inside [0.8, 1.2] -> 0 tokens clipped.
    logp = new.clone().requires_grad_()
    _, met = policy_loss(logp, old, adv, m, variant="grpo", clip_low=0.2, clip_high=0.2, agg="token-mean")
    assert float(met["loss/clip_frac_high"]) * 15 == pytest.approx(0)
    assert float(met["loss/ratio_max"]) == pytest.approx(math.exp(0.1))

    # GSPO at (3e-4, 4e-4): s_0 and s_1 exceed 1.0004, s_2 = 1 does not -> 2 of 3 sequences (11 of 15 tokens).
    for variant in ("gspo", "gspo_token"):
        logp = new.clone().requires_grad_()
        loss, met = policy_loss(
            logp, old, adv, m, variant=variant, clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"
        )
        (grad,) = torch.autograd.grad(loss, logp)
        clipped_seqs = [i for i in range(3) if bool((grad[i] == 0).all())]
        assert clipped_seqs == [0, 1]
        assert float(met["loss/clip_frac_high"]) * 15 == pytest.approx(11)
        assert float(met["loss/ratio_max"]) == pytest.approx(s_hand[0])
        assert float(met["loss/ratio_min"]) == pytest.approx(s_hand[2])
        # ratio_mean is the token-weighted mean of s_i
        assert float(met["loss/ratio_mean"]) == pytest.approx((6 * s_hand[0] + 5 * s_hand[1] + 4) / 15)
        # value: -(1/3) sum_i A_i * min(s_i, 1.0004)
        assert float(loss.detach()) == pytest.approx(-(1.0004 + 1.0004 + 1.0) / 3)
        # seq 2 is unclipped: d/dlogp_t of -(1/3) s_2 = -(1/3) * s_2 / 4 per token
        torch.testing.assert_close(grad[2, :4], torch.full((4,), -1 / 12, dtype=F64))


def test_gspo_token_has_per_token_gradient_with_token_advantages():
    new, old = torch.tensor(NEW, dtype=F64), torch.tensor(OLD, dtype=F64)
    m = torch.arange(6).unsqueeze(0) < torch.tensor([[6], [5], [4]])
    adv_tok = torch.linspace(-1, 1, 18, dtype=F64).reshape(3, 6)
    logp = new.clone().requires_grad_()
    loss, _ = policy_loss(
        logp, old, adv_tok, m, variant="gspo_token", clip_low=0.5, clip_high=0.5, agg="seq-mean-token-mean"
    )
    (grad,) = torch.autograd.grad(loss, logp)
    s = torch.exp((torch.where(m, new - old, 0.0)).sum(-1) / m.sum(-1))
    # GSPO-token: gradient of token t is -(1/S)(1/|y_i|) s_i A_{i,t}
    expected = torch.where(m, -s.unsqueeze(-1) * adv_tok / (3 * m.sum(-1, keepdim=True)), 0.0)
    torch.testing.assert_close(grad, expected)


# ---- CISPO vs GRPO at a capped token ----------------------------------------------------------------------


def test_cispo_keeps_gradient_of_capped_token_grpo_drops_it():
    torch.manual_seed(0)
    z0 = torch.randn(1, 1, 5, dtype=F64)
    y = 2
    old = torch.log_softmax(z0, -1)[..., y] - 0.5  # ratio e^0.5 = 1.65 > 1 + 0.28
    m = torch.ones(1, 1, dtype=torch.bool)
    adv = torch.tensor([1.3], dtype=F64)
    grads = {}
    for variant in ("cispo", "grpo"):
        z = z0.clone().requires_grad_()
        logp = torch.log_softmax(z, -1)[..., y]
        loss, met = policy_loss(
            logp, old, adv, m, variant=variant, clip_low=0.2, clip_high=0.28, agg="token-mean"
        )
        (grads[variant],) = torch.autograd.grad(loss, z)
        assert float(met["loss/clip_frac_high"]) == 1.0
    onehot = torch.nn.functional.one_hot(torch.tensor(y), 5).to(F64)
    dlogp_dz = onehot - torch.softmax(z0, -1)  # gradient of log softmax_y w.r.t. the logits
    torch.testing.assert_close(grads["cispo"], -1.28 * 1.3 * dlogp_dz)
    assert bool((grads["grpo"] == 0).all())


# ---- GMPO and SAPO specifics -------------------------------------------------------------------------------


def test_gmpo_sign_aware_log_space_clip():
    old = torch.zeros(2, 3, dtype=F64)
    x = torch.tensor([[0.6, 0.1, -0.6], [0.6, 0.1, -0.6]], dtype=F64)  # token log-ratios
    m = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([2.0, -2.0], dtype=F64)
    logp = x.clone().requires_grad_()
    loss, met = policy_loss(
        logp, old, adv, m, variant="gmpo", clip_low=0.4, clip_high=0.4, agg="seq-mean-token-mean"
    )
    (grad,) = torch.autograd.grad(loss, logp)
    # A > 0: cap log r at +0.4 -> exp((0.4 + 0.1 - 0.6)/3); A < 0: floor at -0.4 -> exp((0.6 + 0.1 - 0.4)/3)
    s_pos, s_neg = math.exp(-0.1 / 3), math.exp(0.3 / 3)
    assert float(loss.detach()) == pytest.approx(-(2 * s_pos - 2 * s_neg) / 2)
    assert grad[0, 0] == 0 and grad[1, 2] == 0  # the clipped tokens
    assert float(grad[0, 1]) == pytest.approx(-2 * s_pos / 3 / 2)
    assert float(grad[1, 0]) == pytest.approx(2 * s_neg / 3 / 2)
    assert float(met["loss/clip_frac_high"]) == pytest.approx(1 / 6)
    assert float(met["loss/clip_frac_low"]) == pytest.approx(1 / 6)


def test_sapo_gate_gradient_by_advantage_sign():
    old = torch.zeros(2, 1, dtype=F64) - 1.0
    r = 1.5
    m = torch.ones(2, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    logp = (old + math.log(r)).requires_grad_()
    loss, met = policy_loss(
        logp, old, adv, m, variant="sapo", agg="seq-mean-token-sum", sapo_tau_pos=1.0, sapo_tau_neg=2.0
    )
    (grad,) = torch.autograd.grad(loss, logp)

    def gate_grad(tau):  # d/dlogp sigmoid(tau (r - 1)) * 4 / tau = 4 sigma (1 - sigma) r
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        return 4 * sig * (1 - sig) * r

    assert float(grad[0, 0]) == pytest.approx(-gate_grad(1.0) / 2)
    assert float(grad[1, 0]) == pytest.approx(gate_grad(2.0) / 2)
    assert float(met["loss/zero_grad_frac"]) == 0


# ---- weights, KL, entropy ----------------------------------------------------------------------------------


def test_importance_and_token_weights_multiply_and_are_detached():
    g = torch.Generator().manual_seed(1)
    logp0 = -torch.rand(3, 4, generator=g, dtype=F64)
    m = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    iw = torch.rand(3, 4, generator=g, dtype=F64).requires_grad_()
    tw = torch.rand(3, 4, generator=g, dtype=F64)
    tw[0, 0] = 0
    logp = logp0.clone().requires_grad_()
    loss, met = policy_loss(
        logp, logp0, adv, m, variant="grpo", clip_low=0.2, clip_high=0.2, agg="token-mean",
        importance_weights=iw, token_weights=tw,
    )  # fmt: skip
    grad, iw_grad = torch.autograd.grad(loss, [logp, iw], allow_unused=True)
    torch.testing.assert_close(grad, -adv.unsqueeze(-1) * iw.detach() * tw / 12)
    assert iw_grad is None  # the importance weights are detached inside policy_loss
    assert float(met["loss/zero_grad_frac"]) == pytest.approx(1 / 12)


def test_kl_and_entropy_terms():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]], dtype=F64)
    ent = torch.tensor([[0.7, 0.3]], dtype=F64)
    m = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([0.0], dtype=F64)
    loss, met = policy_loss(
        logp, logp.detach(), adv, m, variant="grpo", clip_low=0.2, clip_high=0.2, agg="token-mean",
        ref_logp=ref, kl_coef=0.1, kl_estimator="k3", entropy=ent, entropy_coef=0.01,
    )  # fmt: skip
    k3 = math.exp(-0.5) - 1 + 0.5  # log r = ref - logp = -0.5 on token 0, 0 on token 1
    assert float(met["loss/kl"]) == pytest.approx(k3 / 2)
    assert float(met["loss/entropy"]) == pytest.approx(0.5)
    assert float(met["loss/policy"]) == 0
    assert float(loss.detach()) == pytest.approx(0.1 * k3 / 2 - 0.01 * 0.5)
    assert float(met["loss/total"]) == pytest.approx(float(loss.detach()))
    assert float(met["loss/zero_grad_frac"]) == 1.0  # A == 0 everywhere: no policy gradient


# ---- bad input and edge cases ------------------------------------------------------------------------------


def _kw(**over):
    b, t = 2, 3
    kw = dict(
        logp=-torch.ones(b, t), old_logp=-torch.ones(b, t), advantages=torch.ones(b),
        loss_mask=torch.ones(b, t, dtype=torch.bool), variant="grpo", clip_low=0.2, clip_high=0.2, agg="token-mean",
    )  # fmt: skip
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"old_logp": -torch.ones(2, 4)}, "old_logp"),
        ({"advantages": torch.ones(3)}, "advantages"),
        ({"advantages": torch.ones(2, 1)}, "advantages"),
        ({"loss_mask": torch.ones(2, 1, dtype=torch.bool)}, "loss_mask"),
        ({"logp": -torch.ones(6)}, "logp"),
        ({"importance_weights": torch.ones(2)}, "importance_weights"),
        ({"token_weights": torch.ones(1, 3)}, "token_weights"),
        ({"ref_logp": torch.ones(2, 2), "kl_coef": 0.1}, "ref_logp"),
        ({"variant": "ppo2"}, "variant"),
        ({"agg": "mean"}, "agg"),
        ({"agg": "seq-mean-token-sum-norm"}, "agg_constant"),
        ({"kl_estimator": "k4", "ref_logp": -torch.ones(2, 3)}, "kl_estimator"),
        ({"kl_coef": 0.1}, "ref_logp"),
        ({"clip_high": None}, "clip_high"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"clip_ratio_c": 1.1}, "clip_ratio_c"),
        ({"loss_mask": torch.full((2, 3), 0.5)}, "loss_mask"),
        ({"logp": torch.tensor([[-1.0, float("nan"), -1.0], [-1.0, -1.0, -1.0]])}, "logp"),
        ({"old_logp": torch.tensor([[-1.0, -1.0, float("-inf")], [-1.0, -1.0, -1.0]])}, "old_logp"),
        ({"advantages": torch.tensor([1.0, float("inf")])}, "advantages"),
        ({"variant": "gmpo", "advantages": torch.ones(2, 3)}, "advantages"),
        ({"normaliser": -1.0}, "normaliser"),
        ({"normaliser": 0.0}, "normaliser"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(over, needle):
    with pytest.raises(ValueError, match=needle):
        policy_loss(**_kw(**over))


def test_all_zero_mask_gives_zero_loss_and_zero_grad():
    for variant in VARIANTS:
        for agg in AGG_MODES:
            logp = torch.full((2, 3), -1.0, requires_grad=True)
            loss, met = policy_loss(
                **_kw(logp=logp, loss_mask=torch.zeros(2, 3, dtype=torch.bool), variant=variant, agg=agg,
                      agg_constant=10.0, **clip_kw(variant))
            )  # fmt: skip
            loss.backward()
            assert float(loss.detach()) == 0.0 and float(met["loss/tokens"]) == 0
            assert bool((logp.grad == 0).all())
            assert all(bool(torch.isfinite(v)) for v in met.values())
    # an empty micro-batch inside a non-empty global batch is fine with the global normaliser
    loss, _ = policy_loss(**_kw(loss_mask=torch.zeros(2, 3, dtype=torch.bool), normaliser=0.0))
    assert float(loss.detach()) == 0.0


def test_garbage_in_padding_never_reaches_loss_or_gradient():
    g = torch.Generator().manual_seed(3)
    clean = -torch.rand(3, 5, generator=g, dtype=F64)
    old = clean - 0.05 * torch.randn(3, 5, generator=g, dtype=F64)
    m = torch.arange(5).unsqueeze(0) < torch.tensor([[5], [2], [0]])
    adv_tok = torch.randn(3, 5, generator=g, dtype=F64)
    bad_old, bad_new, bad_adv = old.clone(), clean.clone(), adv_tok.clone()
    bad_old[~m] = float("-inf")
    bad_new[~m] = 1e30
    bad_adv[~m] = float("nan")
    for variant in ("grpo", "gspo", "gspo_token", "cispo", "sapo", "reinforce"):
        res = []
        for new, o, a in ((clean, old, adv_tok), (bad_new, bad_old, bad_adv)):
            logp = new.clone().requires_grad_()
            loss, met = policy_loss(
                logp,
                o,
                a,
                m,
                variant=variant,
                agg="seq-mean-token-mean",
                ref_logp=o,
                kl_coef=0.1,
                **clip_kw(variant),
            )
            (grad,) = torch.autograd.grad(loss, logp)
            res.append((loss.detach(), grad, met))
        torch.testing.assert_close(res[0][0], res[1][0])
        torch.testing.assert_close(res[0][1], res[1][1])
        for k in res[0][2]:
            torch.testing.assert_close(res[0][2][k], res[1][2][k], msg=k)


def test_huge_log_ratio_gives_finite_gradients():
    old = torch.tensor([[-200.0, -1.0]], dtype=torch.float32)
    m = torch.ones(1, 2, dtype=torch.bool)
    for variant in ("grpo", "cispo", "sapo", "gspo"):
        for a in (1.0, -1.0):
            logp = torch.tensor([[-0.1, -1.0]], requires_grad=True)
            loss, met = policy_loss(
                logp, old, torch.tensor([a]), m, variant=variant, agg="token-mean", **clip_kw(variant)
            )
            loss.backward()
            assert torch.isfinite(loss) and bool(torch.isfinite(logp.grad).all()), variant
            assert all(bool(torch.isfinite(v)) for v in met.values())


def test_bf16_inputs_are_computed_in_fp32():
    logp = torch.full((2, 4), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, met = policy_loss(
        logp, logp.detach(), torch.ones(2, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bool),
        variant="grpo", clip_low=0.2, clip_high=0.2, agg="token-mean",
    )  # fmt: skip
    loss.backward()
    assert loss.dtype == torch.float32 and logp.grad.dtype == torch.bfloat16
    assert float(met["loss/tokens"]) == 8


@settings(max_examples=20, deadline=None)
@given(batch=batches(min_b=2, max_b=5, max_t=7), token_adv=st.booleans(), weights=st.booleans())
def test_zero_grad_and_clip_fractions_match_autograd(batch, token_adv, weights):
    logp0, adv, m = batch
    g = torch.Generator().manual_seed(int(adv.numel() * 1000 + m.sum()))
    old = logp0 + 0.3 * torch.randn(logp0.shape, generator=g, dtype=F64)  # off-policy: some tokens clip
    adv = adv.clone()
    adv[0] = 0.0  # one row without signal
    adv_in = adv.unsqueeze(-1) * (1 + torch.rand(m.shape, generator=g, dtype=F64)) if token_adv else adv
    iw = None
    if weights:
        iw = torch.rand(m.shape, generator=g, dtype=F64)
        iw[iw < 0.2] = 0.0
    tokens = int(m.sum())
    for variant in VARIANTS:
        if variant == "gmpo" and token_adv:
            continue
        logp = logp0.clone().requires_grad_()
        extra = {"clip_ratio_c": 1.35} if variant in ("grpo", "gspo", "gspo_token") else {}
        lo, hi = (0.05, 0.06) if variant in ("gspo", "gspo_token") else (0.2, 0.28)
        loss, met = policy_loss(
            logp, old, adv_in, m, variant=variant, clip_low=lo, clip_high=hi, agg="token-mean",
            importance_weights=iw, **extra,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logp)
        zero_by_autograd = int(((grad == 0) & m).sum())
        assert float(met["loss/zero_grad_frac"]) * tokens == pytest.approx(zero_by_autograd), variant
        if variant == "grpo":  # independent count of the clip cases
            r = torch.exp(logp0 - old)
            a = adv_in if token_adv else adv.unsqueeze(-1).expand(m.shape)
            high = int(((a > 0) & (r > 1 + hi) & m).sum())
            dual = int(((a < 0) & (r > 1.35) & m).sum())
            low = int(((a < 0) & (r < 1 - lo) & m).sum())
            assert float(met["loss/clip_frac_high"]) * tokens == pytest.approx(high)
            assert float(met["loss/clip_frac_dual"]) * tokens == pytest.approx(dual)
            assert float(met["loss/clip_frac_low"]) * tokens == pytest.approx(low)
            assert float(met["loss/ratio_min"]) == pytest.approx(float(r[m].min()))
            assert float(met["loss/ratio_max"]) == pytest.approx(float(r[m].max()))
            assert float(met["loss/approx_kl"]) == pytest.approx(float((r - 1 - torch.log(r))[m].mean()))


def test_cispo_two_sided_cap_and_metrics():
    old = torch.zeros(1, 3, dtype=F64)
    logp = torch.tensor([[0.5, 0.0, -0.5]], dtype=F64, requires_grad=True)  # ratios 1.65, 1, 0.61
    m = torch.ones(1, 3, dtype=torch.bool)
    loss, met = policy_loss(logp, old, torch.tensor([1.0], dtype=F64), m, variant="cispo", clip_low=0.2,
                            clip_high=0.28, agg="seq-mean-token-sum")  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -torch.tensor([[1.28, 1.0, 0.8]], dtype=F64))
    assert float(met["loss/clip_frac_high"]) == pytest.approx(1 / 3)
    assert float(met["loss/clip_frac_low"]) == pytest.approx(1 / 3)
    assert float(met["loss/zero_grad_frac"]) == 0
