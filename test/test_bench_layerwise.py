"""The bench's layer-wise worker messages (``kaitian bench inference``): BenchChunk on the wire
and the route a chain of workers follows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_interfaces import fresh_store

from kaitian_ros.bench.inference_graph import bench_chunk, bench_tensor, hop_of
from kaitian_ros.nodes import inference_common as ic
from kaitian_ros.runtime import interfaces

NAME = "kaitian_ros/msg/BenchChunk"


def test_bench_chunk_round_trips_through_the_codec() -> None:
    rows = torch.randn(1, 8, 5, 7)
    msg = bench_chunk(request_id=2**40 + 1, sender="bench", value=3, route=["lw_0", "lw_1"],
                      stop_values=[9, 20], reply_to="bench", tensor=rows)
    cdr = bytes(interfaces.encode(msg, "BenchChunk"))
    assert cdr == bytes(fresh_store().serialize_cdr(msg, NAME))  # rosbags' bytes: no fast path for it
    assert interfaces.type_hash("BenchChunk") == fresh_store().hash_rihs01(NAME)
    back = interfaces.decode(cdr, "BenchChunk")
    assert (int(back.request_id), back.sender, int(back.value), list(back.route), back.reply_to) == \
        (2**40 + 1, "bench", 3, ["lw_0", "lw_1"], "bench")
    assert [int(v) for v in back.stop_values] == [9, 20]
    assert torch.equal(bench_tensor(back), rows)


def test_bench_tensor_takes_pixels_only_as_the_model_input() -> None:
    pixels = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    assert bench_tensor(bench_chunk(request_id=1, sender="bench", value=0, route=["lw_0"], stop_values=[5],
                                    reply_to="bench", tensor=pixels)).dtype == torch.uint8
    with pytest.raises(interfaces.DecodeError):
        bench_tensor(bench_chunk(request_id=1, sender="lw_0", value=5, route=["lw_1"], stop_values=[9],
                                 reply_to="bench", tensor=pixels))
    with pytest.raises(interfaces.DecodeError):
        bench_tensor(bench_chunk(request_id=1, sender="bench", value=0, route=["lw_0"], stop_values=[5],
                                 reply_to="bench", tensor=torch.zeros(3, 4)))


def test_two_workers_along_a_route_compute_the_whole_trunk() -> None:
    g = ic.build_graph(ic.ModelSpec("resnet18", (3, 32, 32), 10, 0, ""))
    cut = sorted(g.cut_values)[len(g.cut_values) // 2]
    x = torch.randn(1, 3, 32, 32)
    msg = bench_chunk(request_id=7, sender="bench", value=0, route=["lw_0", "lw_1"],
                      stop_values=[cut, g.output_value], reply_to="bench", tensor=x)
    node = "lw_0"
    with torch.no_grad():
        while list(msg.route):
            hop = hop_of(msg, node, g.output_value, g.cut_values)
            y = g.run_ops(bench_tensor(msg), hop.first, hop.stop)
            msg = interfaces.decode(bytes(interfaces.encode(bench_chunk(
                request_id=7, sender=node, value=hop.stop, route=hop.route, stop_values=hop.stop_values,
                reply_to=msg.reply_to, tensor=y), "BenchChunk")), "BenchChunk")
            node = hop.to
        whole = g.run_ops(x, 0, g.output_value)
    assert node == "bench" and int(msg.value) == g.output_value
    assert np.allclose(bench_tensor(msg).numpy(), whole.numpy(), atol=1e-5)


@pytest.mark.parametrize(("node", "value", "route", "stops", "why"), [
    ("lw_1", 0, ["lw_0"], [5], "not addressed"),
    ("lw_0", 0, ["lw_0", "lw_1"], [5], "stop values"),
    ("lw_0", 0, ["lw_0"], [0], "bad range"),
    ("lw_0", 0, ["lw_0", "lw_1"], [9, 5], "bad range"),
    ("lw_0", 0, ["lw_0"], [10_000], "bad range"),
    ("lw_0", 1, ["lw_0"], [20], "not a cut value"),
])
def test_a_route_the_worker_cannot_run_is_refused(node, value, route, stops, why) -> None:
    msg = bench_chunk(request_id=1, sender="bench", value=value, route=route, stop_values=stops,
                      reply_to="bench", tensor=torch.zeros(1, 1, 1, 1))
    with pytest.raises(ValueError, match=why):
        hop_of(msg, node, 60, {5, 9, 20})
