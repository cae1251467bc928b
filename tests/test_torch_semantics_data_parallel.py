"""torch's DataParallel tests, ported to plait.DataParallel on CPU "devices" (threads).

Each test names its source in torch's test/distributed/test_data_parallel.py. torch's GPU ids
become ``["cpu"] * 2`` here; the CUDA-only checks (device placement, streams, NCCL) are listed in
NOT_PORTED. The BatchNorm and race checks at the end are plait's own, against a by-hand oracle:
the same module run on each chunk of the batch, one copy per replica.
"""

from __future__ import annotations

import copy
import gc
import io
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.data_parallel import DataParallel, data_parallel, gather, parallel_apply, replicate, scatter

SRC = "test/distributed/test_data_parallel.py"
CPU2 = ["cpu", "cpu"]
D = torch.float64

NOT_PORTED = {
    f"{SRC}::TestDataParallel::test_data_parallel_complex":
        "NCCL and CUDA only; asserts the real view torch's CUDA broadcast gave complex parameters",
    f"{SRC}::TestDataParallel::test_scatter_gpu": "the CUDA input variant of test_scatter_cpu (ported)",
    f"{SRC}::TestDataParallel::test_gather_gpu": "gathers onto a CUDA device; test_gather_cpu is ported",
}


def test_data_parallel_buffers_requiring_grad():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_buffers_requiring_grad

    A buffer that requires grad is broadcast differentiably: its gradient sums over replicas."""  # noqa: E501
    class M(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.clone().detach())

        def forward(self, x):
            return x * self.t_rg + self.t_not_rg

    m = M(torch.randn(10, dtype=D, requires_grad=True))
    dpm = DataParallel(m, CPU2)
    inp = torch.randn(2, 10, dtype=D)
    assert torch.autograd.gradcheck(lambda t: dpm(inp), (m.t_rg,))
    dpm(inp).sum().backward()
    torch.testing.assert_close(m.t_rg.grad, inp.sum(0), rtol=0, atol=0)  # both rows, not only replica 0's


def test_data_parallel_rnn():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_rnn

    An LSTM (its flat weight list is per replica) runs under no_grad and then trains as one module."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(6, 8, 1, batch_first=True, bidirectional=True, dtype=D)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=10)
        out = model(torch.ones(4, 4, 6, dtype=D))
        F.mse_loss(out[0], torch.zeros_like(out[0])).backward()
        opt.step()

    torch.manual_seed(0)
    with torch.no_grad():
        model = M()
        model_dp = DataParallel(copy.deepcopy(model), CPU2)
        model_dp(torch.rand(2, 4, 6, dtype=D))  # no crash with grad disabled
    step(model)
    step(model_dp)
    for p1, p2 in zip(model.parameters(), model_dp.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-12, atol=1e-12)


def test_data_parallel_lazy_linear():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_lazy_linear"""
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        DataParallel(nn.LazyLinear(10), CPU2)(torch.rand(10, 10))


def test_parallel_apply():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_parallel_apply"""
    l1, l2 = nn.Linear(10, 5, dtype=D), nn.Linear(10, 5, dtype=D)
    i1, i2 = torch.randn(2, 10, dtype=D), torch.randn(2, 10, dtype=D)
    want = (l1(i1), l2(i2))
    for inputs in [((i1,), (i2,)), (i1, i2)]:  # a tuple of arguments, or the single argument
        for out, exp in zip(parallel_apply((l1, l2), inputs, None), want):
            torch.testing.assert_close(out, exp, rtol=0, atol=0)


def test_parallel_apply_autocast():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_parallel_apply_autocast

    On CPU: the caller's CPU autocast (bfloat16) reaches the replicas' threads."""
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = (l1(i1), l2(i2))
        outs = parallel_apply((l1, l2), (i1, i2), None, CPU2)
    for out, exp in zip(outs, want):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, exp, rtol=0, atol=0)


def test_parallel_apply_passes_exception():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_parallel_apply_passes_exception"""  # noqa: E501
    class M(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    m = M()
    with pytest.raises(KeyError, match="Caught KeyError in replica \\d on device cpu.\nOriginal Traceback"
                                       "[\\s\\S]+wonderful"):
        parallel_apply(modules=(m, m), inputs=(None, None))


def test_data_parallel_multiple_input():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_multiple_input"""
    class M(nn.Module):
        def forward(self, var1, var2, float1, var3=None):
            return float1 * (var1 * var2) if var3 is None else float1 * (var1 * var2 + var3)

    m = M()
    var1 = torch.randn(5, 5, dtype=D, requires_grad=True)
    var2 = torch.randn(5, 5, dtype=D, requires_grad=True)
    var3 = torch.randn(5, 5, dtype=D)
    float1 = torch.randn(1).item()

    def check(out, expected, g1, g2):
        var1.grad, var2.grad = None, None
        out.sum().backward()
        for got, want in [(out, expected), (var1.grad, g1), (var2.grad, g2)]:
            torch.testing.assert_close(got, want, rtol=0, atol=0)

    for kw in [{}, {"var3": var3}]:
        var1.grad, var2.grad = None, None
        expected = m(var1, var2, float1, **kw)
        expected.sum().backward()
        want = (expected.detach(), var1.grad.clone(), var2.grad.clone())
        for devices in [CPU2, ["cpu"]]:
            check(data_parallel(m, (var1, var2, float1), devices, module_kwargs=kw or None), *want)
            check(DataParallel(M(), devices)(var1, var2, float1, **kw), *want)


def test_data_parallel_small_back():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_small_back"""
    lin = nn.Linear(10, 5, dtype=D)
    i = torch.randn(20, 10, dtype=D)
    torch.testing.assert_close(data_parallel(lin, i, CPU2), lin(i), rtol=0, atol=0)


def test_data_parallel_model_device():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_model_device

    On CPU: the devices[0] check runs at each forward (module and functional forms), so a module
    moved after wrapping is refused, and one moved back runs."""
    inp = torch.randn(2, 2)
    msg = "module must have its parameters and buffers on device cpu"
    for m in (nn.Linear(2, 2, device="meta"), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))):
        with pytest.raises(RuntimeError, match=msg):
            DataParallel(m, CPU2)(inp)
        with pytest.raises(RuntimeError, match=msg):
            data_parallel(m, inp, CPU2)
    dpm = DataParallel(nn.Linear(2, 2), CPU2).to("meta")
    with pytest.raises(RuntimeError, match=msg):
        dpm(inp)
    dpm.to_empty(device="cpu")(inp)


def test_data_parallel_model_no_refcycles():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_model_no_refcycles"""  # noqa: E501
    gc.collect()
    model = DataParallel(nn.Sequential(nn.Linear(1, 1)), CPU2)
    model(torch.randn(2, 1))
    assert gc.collect() == 0


def test_data_parallel_no_grad():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_no_grad

    Grad mode reaches the replicas' threads."""
    seen = []

    class Layer(nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x

    i = torch.randn(20, 10)
    with torch.no_grad():
        data_parallel(Layer(), i, CPU2)
    assert seen == [False, False]
    data_parallel(Layer(), i, CPU2)
    assert seen[2:] == [True, True]


def test_data_parallel():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel"""
    lin = nn.Linear(10, 5, dtype=D)
    i = torch.randn(20, 10, dtype=D)
    expected = lin(i)
    expected.sum().backward()
    grads = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    out = data_parallel(lin, i, CPU2)
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for g, p in zip(grads, lin.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-15, atol=1e-15)


def test_data_parallel_sparse():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_sparse

    The replicas' sparse gradients sum into a sparse gradient."""
    emb = nn.Embedding(10, 5, sparse=True, dtype=D)
    i = torch.randint(10, (20, 5))
    expected = emb(i)
    expected.sum().backward()
    want = emb.weight.grad.coalesce()
    emb.zero_grad()
    out = data_parallel(emb, i, CPU2)
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert emb.weight.grad.is_sparse
    torch.testing.assert_close(emb.weight.grad.coalesce(), want, rtol=0, atol=0)


def _nested(x):
    return [x, (x.sin(), x.cos(), [x.add(1)]), x, OrderedDict(a=x, b=[x.sin()])]


class _Nested(nn.Module):
    def forward(self, x):
        return _nested(x)


def test_data_parallel_nested_output():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_nested_output"""
    i = torch.randn(2, 2, dtype=D)
    out = data_parallel(_Nested(), i, CPU2)
    torch.testing.assert_close(out, _nested(i), rtol=0, atol=0)
    assert isinstance(out[1], tuple) and isinstance(out[1][2], list) and isinstance(out[3], OrderedDict)
    assert list(out[3]) == ["a", "b"] and isinstance(out[3]["b"], list)


def test_data_parallel_nested_input():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_nested_input"""
    class Net(nn.Module):
        def forward(self, *inp):
            return inp[1][0]

    i = torch.randn(20, 3, dtype=D)
    inp = (i.cos(), (i.sin(), i), i.sin())
    torch.testing.assert_close(data_parallel(Net(), inp, CPU2), i.sin(), rtol=0, atol=0)


def test_data_parallel_module_zero_inputs():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_module_zero_inputs

    A forward without inputs runs once (it returned one copy per device before)."""
    class M(nn.Module):
        def forward(self):
            t = torch.eye(2, 3)
            return t + (1 - t)

    want = torch.ones(2, 3)
    for out in (DataParallel(M(), ["cpu"])(), DataParallel(M(), CPU2)(), data_parallel(M(), None, ["cpu"]),
                data_parallel(M(), (), CPU2)):
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_data_parallel_device_args_cpu():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_device_args

    On CPU: output_device and devices given as torch.device objects (or as device_ids=)."""
    lin = nn.Linear(10, 5, dtype=D)
    i = torch.randn(20, 10, dtype=D, requires_grad=True)
    cpu = torch.device("cpu")
    torch.testing.assert_close(data_parallel(lin, i, device_ids=CPU2, output_device=cpu), lin(i))
    torch.testing.assert_close(DataParallel(lin, device_ids=[cpu, cpu], output_device=cpu)(i), lin(i))


def test_data_parallel_function_deletion():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_data_parallel_function_deletion

    A gradient penalty (double backward through the replicas); the unused bias gets a zero gradient."""
    net = nn.Linear(4, 1, dtype=D)
    dpn = DataParallel(net, CPU2)
    x = torch.ones(2, 4, dtype=D, requires_grad=True)
    out = dpn(x)
    gx = torch.autograd.grad(out, x, grad_outputs=torch.ones_like(out), create_graph=True)[0]
    gx.mean().backward()
    torch.testing.assert_close(net.weight.grad, torch.full((1, 4), 0.25, dtype=D), rtol=0, atol=0)
    torch.testing.assert_close(net.bias.grad, torch.zeros(1, dtype=D), rtol=0, atol=0)


def test_scatter_cpu():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_scatter_cpu"""
    x = torch.randn(4, 4, dtype=D).requires_grad_()
    result = scatter(x, CPU2)
    assert len(result) == 2
    torch.testing.assert_close(result[0], x[:2])
    torch.testing.assert_close(result[1], x[2:])
    grad = torch.full_like(result[0], 2.0)
    result[0].backward(grad)
    torch.testing.assert_close(x.grad, torch.cat([grad, torch.zeros_like(grad)]))
    assert torch.autograd.gradgradcheck(lambda y: scatter(y, CPU2), (x,))


def test_gather_cpu():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_gather_cpu

    Gathers rows; scalars become a vector, with torch's warning."""
    parts = (torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(2, 4, dtype=D, requires_grad=True))
    result = gather(parts, "cpu")
    torch.testing.assert_close(result, torch.cat(parts))
    grad = torch.randn(4, 4, dtype=D)
    result.backward(grad)
    torch.testing.assert_close(parts[0].grad, grad[:2])
    torch.testing.assert_close(parts[1].grad, grad[2:])
    assert torch.autograd.gradgradcheck(lambda a, b: gather((a, b), "cpu"), parts)
    scalars = (torch.randn((), dtype=D, requires_grad=True), torch.randn((), dtype=D, requires_grad=True))
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        result = gather(scalars, "cpu")
    assert result.shape == (2,)
    result.backward(torch.tensor([3.0, 5.0], dtype=D))
    assert (scalars[0].grad.item(), scalars[1].grad.item()) == (3.0, 5.0)


def test_gather_different_len_dicts():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_gather_different_len_dicts

    Through DataParallel too: replicas returning dicts of other keys are refused, not merged."""
    parts = ({"a": torch.randn(1, 2)}, {"b": torch.randn(1, 2), "a": torch.randn(1, 2)})
    with pytest.raises(ValueError, match="same number of keys"):
        gather(parts, "cpu")

    class M(nn.Module):
        def forward(self, x):
            return {"first": x} if x[0, 0] > 0 else {"first": x, "other": x}

    with pytest.raises(ValueError, match="same number of keys"):
        DataParallel(M(), CPU2)(torch.tensor([[1.0], [-1.0]]))


def test_replicate():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_replicate"""
    module = nn.Linear(10, 5, dtype=D)
    inp = torch.randn(2, 10, dtype=D)
    for devices in [("cpu", "cpu"), CPU2]:
        for replica in replicate(module, devices):
            torch.testing.assert_close(replica(inp), module(inp), rtol=0, atol=0)


def test_replicate_buffers():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_replicate_buffers

    On CPU: each replica has its own buffers (the first shares the module's, as torch's)."""
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    replicas = replicate(net, CPU2)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        mine = [getattr(r.bn, name) for r in replicas]
        assert mine[0] is getattr(net.bn, name)
        assert mine[1].data_ptr() != mine[0].data_ptr() and mine[1].device.type == "cpu"


def test_zero_grad():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_zero_grad"""
    class Net(nn.Module):
        def forward(self, x):
            self.zero_grad()
            return x

    with pytest.warns(UserWarning, match=r"Calling \.zero_grad\(\) from a module created with "
                                         r"nn\.DataParallel\(\) has no effect"):
        DataParallel(Net(), CPU2)(torch.rand(4, 3))


def test_autocast():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_autocast (CPU autocast)"""
    class Model(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)

        @torch.autocast("cpu", dtype=torch.bfloat16)
        def forward(self, x):
            return super().forward(x)

    assert DataParallel(Model(), CPU2)(torch.randn(8, 8)).dtype is torch.bfloat16


def test_save_replica_module():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_save_replica_module"""
    module = nn.Linear(8, 8)
    for detach in (False, True):
        torch.save(replicate(module, CPU2, detach=detach), io.BytesIO())


def test_strided_grad_layout():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_strided_grad_layout

    On CPU, float64 only (torch's half variants need cuDNN): the summed gradients keep each
    parameter's memory format and equal one process's."""
    class ConvNet(nn.Module):
        def __init__(self, layouts):
            super().__init__()
            sizes = [(8, 16), (16, 32), (32, 16), (16, 8)]
            self.convs = nn.ModuleList(nn.Conv2d(i, o, (2, 2), dtype=D).to(memory_format=f)
                                       for (i, o), f in zip(sizes, layouts))

        def forward(self, x):
            for c in self.convs:
                x = c(x)
            return x

    formats = ([torch.contiguous_format] * 4, [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
               [torch.channels_last] * 4)
    inp, target = torch.randn(16, 8, 8, 8, dtype=D), torch.randn(16, 8, 4, 4, dtype=D)
    for layouts in formats:
        m = ConvNet(layouts)
        m_dp = DataParallel(copy.deepcopy(m), CPU2)
        opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, m_dp)]
        for _ in range(2):  # the second step accumulates into zeroed gradients
            F.mse_loss(m(inp), target).backward()
            F.mse_loss(m_dp(inp), target).backward()
            for c, c_dp, f in zip(m.convs, m_dp.module.convs, layouts):
                assert c_dp.weight.grad.is_contiguous(memory_format=f)
                for p, p_dp in zip(c.parameters(), c_dp.parameters()):
                    torch.testing.assert_close(p_dp.grad, p.grad, rtol=1e-12, atol=1e-12)
            for o in opts:
                o.step()
                o.zero_grad()


def test_parameter_list_dict_replica():
    """torch: test/distributed/test_data_parallel.py::TestDataParallel::test_parameter_list_dict_replica

    A replica's ParameterList / ParameterDict entries are differentiable copies (non-leaf)."""
    p1, p2 = nn.Parameter(torch.rand(10)), nn.Parameter(torch.rand(10))
    seen = []

    class MyMod(nn.Module):
        def __init__(self, data, keys):
            super().__init__()
            self.data, self.keys = data, keys

        def forward(self, inp):
            for key, p in zip(self.keys, (p1, p2)):
                got = self.data[key]
                seen.append(torch.equal(got, p) and got.requires_grad and got.grad_fn is not None)
            return inp

    DataParallel(MyMod(nn.ParameterList([p1, p2]), (0, 1)), CPU2)(torch.randn(8, 8))
    DataParallel(MyMod(nn.ParameterDict({"0": p1, "1": p2}), ("0", "1")), CPU2)(torch.randn(8, 8))
    assert seen == [True] * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("call", ["positional", "kwargs_only", "kwargs_only_empty_list",
                                  "kwargs_only_empty_dict", "kwargs_only_empty_tuple"])
def test_data_parallel_module(call, dtype):
    """torch: test/distributed/test_data_parallel.py::TestDataParallelDeviceType::test_data_parallel_module
    (and its _kwargs_only, _kwargs_only_empty_list, _empty_dict and _empty_tuple variants), on CPU."""
    lin = nn.Linear(10, 5, dtype=dtype)
    i = torch.randn(20, 10, dtype=dtype)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = lin

        def forward(self, input):
            return self.l(input if isinstance(input, torch.Tensor) else input["data"])

    empty = {"kwargs_only_empty_list": [], "kwargs_only_empty_dict": {}, "kwargs_only_empty_tuple": ()}
    net = DataParallel(Net(), CPU2)
    if call == "positional":
        out = DataParallel(lin, CPU2)(i)
    elif call == "kwargs_only":
        out = net(input=i)
    else:
        out = net(input={"data": i, "unused": empty[call]})
    torch.testing.assert_close(out, lin(i), rtol=0, atol=0)


# ----------------------------------------------------------------------- plait's own: replicas' state
def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4, dtype=D), nn.BatchNorm1d(4, dtype=D), nn.ReLU())


def test_batchnorm_running_stats_as_torch_replicas():
    """Each replica normalizes its chunk with its own batch statistics, and the running statistics
    end as replica 0's (the first chunk's), once per forward, every time: the replicas' threads
    shared one module before, and the statistics were wrong in some forwards (a race)."""
    model, oracle = _bn_model(), _bn_model()
    dp = DataParallel(model, ["cpu"] * 3)
    torch.manual_seed(1)
    for _ in range(30):
        x = torch.randn(8, 3, dtype=D)  # chunks of 3, 3 and 2 rows
        chunks = x.chunk(3)
        others = [copy.deepcopy(oracle)(c) for c in chunks[1:]]  # their updates are dropped
        want = torch.cat([oracle(chunks[0]), *others])  # replica 0's are the module's own
        torch.testing.assert_close(dp(x), want, rtol=0, atol=0)
        for (name, got), ref in zip(model.state_dict().items(), oracle.state_dict().values()):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)
    assert int(model[1].num_batches_tracked) == 30


def test_small_batch_runs_on_fewer_replicas():
    """A batch of fewer rows than devices runs on as many replicas as it has chunks (torch's
    scatter), equal to one process; it was refused before."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2, dtype=D)
    x = torch.randn(3, 3, dtype=D, requires_grad=True)
    out = DataParallel(lin, ["cpu"] * 4)(x)
    # The oracle: the module on each row apart, as the replicas run it (BLAS may sum a 1-row batch
    # in another order than a 3-row one: 1 ulp).
    want = torch.cat([lin(row) for row in x.chunk(3)])
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g, g_want, rtol=0, atol=0)
