"""Route tables for replay: sampler-route validation (bad input -> MegagrpoError), lookup with fillers."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.moe.routes import filler_routes, lookup, real_tokens, validate_sampler_routes

E, K, L, T = 4, 2, 3, 5
LENS = torch.tensor([5, 3])


def _routes() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(2 * T * L)]).view(2, T, L, K)
    real = real_tokens(LENS, T)
    last = torch.arange(T).unsqueeze(0) == (LENS - 1).unsqueeze(1)
    return torch.where((real & ~last)[..., None, None], r, torch.full_like(r, -1)).to(torch.int32)


def _check(r, **kw):
    args = dict(T=T, moe_layers=[0, 1, 2], num_layers=3, topk=K, num_experts=E)
    args.update(kw)
    return validate_sampler_routes(r, LENS, **args)


def test_valid_routes_pass_and_moe_layers_are_selected():
    r = _routes()
    assert torch.equal(_check(r), r.long())
    # the table holds every layer, only layers 0 and 2 are MoE: their rows are taken
    out = _check(r, moe_layers=[0, 2], num_layers=3)
    assert torch.equal(out, r[:, :, [0, 2]].long())


def test_a_pipeline_stage_s_route_columns_pass_only_with_its_layer_count():
    r = _routes()
    stage = r[:, :, [1, 2]]
    assert torch.equal(_check(stage, route_layers=[1, 2]), stage.long())
    with pytest.raises(MegagrpoError, match="sliced for another pipeline stage"):
        _check(stage, route_layers=[0])


@pytest.mark.parametrize(
    "case, match",
    [
        ("shape", "shape"),
        ("layers", "layers"),
        ("topk", "top-k"),
        ("range", "expert id"),
        ("negative", "expert id"),
        ("repeat", "repeats"),
        ("partial", "missing in some"),
        ("float", "integer"),
    ],
)
def test_bad_routes_raise(case, match):
    r = _routes()
    if case == "shape":
        r = r[:, :4]
    elif case == "layers":
        r = r[:, :, :2]
    elif case == "topk":
        r = r[..., :1]
    elif case == "range":
        r = r.clone()
        r[0, 0, 1, 0] = E
    elif case == "negative":
        r = r.clone()
        r[0, 0, 1, 0] = -3
    elif case == "repeat":
        r = r.clone()
        r[1, 1, 0] = torch.tensor([2, 2])
    elif case == "partial":
        r = r.clone()
        r[1, 0, 2] = -1
    elif case == "float":
        r = r.float()
    with pytest.raises(MegagrpoError, match=match):
        _check(r)


def test_padding_content_is_ignored():
    r = _routes()
    r[1, 4] = 99  # beyond seq_lens[1] = 3: never replayed, never validated
    _check(r)


def test_lookup_fills_padding_and_missing_and_reports_missing():
    table = _routes().long()
    rows = torch.tensor([0, 1, -1, 1, 0])
    pos = torch.tensor([1, 2, 0, 0, 4])  # (1, 2) is sample 1's last token (-1 in the table)
    got, missing = lookup(table, rows, pos, 1, num_experts=E)
    assert torch.equal(got[0], table[0, 1, 1]) and torch.equal(got[3], table[1, 0, 1])
    assert missing.tolist() == [False, True, False, False, True]
    # fillers are keyed by the token (row * T + pos), padding slots by their position
    fill = filler_routes(torch.tensor([1 * T + 2, 0, 0 * T + 4]), K, E)
    assert torch.equal(got[[1, 2, 4]], fill)
    # a filler is a valid route: distinct experts in range
    assert (got >= 0).all() and (got < E).all() and (got[:, 0] != got[:, 1]).all()
