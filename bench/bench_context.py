"""
Context parallelism (context.py) measured: how the split balances attention, what it pads, and per rank on CPU with
gloo what one long sequence costs at cp=1 and cp=2 (each a fresh torchrun).

Balance: attention work per rank is the (query, key) pairs its slice scores; the table gives the busiest rank's over
the mean for the head-tail split (each sequence's 2*cp chunks, rank r taking chunks r and 2*cp-1-r: what context.py
does) and for contiguous slices of the stream (rank r taking rows [r*T/cp, (r+1)*T/cp): ring-flash-attention's
llama3 varlen split), on one long sequence and on a packed mix of lengths.
Per rank: the tokens it computes, the activations autograd saves for backward (tensors counted once per storage:
what a GPU would hold at the end of the forward), the peak private memory above the start of the step (RssAnon
sampled every 5 ms, bench_scale.PeakRSS), forward+backward seconds (median of --steps after one warm-up), and bytes
all-gathered (K and V, forward) and reduce-scattered (their gradients, backward) per step, counted at the calls.

    python bench/bench_context.py                          # 8k tokens, 32.5M parameters: ~6 min on 2 CPU cores
    python bench/bench_context.py --tokens 16384           # the issue's 16k tokens (attention 4x: slow on CPU)
    python bench/bench_context.py --tokens 512 --n_layer 1 --steps 1   # seconds; what the smoke test runs

On CPU the attention fallback (model.grouped_sdpa) gives a piece whose queries are not its keys an explicit
(Lq, Lk) float mask and repeats K/V for GQA, and scores every block of it: its memory ("saved by CPU attention") and
time grow under CP where a flash kernel's would not; they are reported apart.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack import context  # noqa: E402
import model as M  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from packing import make_batch, pack  # noqa: E402

SHAPE = dict(vocab_size=8192, n_head=8, n_kv_head=2, d_model=512, ffn_hidden=1536)  # 8 layers: 32.5M parameters


def one_sequence(n, seed=0):
    ids = np.random.default_rng(seed).integers(0, SHAPE["vocab_size"], n)
    return dict(ids=ids, loss_mask=np.ones(n, np.uint8), offsets=np.array([0, n]))


def mixed_streams(budget, seed=0):
    """Micro-batches best-fit packs from long-tailed lengths (log-normal, median budget / 16, capped at the budget):
    the first of several sequences whose longest is over a quarter of the budget, and the one of most sequences."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(budget / 16), 1.2, 400).astype(int) + 1, budget)
    data = dict(ids=np.zeros(lengths.sum(), np.int64), loss_mask=np.ones(lengths.sum(), np.uint8),
                offsets=np.r_[0, np.cumsum(lengths)])
    bins = pack(lengths, budget)
    return [make_batch(data, next(b for b in bins if len(b) > 2 and lengths[b].max() > budget / 4)),
            make_batch(data, max(bins, key=len))]


def pairs_scored(q_lens, k_lens):
    return float((q_lens * (2 * k_lens - q_lens + 1) / 2).sum())


def balance(mb, cp):
    """-> (padding rows, head-tail max/mean, contiguous max/mean) of attention work."""
    parts = [context.ContextParallel(cp, r).split(mb) for r in range(cp)]
    head_tail = [pairs_scored(np.diff(p.cu_seqlens.numpy())[:len(k)], k) for p in parts for k in [p.key_lengths()]]
    keys_seen = mb.position_ids.numpy() + 1  # a row of a whole sequence sees its position + 1 keys
    per_rank = -(-len(keys_seen) // cp)
    contiguous = [keys_seen[r * per_rank:(r + 1) * per_rank].sum() for r in range(cp)]
    return sum(p.num_padding for p in parts), max(head_tail) / np.mean(head_tail), max(contiguous) / np.mean(contiguous)


def balance_table(tokens):
    print("\n### Attention work per rank: busiest / mean (1.00 = balanced)\n")
    print("| stream | sequences | cp | padding rows | head-tail (context.py) | contiguous slices |")
    print("|---|---|---|---|---|---|")
    long_mix, short_mix = mixed_streams(4 * tokens)
    for name, mb in ((f"one sequence of {tokens:,}", make_batch(one_sequence(tokens), [0])),
                     (f"packed mix, one long ({4 * tokens:,} budget)", long_mix),
                     (f"packed mix, most sequences ({4 * tokens:,} budget)", short_mix)):
        for cp in (2, 4, 8):
            pad, ht, contiguous = balance(mb, cp)
            print(f"| {name} | {mb.num_sequences} | {cp} | {pad} | {ht:.3f} | {contiguous:.3f} |")


def worker(args):
    """One rank: forward + backward of its slice of one long sequence; prints one JSON line."""
    import torch.distributed as dist
    from bench_scale import PeakRSS
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = context.setup(world, rank, world)
    sent = {}

    def counting(name, fn):
        def call(out, x, *a, **kw):  # the gathered side: a rank receives (all-gather) or sends (reduce) all but its own
            sent[name] = sent.get(name, 0) + max(out.numel(), x.numel()) * out.element_size() * (world - 1) // world
            return fn(out, x, *a, **kw)
        return call
    context.ALL_GATHER = counting("all_gather", context.ALL_GATHER)
    context.REDUCE_SCATTER = counting("reduce_scatter", context.REDUCE_SCATTER)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHAPE, n_layer=args.n_layer, max_seq_len=args.tokens))
    mb = cp.split(make_batch(one_sequence(args.tokens), [0]))
    times, peaks, saved, in_attention = [], [], ({}, {}), [False]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    attend = M.grouped_sdpa

    def tagged(*a, **kw):  # what the CPU attention saves (its masks, K/V repeated for GQA) is told apart
        in_attention[0] = True
        try:
            return attend(*a, **kw)
        finally:
            in_attention[0] = False
    M.grouped_sdpa = tagged

    def keep(t):  # activations only: the weights a linear layer saves are the model's own
        if t.untyped_storage().data_ptr() not in weights:
            saved[in_attention[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    libc = ctypes.CDLL("libc.so.6")
    for step in range(args.steps + 1):
        for d in (sent, *saved):  # the last step's counts are reported
            d.clear()
        libc.malloc_trim(0)  # freed memory back to the system: each step's peak is measured from the same floor
        dist.barrier()
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = model(**mb.inputs())[0]
            loss.backward()
            times.append(time.perf_counter() - t0)
        peaks.append(peak.peak - peak.start)
        model.zero_grad(set_to_none=True)
    mib = lambda d: sum(d.values()) / 2**20
    # one write of the whole line: the ranks share one pipe, and print's separate writes of text and end interleaved
    os.write(1, (json.dumps(dict(rank=rank, cp=world, tokens=mb.num_tokens, padding=mb.num_padding,
                          saved_mib=mib(saved[False]), attention_mib=mib(saved[True]),
                          key_rows=int(mb.key_lengths().sum()), peak_mib=max(peaks[1:]) / 2**20,
                          seconds=statistics.median(times[1:]), gathered_mib=sent.get("all_gather", 0) / 2**20,
                          scattered_mib=sent.get("reduce_scatter", 0) / 2**20)) + "\n").encode())
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--cp", default="1,2")
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    balance_table(args.tokens)
    params = Transformer(ModelConfig(**SHAPE, n_layer=args.n_layer, max_seq_len=16)).num_params()
    print(f"\n### One sequence of {args.tokens:,} tokens, {params / 1e6:.1f}M parameters ({args.n_layer} layers, "
          f"d_model {SHAPE['d_model']}, {SHAPE['n_head']} heads over {SHAPE['n_kv_head']} K/V heads), float32, "
          f"CPU gloo, one thread per rank\n")
    print("| cp | rank | tokens (+ padding) | key rows read | saved outside attention MiB | saved by CPU attention MiB "
          "| peak memory MiB | fwd+bwd s | all-gathered MiB | reduce-scattered MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cp in map(int, args.cp.split(",")):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
                              os.path.abspath(__file__), "--worker", f"--tokens={args.tokens}",
                              f"--n_layer={args.n_layer}", f"--steps={args.steps}"],
                             capture_output=True, text=True, env=env)
        rows = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                      key=lambda r: r["rank"])
        if out.returncode or not rows:
            print(f"| {cp} | failed: {out.stderr.strip().splitlines()[-1:]} |")
        for r in rows:
            print(f"| {cp} | {r['rank']} | {r['tokens']:,} (+{r['padding']}) | {r['key_rows']:,} | "
                  f"{r['saved_mib']:,.0f} | {r['attention_mib']:,.0f} | {r['peak_mib']:,.0f} | {r['seconds']:.2f} | "
                  f"{r['gathered_mib']:,.1f} | {r['scattered_mib']:,.1f} |")


if __name__ == "__main__":
    main()
