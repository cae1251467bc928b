"""DataParallel (threads) against a single-process oracle, with 2 and 4 CPU "devices"."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_params_close, global_batches, make_opt, tiny_gpt, train_single

from plait.data_parallel import DataParallel, scatter
from plait.models.gpt import lm_loss


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_matches_single_process(n):
    want = train_single(tiny_gpt(seed=0), global_batches(5, 8))
    model = tiny_gpt(seed=0)
    dp = DataParallel(model, ["cpu"] * n)
    opt = make_opt(dp.parameters())
    for b in global_batches(5, 8):
        opt.zero_grad()
        lm_loss(dp(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
    assert_params_close({k: v.detach() for k, v in model.state_dict().items()}, want)


def test_outputs_and_grads_match_tied_model():
    ref = tiny_gpt(seed=0, tie_embeddings=True)
    model = tiny_gpt(seed=0, tie_embeddings=True)
    (b,) = global_batches(1, 6)  # 6 rows over 4 devices: uneven chunks 2,2,1,1
    want = ref(b[:, :-1])
    got = DataParallel(model, ["cpu"] * 4)(b[:, :-1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    lm_loss(want, b[:, 1:]).backward()
    lm_loss(got, b[:, 1:]).backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model, ref)]
    assert_params_close(*grads, rtol=1e-5, atol=1e-7, what="gradient of")


def test_scatter_errors_and_structures():
    parts = scatter(({"x": torch.arange(4)}, 3), [torch.device("cpu")] * 2)
    assert parts[1][0]["x"].tolist() == [2, 3] and parts[1][1] == 3
    # as torch's scatter: 3 rows over 4 devices make 3 chunks (Tensor.chunk), not a refusal
    assert [c.shape[0] for c in scatter(torch.zeros(3, 2), [torch.device("cpu")] * 4)] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least one device"):
        DataParallel(torch.nn.Linear(2, 2), [])
