"""
The decode step as CUDA graphs (generate.Engine(cuda_graphs=True)): at a small batch a GPU decode
step is a few hundred kernel launches, each costing more than its work, and a graph replays them as
one. One graph per batch-size bucket (powers of two, and the engine's slots); a step's n live
replies (compacted into slots 0..n-1) run in the smallest bucket that holds them, the bucket's other
rows pads that write a spare column past the cache's capacity, which no reply reads. A graph reads
its inputs from static buffers, filled before each replay, and the KV cache (its first rows, a
view) and the weights in place (an optimizer step updates them in place, so a graph stays current);
attention runs over the cache's whole capacity, masked, so that no shape depends on the step.
"""
import torch


def cuda_capture(step, pool):
    """step() recorded as a CUDA graph in memory pool `pool` -> (replay, its output tensor). Warmed
    up on a side stream first, as torch.cuda.graphs asks (lazy initialisations must not land in
    the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # autocast's weight cache would hand the capture casts made outside it, freed at its exit
    with torch.cuda.graph(graph, pool=pool), torch.autocast(
            "cuda", enabled=torch.is_autocast_enabled("cuda"),
            dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        out = step()
    return graph.replay, out


class DecodeGraphs:
    """A captured decode step per bucket of live replies, over `cache` (a generate.KVCache of one
    spare column, its slots the largest bucket). capture(step, pool) -> (replay,
    output): CUDA graphs, or in a test a stand-in that records the step's ops and replays them
    without running Python."""

    def __init__(self, model, cache, capture=cuda_capture):
        self.model, self.cache, self.capture = model, cache, capture
        most = cache.slots
        device = next(model.parameters()).device
        self.ids = torch.zeros(most, dtype=torch.long, device=device)
        self.pos = torch.zeros(most, dtype=torch.long, device=device)
        self.columns = torch.zeros(most, dtype=torch.long, device=device)
        self.cu = torch.arange(most + 1, dtype=torch.int32, device=device)
        self.graphs = {}  # bucket -> (replay, logits)
        # one memory pool for all buckets: a step's logits are read before the next replay
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def step(self, tokens, positions):
        """One new token's logits (n, V) for each of n live replies in slots 0..n-1: tokens and
        positions (host lists) copied into the buffers, the bucket's graph replayed."""
        n = len(tokens)
        bucket = min(1 << (n - 1).bit_length(), self.cache.slots)
        fill = torch.tensor([tokens, positions, positions], device=self.ids.device)
        # a pad: token 0 at position 0, written to (and reading up to) the spare column
        for buf, values, pad in zip((self.ids, self.pos, self.columns), fill,
                                    (0, 0, self.cache.capacity)):
            buf[:n] = values
            buf[n:bucket] = pad
        if bucket not in self.graphs:
            self.graphs[bucket] = self.capture(lambda: self.forward(bucket), self.pool)
        replay, logits = self.graphs[bucket]
        replay()
        return logits[:n]

    def forward(self, bucket):
        # every shape fixed by the bucket and the cache's capacity; rows 0..bucket-1, a view
        cache = self.cache
        cache.rows, cache.continuing, cache.columns = None, False, self.columns[:bucket]
        return self.model(self.ids[:bucket], self.pos[:bucket], self.cu[:bucket + 1],
                          cache.capacity, logits_at=self.cu[:bucket].long(),
                          cache=cache).float()
