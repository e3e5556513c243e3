"""The decode's CUDA-graph replay tests of tests/test_decode_paged.py in one process, in a fixed
adversarial order: a config after another of the same shape, the dispatched one between forced
ones, the shapes interleaved. Every cache of a plan or recorded launch keys on what decides it
(here DSV4_AMPERE_DECODE_CONFIG), so no call may replay another config's plan. A file of its own:
its order is the point, and the GPU suite's split (benchmarks/device/gpu_suite.sh) runs it beside
the long part."""

import pytest

from test_decode_paged import GRAPH_REPLAY_SHAPES, graph_replay_equals_eager


@pytest.mark.gpu
def test_gpu_v3_graph_replay_configs_in_adversarial_order(variant, monkeypatch):
    """The graph-replay grid in one process, each shape through its configs and back (a config
    after another of the same shape, the dispatched one between forced ones): the recorded
    launch plans key on DSV4_AMPERE_DECODE_CONFIG, so no call replays another config's plan."""
    order = ["kh32n64w8", "kh16n32w4", "kh32n64w8", "", "kh16n32w4", "", "kh32n64w8"]
    for T, H, splits in GRAPH_REPLAY_SHAPES:
        for config in order:
            graph_replay_equals_eager(monkeypatch, T, H, splits, config)
    for config in order:  # the shapes interleaved, one config at a time
        for T, H, splits in GRAPH_REPLAY_SHAPES:
            graph_replay_equals_eager(monkeypatch, T, H, splits, config)
