"""Context parallelism against full attention and against a single process.

Attention: each algorithm's output and its gradients for q, k and v, at cp=2 and cp=4, causal
and not, causal within sliding windows shorter than a rank's chunks and longer, with sequence
lengths that split evenly and lengths that do not (ranks then hold up
to two tokens more than others), with grouped-query attention, against torch's own
scaled_dot_product_attention on the whole sequence. float64: only the order of sums differs,
``atol=1e-12``.

Whole models: plait's GPT trained with cp=2 alone (DDP over cp), cp2 x fsdp2 (ZeRO-3 sharded
over fsdp x cp), cp2 x tp2 (sequence parallel) and cp2 x pp2, against one process on the same
global batch in float64: the logits of each rank's tokens, and every parameter after each of
two SGD steps (SGD: an update is the gradient times the rate, so a wrong gradient scale cannot
hide as it would under Adam's normalisation), at ``rtol=1e-9``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import loss64, step_and_compare

from plait.testing import cached_mesh

TOL = {"rtol": 1e-9, "atol": 1e-12}
TINY = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64}
LR = 0.5


def _attention_cases(cases: list[tuple[str, bool, int, int, int | None]]) -> list[float]:
    """The worst |difference| over output and gradients of each (algorithm, causal, seq, kv heads,
    sliding window)."""
    import torch.distributed as dist

    from plait.cp import ALGORITHMS, CPGroup

    cp = CPGroup.of(cached_mesh(cp=dist.get_world_size()))
    worst = []
    for algorithm, causal, seq, kv_heads, window in cases:
        g = torch.Generator().manual_seed(seq * 10 + kv_heads)
        q = torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        if window is None:
            want = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
        else:  # a query sees itself and the window - 1 keys before it
            seen = torch.ones(seq, seq, dtype=torch.bool).tril().triu(1 - window)
            want = F.scaled_dot_product_attention(*full, attn_mask=seen, enable_gqa=True)
        (want * dout).sum().backward()
        layout = cp.layout(seq)
        mine = [layout.shard(t, 2).requires_grad_() for t in (q, k, v)]
        got = ALGORITHMS[algorithm](*mine, cp, layout, causal=causal, window=window)
        assert got.shape == (2, 4, layout.local_len(), 8) and got.dtype == torch.float64
        (got * layout.shard(dout, 2)).sum().backward()
        diffs = [(got - layout.shard(want, 2)).abs().max().item()]
        diffs += [(m.grad - layout.shard(f.grad, 2)).abs().max().item() for m, f in zip(mine, full)]
        worst.append(max(diffs))
    return worst


def _cases(n: int) -> list[tuple[str, bool, int, int, int | None]]:
    # 16 tokens split evenly at cp=2 and 4; 19 do not (chunks of 5/5/5/4 or 3/3/3/2/2/2/2/2).
    # Windows of 3 (shorter than every chunk: whole blocks fall outside) and 6 (longer).
    algorithms = ("ring", "allgather", "ulysses")
    plain = [(a, causal, seq, kv, None) for a in algorithms for causal in (True, False)
             for seq in (16, 19) for kv in ((4,) if a == "ulysses" and n == 4 else (2, 4))]
    return plain + [(a, True, seq, 4 if a == "ulysses" and n == 4 else 2, window) for a in algorithms
                    for seq, window in ((19, 3), (16, 6))]


@pytest.mark.parametrize("n", [2, 4])
def test_attention_algorithms_match_full_attention(pools, n):
    cases = _cases(n)
    worst = pools[n].run(_attention_cases, cases)
    for rank, errs in enumerate(worst):
        for case, err in zip(cases, errs):
            assert err < 1e-12, f"cp={n} rank {rank} {case}: {err}"


def _refusals() -> list[str]:
    import plait
    from plait.cp import CPGroup, ulysses_attention

    mesh = cached_mesh(cp=2)
    cp = CPGroup.of(mesh)
    seen = []
    q = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="heads over cp=2: 3 query") as e:
        ulysses_attention(q, q, q, cp, cp.layout(16))
    seen.append(str(e.value))
    with pytest.raises(ValueError, match="18 tokens do not divide by 4") as e:
        plait.cp.shard(torch.zeros(2, 18), mesh)
    seen.append(str(e.value))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no module whose class name ends in 'Attention'"):
        plait.context_parallel(model, mesh)
    return seen


def test_refusals_name_what_and_why(pools):
    assert all(pools[2].run(_refusals))


def _mask_and_dropout_refused() -> bool:
    import plait
    from plait.models.gpt import GPT, GPTConfig

    model = plait.context_parallel(GPT(GPTConfig(**{**TINY, "dropout": 0.1})), cached_mesh(cp=2))
    x = plait.cp.shard(torch.zeros(2, 16, dtype=torch.long), cached_mesh(cp=2))
    with pytest.raises(ValueError, match="attention dropout"):
        model(x)
    model.eval()  # no dropout: the same model runs
    assert model(x).shape == (2, 8, 64)
    return True


def test_attention_dropout_is_refused_not_ignored(pools):
    assert all(pools[2].run(_mask_and_dropout_refused))


def _batch(step: int, b: int = 4, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(100 + step))
    return w[:, :-1], w[:, 1:]


def _model_parity(algorithm: str, fsdp: int = 1, tp: int = 1, pp: int = 1, cfg_kw: dict | None = None,
                  ac: str | None = None, steps: int = 2) -> list[float]:
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.plans import gpt_plan
    from plait.state.materialize import init_weights
    from plait.tp.apply import loss_fn_for

    mesh = cached_mesh(fsdp=fsdp, tp=tp, cp=2, pp=pp)
    cfg = GPTConfig(**{**TINY, **(cfg_kw or {})})
    oracle = init_weights(GPT(cfg).to(torch.float64), seed=3)
    model = init_weights(GPT(cfg).to(torch.float64), seed=3)
    pipeline = {"pp_microbatches": 2, "loss_fn": loss64} if pp > 1 else {}
    plan = plait.ParallelPlan(tp=gpt_plan(cfg) if tp > 1 else None, sequence_parallel=tp > 1, cp=algorithm,
                              data="fsdp" if fsdp > 1 else "ddp", ac=ac, seed=3, **pipeline)
    net = plait.parallelize(model, mesh, plan)
    loss_fn = loss64 if tp == 1 or pp > 1 else loss_fn_for(net)
    opt_ref, opt = torch.optim.SGD(oracle.parameters(), lr=LR), torch.optim.SGD(net.parameters(), lr=LR)
    data_rank, data_size = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    losses = []
    for step in range(steps):
        idx, tgt = _batch(step)
        want_logits = oracle(idx)
        loss64(want_logits, tgt).backward()
        mine = slice(data_rank * len(idx) // data_size, (data_rank + 1) * len(idx) // data_size)
        x, y = plait.cp.shard(idx[mine], mesh), plait.cp.shard(tgt[mine], mesh)
        if pp > 1:
            loss = net.step(x, y)
        else:
            logits = net(x)
            if step == 0 and tp == 1:  # this rank's tokens of the whole model's logits (tp: vocab shards)
                torch.testing.assert_close(logits, plait.cp.shard(want_logits[mine].detach(), mesh), **TOL)
            loss = loss_fn(logits, y)
            loss.backward()
        step_and_compare(net, oracle, (opt_ref, opt), TOL, f"after SGD step {step + 1}")
        losses.append(float(loss) if loss is not None else float("nan"))
    # The first forward verified the layout by its numbers (each stage of a pipeline that attends),
    # at float64's bound: an output of each part compared.
    parts = [net] if pp == 1 else list(net.stages.values())
    for part in parts:
        checked = plait.cp.verified(part)
        assert checked is not None and checked.compared >= 1 and checked.worst <= 1, checked
    return losses


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses"])
def test_cp2_trains_like_one_process(pools, algorithm):
    losses = pools[2].run(_model_parity, algorithm, cfg_kw={"n_kv_heads": 2, "tie_embeddings": True})
    # Each rank's loss is the mean over its own tokens; their mean is the whole batch's loss.
    assert losses[0] != losses[1]


def test_cp2_with_activation_checkpointing(pools):
    # Recomputed attention runs context parallel again (the hooks fire on recomputation).
    pools[2].run(_model_parity, "ring", ac="full")


@pytest.mark.parametrize("what,kw", [
    ("fsdp2", {"fsdp": 2}),
    ("tp2-sp", {"tp": 2}),
    ("pp2", {"pp": 2}),
])
def test_cp2_composes(pools, what, kw):
    pools[4].run(_model_parity, "ring", **kw)


def _bytes_per_layer(algorithm: str) -> dict:
    """Bytes the cp collectives counted for one forward and backward of a 2-layer GPT, and what
    each algorithm's theory says one attention layer moves."""
    import plait
    from plait import comm
    from plait.models.gpt import GPT, GPTConfig

    mesh = cached_mesh(cp=2)
    cfg = GPTConfig(**{**TINY, "n_kv_heads": 2})
    # check=False: what training moves; the first forward's numeric check gathers a sequence too
    model = plait.context_parallel(plait.init_weights(GPT(cfg), seed=0), mesh, algorithm, check=False)
    idx, tgt = _batch(0)
    x = plait.cp.shard(idx, mesh)
    with comm.counting() as stats:
        loss64(model(x), plait.cp.shard(tgt, mesh)).backward()
    counted = {op: stats.total(op, "cp") for op in ("send", "all_gather", "reduce_scatter", "all_to_all")}
    b, s, n, d = 4, 8, 2, cfg.head_dim  # this rank's batch and tokens, cp, head size
    # plait's GPT repeats its 2 KV heads to the 4 query heads before calling attention.
    kv = 2 * b * 4 * s * d * 4  # K and V, float32
    q = b * 4 * s * d * 4  # queries (and outputs, and their gradients)
    theory = {
        # forward: cp - 1 sends of K, V; backward: cp - 1 of K, V and cp of their gradients
        "ring": {"send": (n - 1) * kv + (n - 1) * kv + n * kv},
        # the whole sequence's K, V gathered, their gradients reduce-scattered
        "allgather": {"all_gather": n * kv, "reduce_scatter": n * kv},
        # q, k, v to heads and the output back, forward; the same tensors' gradients backward
        "ulysses": {"all_to_all": 2 * (2 * q + kv)},
    }[algorithm]
    # Ulysses trades Q, K and V in one all-to-all: per layer one for them and one for the output,
    # forward, and the same two backward (their gradients).
    calls = {"ulysses": 4}.get(algorithm)
    return {"counted": counted, "per_layer": {op: v * cfg.n_layers for op, v in theory.items()},
            "all_to_alls": (stats.calls("all_to_all", "cp"), None if calls is None else calls * cfg.n_layers)}


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses"])
def test_counted_bytes_equal_theory(pools, algorithm):
    for out in pools[2].run(_bytes_per_layer, algorithm):
        counted = {op: v for op, v in out["counted"].items() if v}
        assert counted == out["per_layer"]
        made, expected = out["all_to_alls"]
        assert expected is None or made == expected


def _saved_activation_bytes(cp: int) -> int:
    """Bytes of the tensors the forward of one global batch's sequences saves for backward on this
    rank (each storage once, parameters left out), at context parallel degree ``cp`` (1: the same
    ring kernel on the whole sequence)."""
    import torch.distributed as dist

    import plait
    from plait.models.gpt import GPT, GPTConfig

    world = dist.get_world_size()
    mesh = cached_mesh(cp=cp, dp=world // cp)
    cfg = GPTConfig(**{**TINY, "seq_len": 64})
    model = plait.context_parallel(plait.init_weights(GPT(cfg), seed=0), mesh)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(plait.cp.shard(idx, mesh))
    del out
    return sum(seen.values())


def test_activation_memory_falls_as_one_over_cp(pools):
    ratios = {}
    for cp in (2, 4):
        one = pools[cp].run(_saved_activation_bytes, 1)[0]
        split = pools[cp].run(_saved_activation_bytes, cp)
        ratios[cp] = [s / one for s in split]
        # Every saved activation scales with the tokens a rank holds.
        assert all(abs(r * cp - 1) < 0.05 for r in ratios[cp]), ratios


def test_an_explicit_mask_counts_as_causal_only_when_it_is_exactly_causal():
    from plait.cp.apply import _plain_causal

    n = 4
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    additive = torch.zeros(n, n, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    assert _plain_causal(causal[None, None], n, n) is True  # Falcon passes its own causal mask
    assert _plain_causal(additive.expand(2, 1, n, n), n, n) is True
    assert _plain_causal(torch.ones(1, 1, n, n, dtype=torch.bool), n, n) is False  # masks nothing
    padded = causal.clone()
    padded[:, 0] = False  # the first token is padding: refused, as before
    assert _plain_causal(padded, n, n) is None
    alibi = additive + torch.arange(n, dtype=torch.float64)  # a bias on the scores, not a mask
    assert _plain_causal(alibi, n, n) is None
    assert _plain_causal(causal[:, :3], n, 3) is None  # keys other than the queries' tokens
    # A sliding window of 2 over the rank's tokens (what transformers builds) is the module's window.
    windowed = causal.triu(-1)
    assert _plain_causal(windowed, n, n, window=2) is True
    assert _plain_causal(windowed, n, n) is None  # no window on the module: not its mask
    assert _plain_causal(windowed, n, n, window=3) is None  # another window than the module's


def test_a_mask_passed_to_every_layer_is_read_once():
    # transformers passes one mask tensor to every layer: on a GPU each reading is a host sync.
    from unittest import mock

    from plait.cp.apply import _mask_verdict

    n = 4
    mask = torch.ones(1, 1, n, n, dtype=torch.bool).tril()
    with mock.patch("torch.equal", wraps=torch.equal) as reads:
        assert [_mask_verdict(mask, n, n, None) for _ in range(8)] == [True] * 8
        assert reads.call_count == 1
        mask[..., 0, 1] = True  # written in place: read again, no longer causal
        assert _mask_verdict(mask, n, n, None) is None
        assert _mask_verdict(mask.clone().tril_(), n, n, None) is True  # another tensor


def test_the_numeric_check_holds_each_dtype_to_its_rounding():
    # float64 and float32 as tensor parallelism's check; a 16-bit dtype anywhere in the run gets
    # the whole-model bound (its rounding adds up over the layers), still half a misplaced position.
    from plait.cp.numeric import HALF_BOUND, bound
    from plait.runtime.tolerance import RTOL, LowestPrecision

    seen = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        with LowestPrecision() as precision:
            torch.ones(2, dtype=torch.float64) + torch.ones(2, dtype=dtype)  # promoted: float64 out
            torch.ones(2, dtype=dtype) * 2
        seen[dtype] = bound(precision)
    assert seen[torch.float64] == RTOL
    assert seen[torch.float32] == pytest.approx(256 * torch.finfo(torch.float32).eps)
    assert seen[torch.bfloat16] == seen[torch.float16] == HALF_BOUND


def _checked_or_not() -> list:
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.state.materialize import init_weights

    mesh = cached_mesh(cp=2)
    out = []
    for check in (True, False):
        net = plait.parallelize(init_weights(GPT(GPTConfig(**TINY)).to(torch.float64), seed=3), mesh,
                                plait.ParallelPlan(cp="ring", cp_check=check))
        net(plait.cp.shard(_batch(0)[0], mesh))
        out.append(plait.cp.verified(net))
    return out


def test_the_plan_switches_the_numeric_check_on_and_off(pools):
    for on, off in pools[2].run(_checked_or_not):
        assert on is not None and on.compared == 1 and on.worst <= 1 and off is None
