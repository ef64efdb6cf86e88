"""The data plane's route slicing: each rank receives the sampler's route columns of its own pipeline
stage's MoE layers, whether the sampler returned one column per model layer or per MoE layer."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout import Completion
from megagrpo.trainer.rows import RouteSlices

# 6 model layers, layers 0 and 3 dense; two stages: MoE layers 0-1 (model 1, 2) and 2-3 (model 4, 5)
SLICES = RouteSlices(moe_layers=(1, 2, 4, 5), num_layers=6, stage=((0, 1), (2, 3)))


def _completion(width: int) -> Completion:
    routes = torch.arange(7 * width * 2, dtype=torch.int32).view(7, width, 2)
    return Completion(0, 0, torch.arange(3), torch.arange(4), torch.zeros(4), "stop", "some text", routes)


@pytest.mark.parametrize("width, cols", [(6, ([1, 2], [4, 5])), (4, ([0, 1], [2, 3]))])
def test_each_stage_gets_its_moe_layers_columns_and_no_text(width, cols):
    c = _completion(width)
    for rank, want in enumerate(cols):
        got = SLICES.slice(rank, c)
        assert torch.equal(got.routes, c.routes[:, want]) and got.routes.is_contiguous()
        assert got.text == "" and torch.equal(got.output_ids, c.output_ids)
    assert c.text == "some text" and c.routes.shape[1] == width  # the owner's copy is untouched


def test_a_completion_without_routes_passes_through():
    c = _completion(4)
    c.routes = None
    assert SLICES.slice(1, c).routes is None


def test_routes_of_another_model_are_named():
    with pytest.raises(MegagrpoError, match="routes of 5 layers.*4 MoE layers"):
        SLICES.slice(0, _completion(5))


def test_the_owner_s_check_names_the_row_and_what_does_not_fit():
    """Issue 25, item 18: `RouteSlices.check` runs on the owner before any bytes move (shapes only)."""
    checked = RouteSlices(moe_layers=(1, 2, 4, 5), num_layers=6, stage=((0, 1), (2, 3)), topk=2)
    for width in (4, 6):
        checked.check(_completion(width))
    c = _completion(5)
    c.prompt_index, c.sample_index = 3, 1
    with pytest.raises(MegagrpoError, match=r"^the routes of prompt 3 sample 1: .*routes of 5 layers"):
        checked.check(c)
    c = _completion(4)
    c.routes = c.routes[:6]  # 7 tokens, 6 route rows
    with pytest.raises(MegagrpoError, match=r"are torch.int32 \(6, 4, 2\); expected int \[7 tokens"):
        checked.check(c)
    c = _completion(4)
    c.routes = torch.cat([c.routes, c.routes], dim=2)
    with pytest.raises(MegagrpoError, match="top-k 4; the learner's model routes each token to 2 experts"):
        checked.check(c)
    c.routes = None
    checked.check(c)
