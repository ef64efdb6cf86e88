"""Layout transforms: padded <-> packed, next-token shift, micro-batch splits and router order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.learner import layout


def _batch(lens: list[int], T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (len(lens), T), generator=g)
    lens_t = torch.tensor(lens)
    ids = torch.where(torch.arange(T) < lens_t.unsqueeze(1), ids, 0)
    return ids, lens_t


def test_pack_layout_and_boundaries():
    ids, lens = _batch([3, 1, 4], T=5)
    p = layout.pack(ids, lens, pad_multiple=2)
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert p.cu_seqlens_padded.tolist() == [0, 4, 6, 10]
    assert p.num_tokens == 10 and p.max_seqlen == 4
    assert p.input_ids[:3].tolist() == ids[0, :3].tolist()
    assert p.input_ids[3] == 0  # padding slot
    assert p.input_ids[4] == ids[1, 0]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    mult=st.sampled_from([1, 2, 4]),
    extra=st.integers(0, 3),
)
def test_pack_unpack_roundtrip(lens, mult, extra):
    T = max(lens) + extra
    ids, lens_t = _batch(lens, T)
    vals = torch.randn(len(lens), T, 3)
    vals = torch.where((torch.arange(T) < lens_t.unsqueeze(1)).unsqueeze(-1), vals, 0.0)
    p = layout.pack(ids, lens_t, pad_multiple=mult)
    assert p.num_tokens % mult == 0
    assert torch.equal(layout.unpack_values(layout.pack_values(vals, p), p, T), vals)
    assert torch.equal(layout.unpack_values(p.input_ids, p, T), ids)


def test_next_token_targets_and_shift_are_inverse_alignment():
    ids, lens = _batch([4, 2], T=5)
    tgt = layout.next_token_targets(ids, lens)
    assert tgt[0].tolist() == [ids[0, 1], ids[0, 2], ids[0, 3], 0, 0]
    assert tgt[1].tolist() == [ids[1, 1], 0, 0, 0, 0]
    per_pos = torch.arange(10.0).view(2, 5) + 1
    tok = layout.shift_to_tokens(per_pos, lens)
    assert tok[0].tolist() == [0, 1, 2, 3, 0]
    assert tok[1].tolist() == [0, 6, 0, 0, 0]


def test_shift_is_differentiable():
    x = torch.randn(2, 4, requires_grad=True)
    layout.shift_to_tokens(x, torch.tensor([4, 2])).sum().backward()
    assert x.grad.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 50), min_size=1, max_size=12), data=st.data())
def test_split_and_restore_order(lens, data):
    lens_t = torch.tensor(lens)
    k = data.draw(st.integers(1, len(lens)))
    balance = data.draw(st.booleans())
    parts = layout.split_micro_batches(lens_t, k, balance=balance)
    assert len(parts) == k and all(p.numel() > 0 for p in parts)
    flat = torch.cat(parts).tolist()
    assert sorted(flat) == list(range(len(lens)))  # whole sequences, each exactly once
    vals = torch.randn(len(lens), 2)
    assert torch.equal(layout.restore_order([vals[p] for p in parts], parts), vals)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=2, max_size=16), data=st.data())
def test_balanced_split_spread_is_at_most_the_longest_sequence(lens, data):
    lens_t = torch.tensor(lens)
    k = data.draw(st.integers(2, len(lens)))
    loads = [int(lens_t[p].sum()) for p in layout.split_micro_batches(lens_t, k, balance=True)]
    assert max(loads) - min(loads) <= max(lens)


def test_contiguous_split_keeps_order():
    parts = layout.split_micro_batches(torch.tensor([5, 1, 1, 1, 9, 2, 3]), 2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6]]


def test_split_rejects_impossible_counts():
    with pytest.raises(ValueError, match="num_micro_batches"):
        layout.split_micro_batches(torch.tensor([3, 4]), 3)


def test_seq_lens_from_mask_requires_right_padding():
    assert layout.seq_lens_from_mask(torch.tensor([[1, 1, 0], [1, 0, 0]])).tolist() == [2, 1]
    with pytest.raises(ValueError, match="right-padded"):
        layout.seq_lens_from_mask(torch.tensor([[0, 1, 1]]))


def test_router_positions_padded_is_sequence_major_and_split_by_sp():
    lens = torch.tensor([3, 2])
    sample, pos = layout.router_token_positions(lens, T=4, packed=None)
    # megatron runs [T, b]: token k is (k % b, k // b); positions beyond a length are padding (-1).
    assert sample.tolist() == [0, 1, 0, 1, 0, -1, -1, -1]
    assert pos.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    s1, p1 = layout.router_token_positions(lens, T=4, packed=None, tp_rank=1, sp_size=2)
    assert s1.tolist() == [0, -1, -1, -1] and p1.tolist() == [2, 2, 3, 3]


def test_router_positions_packed():
    ids, lens = _batch([3, 1], T=3)
    p = layout.pack(ids, lens, pad_multiple=2)
    sample, pos = layout.router_token_positions(lens, T=None, packed=p)
    assert sample.tolist() == [0, 0, 0, -1, 1, -1]
    assert pos.tolist() == [0, 1, 2, 0, 0, 0]
    with pytest.raises(ValueError, match="sequence-parallel"):
        layout.router_token_positions(lens, T=None, packed=p, sp_size=4)
