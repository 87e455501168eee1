"""CUDA graphs of the decode step (nanopack/decode_graphs.py), on CPU: the stand-in for torch.cuda.graph records the
step's ops once with make_fx (real tensors) and replays the recording, so, as a CUDA graph, a replay runs no Python
and reads only what the buffers and the cache hold when it runs. A value baked in at capture (a length, a position,
a row count read on the host) would replay stale and change the tokens. Float32: the replies equal the eager engine's
(the graphs' attention reads the whole capacity, masked: the same sums, margins decide the tokens)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from nanopack.decode_graphs import DecodeGraphs
from nanopack.generate import Engine, Sampling
from test_sample import PROMPTS, random_model

SAMPLED = Sampling(12, temperature=0.9, top_k=20, top_p=0.9, stop_ids=(5, 17, 30), seed=3)


class Recorder:
    """capture(step) -> (replay, output), as decode_graphs.cuda_capture: the step recorded once, its replays
    counted per bucket."""

    def __init__(self):
        self.replays, self.captured, self.recordings = {}, [], []

    def __call__(self, step, pool):
        assert pool is None  # a memory pool only on CUDA
        recorded = make_fx(step)()
        out = recorded()
        bucket = len(out)
        self.captured.append(bucket)
        self.recordings.append(recorded)

        def replay():
            self.replays[bucket] = self.replays.get(bucket, 0) + 1
            out.copy_(recorded())
        return replay, out


def test_replayed_steps_give_the_eager_engines_replies():
    model = random_model()
    want = Engine(model).generate(PROMPTS, SAMPLED, 3)
    recorder = Recorder()
    engine = Engine(model, cuda_graphs=True, capture=recorder)
    for _ in range(2):  # the second call reuses the cache and its graphs
        got = engine.generate(PROMPTS, SAMPLED, 3)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    lengths = {len(r.tokens) for r in want}
    assert len(lengths) > 2  # replies end at different steps: the live count shrinks through the buckets
    # 12 replies: buckets of 1, 2, 4, 8 and the slots' 12, each captured once, replayed in both calls
    assert sorted(set(recorder.captured)) == sorted(recorder.captured) and max(recorder.captured) == 12
    assert len(recorder.captured) >= 2 and sum(recorder.replays.values()) > 2 * 8


def test_replayed_steps_read_the_cache_in_place():
    """The live replies are the cache's first rows: a step reads them as a view. A gather (rows as an index) would
    copy every layer's K and V over the whole capacity at each step."""
    model = random_model()
    recorder = Recorder()
    engine = Engine(model, cuda_graphs=True, capture=recorder)
    engine.generate(PROMPTS, SAMPLED, 3)
    buffer = tuple(engine.cache.k[0].shape)
    assert buffer[0] == 12 and buffer[2] == engine.cache.capacity + 1  # a row a slot, a spare column
    for recorded in recorder.recordings:
        read = [tuple(node.args[0].meta["val"].shape) for node in recorded.graph.nodes
                if node.target in (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)]
        # RoPE's tables and the head's rows are gathered, never the cache's rows (slots, Hkv, ...)
        assert read and not [shape for shape in read if shape[:2] == buffer[:2] and len(shape) == 4]


def test_pads_leave_kept_slots_alone(monkeypatch):
    """Multi-turn: the pads of a bucket write a spare column, never a kept reply's positions (six replies: five
live pad a bucket of 6, three a bucket of 4, with kept replies' rows): at every step the rows past the live ones are
unchanged below the capacity, and continuing each reply equals the eager engine's."""
    step, touched, steps = DecodeGraphs.step, [], []

    def checked(graphs, tokens, positions):
        n, cache = len(tokens), graphs.cache
        before = [b[n:, :, :cache.capacity].clone() for b in cache.k + cache.v]
        out = step(graphs, tokens, positions)
        touched.extend(not torch.equal(a, b[n:, :, :cache.capacity]) for a, b in zip(before, cache.k + cache.v))
        steps.append(n)
        return out
    monkeypatch.setattr(DecodeGraphs, "step", checked)
    model = random_model()
    engine = Engine(model, keep_slots=True, cuda_graphs=True, capture=Recorder())
    eager = Engine(model, keep_slots=True)
    runs = []
    for e in (engine, eager):
        replies = e.generate(PROMPTS[:3], SAMPLED, 2, capacity=40)
        e.extend(replies, [[7, 8, 9], [11], [4], [12, 13], [6], [3]], [5, 3, 4, 2, 6, 1], SAMPLED)
        runs.append([r.tokens for r in replies])
    assert len({len(t) for t in runs[1]}) > 2  # replies ended at different steps: pads ran beside kept slots
    assert {3, 5} <= set(steps) and touched and not any(touched)
    assert runs[0] == runs[1]


def test_extend_past_the_cache_is_one_clear_error():
    """An observation and budget the cache cannot hold: an error naming the sizes, not a pad's spare column
    written by a real reply (a silent wrong log-prob) or an index out of bounds."""
    model = random_model(max_seq_len=256)  # room past the caches: 24 positions eager, 64 (rounded up) in graphs
    for engine in (Engine(model, keep_slots=True, cuda_graphs=True, capture=Recorder()),
                   Engine(model, keep_slots=True)):
        replies = engine.generate(PROMPTS[:1], Sampling(4), 1, capacity=24)
        capacity, used = engine.cache.capacity, len(replies[0].prompt) + len(replies[0].tokens)
        fits = [7] * (capacity - used - 2)  # its 3 new tokens end at the last position: fine
        engine.extend(replies, [fits], [3], Sampling(4))
        used = len(replies[0].prompt) + len(replies[0].tokens)
        assert used == capacity + 1  # the last token sampled, not yet read
        with pytest.raises(ValueError, match=f"needs {used + 1} cache positions, the cache has {capacity}"):
            engine.extend(replies, [[7]], [1], Sampling(4))


def test_graphs_refuse_what_they_cannot_replay():
    with pytest.raises(ValueError, match="not with sync_ranks"):
        Engine(random_model(), cuda_graphs=True, kv_cache=False)
