"""Decode-step graphs (runner/graphs.py): the capture sizes, the static buffers' filling, and the CPU's stand-in for a
CUDA graph, which refuses what a graph could not replay."""

from __future__ import annotations

import pytest
import torch

from mini_infer.runner.graphs import EmulatedGraph, HostSyncRefused, StaticInputs, capture_sizes, padded_size
from mini_infer.runner.input_batch import StepInputs


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [248, 256] and len(sizes) == 35
    assert capture_sizes(1000)[-3:] == [480, 496, 512] and capture_sizes(300)[-3:] == [272, 288, 300]


def test_padded_size():
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 17, 20)] == [1, 4, 8, 8, 16, 20, 20]
    assert padded_size(21, sizes) is None


def decode_inputs(rows: int, width: int) -> StepInputs:
    return StepInputs(input_ids=torch.arange(100, 100 + rows), positions=torch.arange(5, 5 + rows),
                      slot_mapping=torch.arange(20, 20 + rows),
                      block_tables=torch.arange(rows * width).view(rows, width),
                      context_lens=torch.arange(6, 6 + rows), logits_indices=torch.arange(rows),
                      query_start_loc=list(range(rows + 1)), context_lens_host=list(range(6, 6 + rows)),
                      num_decodes=rows, sampling_slots=list(range(rows)))


def test_fill_copies_the_batch_and_pads_the_rest():
    """Rows 0..n-1 hold the step, rows n..size-1 the padding (slot -1, context 0), whatever an earlier, larger step
    left there; past `size` nothing is written."""
    static = StaticInputs.allocate(16, 6, torch.device("cpu"))
    assert (static.rows(16)[2] == -1).all()  # what a graph's capture runs on stores nothing
    for buffer in static.device.values():
        buffer.fill_(-7)
    static.fill(decode_inputs(5, 3), 8)
    static.fill(decode_inputs(3, 2), 4)
    ids, positions, slots, tables, lens = static.rows(8)
    assert ids[:4].tolist() == [100, 101, 102, 0] and positions[:4].tolist() == [5, 6, 7, 0]
    assert slots[:4].tolist() == [20, 21, 22, -1] and lens[:4].tolist() == [6, 7, 8, 0]
    assert tables[:3, :2].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert slots[4:8].tolist() == [24, -1, -1, -1]  # the first step's rows, past the second's size
    assert (static.device["slot_mapping"][8:] == -7).all()


def test_emulated_graph_replays_into_its_outputs():
    source = torch.tensor([1.0, 2.0])
    graph = EmulatedGraph(lambda: (source * 2,))
    outputs = graph.outputs
    source.copy_(torch.tensor([5.0, 6.0]))
    graph.replay()
    assert graph.outputs is outputs and outputs[0].tolist() == [10.0, 12.0]


@pytest.mark.parametrize("step", [
    lambda x: (x * int(x.sum()),),  # a device value read on the host
    lambda x: (x[x > 0],),  # a shape that depends on the data
    lambda x: (x.nonzero(),),
    lambda x: (x + torch.tensor([1.0, 2.0]),),  # host data, frozen at capture
])
def test_emulated_capture_refuses_what_a_graph_cannot_replay(step):
    x = torch.tensor([1.0, -2.0])
    with pytest.raises(HostSyncRefused):
        EmulatedGraph(lambda: step(x))
