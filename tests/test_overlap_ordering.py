"""Where the overlapped layers' backward runs its wgrad GEMMs and re-gathers, on gloo groups of 2 and 4 ranks.

- ring_reduce_scatter_produce runs during_last_transfer once, after the last produce and before the last wait;
- the column-parallel layer's wgrad GEMM runs there (inside its dgrad ring), with delay_wgrad and main_grad too;
- the row-parallel layer starts the re-gather of the column-parallel input before its own wgrad GEMM, and the
  column layer uses that gather (no second one);
- none of it changes a bit: the pair's outputs and gradients equal those of the same overlapped pair without
  the early re-gather, and its weight gradients the plain pair's; with several micro-batches in flight too;
- nothing is left in the re-gather registry once the graphs are gone.
"""
import gc

import pytest
import torch
import torch.distributed as dist

import nvfp4_dist as nv
from nvfp4_dist import hot_path
from nvfp4_dist.parallel import ColumnParallelLinear, RowParallelLinear, collectives
from nvfp4_dist.parallel import overlap as O
from tests.helpers.distributed import run_distributed

TOKENS_PER_RANK, HIDDEN, FFN_LOCAL = 32, 64, 32
RECIPE = nv.NVFP4Recipe()


class Recorder:
    """Replaces module functions with wrappers that log a tag (and call through) while inside."""

    def __init__(self, **targets):  # tag=(module, name)
        self.targets, self.events = targets, []

    def __enter__(self):
        self.originals = {}
        for tag, (module, name) in self.targets.items():
            original = getattr(module, name)
            self.originals[tag] = (module, name, original)

            def wrapper(*args, _tag=tag, _original=original, **kwargs):
                self.events.append(_tag)
                return _original(*args, **kwargs)
            setattr(module, name, wrapper)
        return self.events

    def __exit__(self, *exc):
        for module, name, original in self.originals.values():
            setattr(module, name, original)


class logged_waits:
    """Makes the ring's exchanges log 'wait' when their transfers are first waited for (gloo returns one work per
    send and receive, NCCL one per exchange)."""

    def __init__(self, events):
        self.events = events

    def __enter__(self):
        self.original = O._exchange
        events = self.events

        class Work:
            def __init__(self, work, first):
                self.work, self.first = work, first

            def wait(self):
                if self.first:
                    events.append("wait")
                return self.work.wait()

        O._exchange = lambda *args: [Work(work, index == 0) for index, work in enumerate(self.original(*args))]

    def __exit__(self, *exc):
        O._exchange = self.original


def check_callback_during_last_transfer(rank, world_size):
    events = []

    def produce(chunk):
        events.append(f"produce {chunk}")
        return torch.full((4, 3), float(rank + chunk), dtype=torch.bfloat16)

    with logged_waits(events):
        summed = O.ring_reduce_scatter_produce(produce, during_last_transfer=lambda: events.append("callback"))
    order = O.reduce_scatter_order(rank, world_size)
    expected = [f"produce {order[0]}"]
    for chunk in order[1:-1]:
        expected += [f"produce {chunk}", "wait"]
    expected += [f"produce {order[-1]}", "callback", "wait"]
    assert events == expected, events
    assert torch.equal(summed, torch.full((4, 3), float(sum(r + rank for r in range(world_size))),
                                          dtype=torch.bfloat16))


def inputs(world_size, rank, in_features, out_features, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(world_size * TOKENS_PER_RANK, in_features, generator=generator) * torch.logspace(-1, 1, in_features)
    dy = torch.randn(world_size * TOKENS_PER_RANK, out_features, generator=generator)
    return x.bfloat16(), dy.bfloat16()


def make_column(world_size, overlapped, **options):
    torch.manual_seed(1)
    layer = ColumnParallelLinear(HIDDEN, FFN_LOCAL * world_size, sequence_parallel=True, recipe=RECIPE, **options)
    if overlapped:
        layer.comm = O.overlapped_comm(layer.comm)
    return layer


def check_column_wgrad_inside_ring(rank, world_size):
    """The wgrad GEMM (nvfp4_dist.hot_path.gemm) runs after the ring's last dgrad GEMM, before its last wait; the
    weight gradient equals the plain layer's (computed, delayed or accumulated into main_grad)."""
    x, dy = inputs(world_size, rank, HIDDEN, FFN_LOCAL * world_size, 5)
    x_local, dy_local = x.chunk(world_size)[rank], dy.chunk(world_size, dim=-1)[rank]

    def run(layer, events=None):
        xl = x_local.clone().requires_grad_(True)
        y = layer(xl)[0]
        torch.manual_seed(7)
        if events is None:
            y.backward(dy_local)
        else:
            with Recorder(dgrad=(O, "gemm"), wgrad=(hot_path, "gemm")) as log, logged_waits(log):
                y.backward(dy_local)
            events.extend(log)
        return y.detach(), xl.grad

    plain = make_column(world_size, False)
    y_plain, dx_plain = run(plain)
    events = []
    layer = make_column(world_size, True)
    y, dx = run(layer, events)
    # Backward: W dgrad GEMMs (W-1 waits between them), then the wgrad GEMM, then the last wait.
    assert events == ["dgrad"] + ["dgrad", "wait"] * (world_size - 2) + ["dgrad", "wgrad", "wait"], events
    assert torch.equal(y, y_plain) and torch.equal(layer.weight.grad, plain.weight.grad)
    assert torch.equal(layer.bias.grad, plain.bias.grad)
    if world_size == 2:
        assert torch.equal(dx, dx_plain)

    delayed = make_column(world_size, True, delay_wgrad=True, accumulate_into_main_grad=True)
    delayed.weight.main_grad = torch.zeros_like(delayed.weight, dtype=torch.float32)
    run(delayed)
    assert len(delayed.wgrad_store) == 1 and not bool(delayed.weight.main_grad.any())
    delayed.backward_dw()
    assert torch.equal(delayed.weight.main_grad, plain.weight.grad.float())
    accumulated = make_column(world_size, True, accumulate_into_main_grad=True)
    accumulated.weight.main_grad = torch.zeros_like(accumulated.weight, dtype=torch.float32)
    run(accumulated)
    assert torch.equal(accumulated.weight.main_grad, plain.weight.grad.float())


def make_pair(world_size, overlapped):
    torch.manual_seed(3)
    column = ColumnParallelLinear(HIDDEN, FFN_LOCAL * world_size, sequence_parallel=True, recipe=RECIPE)
    row = RowParallelLinear(FFN_LOCAL * world_size, HIDDEN, sequence_parallel=True, recipe=RECIPE)
    if overlapped:
        column.comm, row.comm = O.overlapped_comm(column.comm), O.overlapped_comm(row.comm)
    return column, row


def pair_forward(column, row, x):
    x = x.clone().requires_grad_(True)
    return x, row(torch.nn.functional.gelu(column(x)[0]))[0]


def grads(x, column, row):
    return [x.grad, column.weight.grad, column.bias.grad, row.weight.grad, row.bias.grad]


def run_pair(column, row, x, dy, events=None):
    x, y = pair_forward(column, row, x)
    torch.manual_seed(7)
    if events is None:
        y.backward(dy)
    else:
        with Recorder(ring_gather=(O, "ring_all_gather_consume"), ring_scatter=(O, "ring_reduce_scatter_produce"),
                      input_gather=(collectives, "all_gather_nvfp4"), wgrad=(hot_path, "gemm")) as log:
            y.backward(dy)
        events.extend(log)
    return [y.detach()] + grads(x, column, row)


def registry_is_empty():
    regathers = O.input_regathers(dist.group.WORLD)
    return not (regathers.announced or regathers.claimed or regathers.started)


class without_early_regather:
    def __enter__(self):
        self.original = O.InputRegathers.claim
        O.InputRegathers.claim = lambda self, row_input: None

    def __exit__(self, *exc):
        O.InputRegathers.claim = self.original


def check_pair_early_regather(rank, world_size):
    x, dy = inputs(world_size, rank, HIDDEN, HIDDEN, 9)
    x_local, dy_local = x.chunk(world_size)[rank], dy.chunk(world_size)[rank]
    plain = run_pair(*make_pair(world_size, False), x_local, dy_local)
    with without_early_regather():
        late = run_pair(*make_pair(world_size, True), x_local, dy_local)
    events = []
    early = run_pair(*make_pair(world_size, True), x_local, dy_local, events)
    # Row backward: dgrad ring, the column input's gather, row wgrad; column backward: its dgrad ring with its
    # wgrad inside. Without the early start the gather would follow the row's wgrad.
    assert events == ["ring_gather", "input_gather", "wgrad", "ring_scatter", "wgrad"], events
    for got, expected, name in zip(early, late, ("y", "dx", "column dW", "column db", "row dW", "row db")):
        assert torch.equal(got, expected), f"early vs late re-gather: {name}"
    for index in (2, 3, 4, 5):
        assert torch.equal(early[index], plain[index]), index
    if world_size == 2:
        assert all(torch.equal(a, b) for a, b in zip(early, plain))
    gc.collect()
    assert registry_is_empty()


def check_micro_batches(rank, world_size):
    """Two micro-batches' forwards, then their backwards in either order: each row layer starts its own column
    layer's gather; gradients accumulate to those of the plain pair. A forward never run backward leaves nothing."""
    column, row = make_pair(world_size, True)
    plain_column, plain_row = make_pair(world_size, False)
    batches = [tuple(t.chunk(world_size)[rank] for t in inputs(world_size, rank, HIDDEN, HIDDEN, seed))
               for seed in (21, 22)]
    for order in ((0, 1), (1, 0)):
        for layer in (column, row, plain_column, plain_row):
            layer.weight.grad = layer.bias.grad = None
        started = []
        original_start = O.InputRegathers.start
        O.InputRegathers.start = lambda self, entry: (started.append(entry.key), original_start(self, entry))[1]
        try:
            forwards = [pair_forward(column, row, x) for x, _ in batches]
            regathers = O.input_regathers(dist.group.WORLD)
            assert len(regathers.claimed) == 2 and not regathers.announced
            keys = [entry.key for entry in regathers.claimed.values()]
            for index in order:
                torch.manual_seed(7 + index)
                forwards[index][1].backward(batches[index][1])
        finally:
            O.InputRegathers.start = original_start
        assert started == [keys[index] for index in order], (started, keys)
        for index in order:
            x, y = pair_forward(plain_column, plain_row, batches[index][0])
            torch.manual_seed(7 + index)
            y.backward(batches[index][1])
        for got, expected in ((column, plain_column), (row, plain_row)):
            assert torch.equal(got.weight.grad, expected.weight.grad) and torch.equal(got.bias.grad, expected.bias.grad)
        del forwards
        gc.collect()
        assert registry_is_empty()
    with torch.enable_grad():
        pair_forward(column, row, batches[0][0])
    gc.collect()
    assert registry_is_empty()


def _check(rank, world_size, which):
    {"ring": check_callback_during_last_transfer, "column": check_column_wgrad_inside_ring,
     "pair": check_pair_early_regather, "micro_batches": check_micro_batches}[which](rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("which", ["ring", "column", "pair", "micro_batches"])
def test_backward_ordering_on_gloo(which, world_size):
    run_distributed(_check, world_size, which)


def _check_one_rank(rank, world_size):
    calls = []
    summed = O.ring_reduce_scatter_produce(lambda chunk: torch.ones(2, 2), during_last_transfer=lambda: calls.append(1))
    assert calls == [1] and torch.equal(summed, torch.ones(2, 2))


def test_callback_runs_once_on_one_rank():
    run_distributed(_check_one_rank, 1)
