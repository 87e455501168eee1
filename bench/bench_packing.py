"""
How much of a micro-batch is real tokens, and how many micro-batches a step needs, for our
best-fit-decreasing packing vs the simpler policies peers use. CPU only.

    python bench/bench_packing.py           # 100k lengths per distribution, 1M for the timing
    python bench/bench_packing.py --small   # a quick smoke run

Columns (real = tokens of actual examples):
  fill global    real / (micro-batches * budget) when all lengths are packed at once (how trl
                 packs a dataset, ignoring steps)
  fill/step      the same when each step of 64 examples is packed on its own, as PackedLoader does
                 on one GPU: the honest figure for training. It is the share of real tokens if
                 micro-batches are padded to the budget (static shapes for torch.compile, as
                 bench_train.py's packed+compile-static row does)
  pad computed   padding positions the GPU computes unless padded to the budget: 0 for packers (varlen
                 attention over real tokens only); for "pad to longest", k sequences per
                 micro-batch are padded to the longest of them (T may then exceed the budget)
  mb/step        micro-batches (forward+backward passes) per step of 64 examples
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from packing import pack  # noqa: E402

SMALL = "--small" in sys.argv
N = 10_000 if SMALL else 100_000
N_TIMING = 100_000 if SMALL else 1_000_000
STEP = 64        # examples per optimizer step
PAD_K = 8        # sequences per micro-batch for "pad to longest"


def lognormal(n, median, p99, cap, rng):
    sigma = np.log(p99 / median) / 2.326  # 2.326 = z-score of the 99th percentile
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 1, cap).astype(np.int64)


DISTRIBUTIONS = {
    "lognormal med300 p99 4k": lambda n, cap, rng: lognormal(n, 300, 4000, cap, rng),
    "short chat med68 max512": lambda n, cap, rng: lognormal(n, 68, 400, 512, rng),
    "uniform 1..4096": lambda n, cap, rng: np.minimum(rng.integers(1, 4097, n), cap),
}


def first_fit(lengths, budget):
    """Items in the given order, each into the first open bin with room (numpy scan per item)."""
    free = np.zeros(len(lengths), np.int64)
    bins = []
    for i, n in enumerate(lengths.tolist()):
        k = np.flatnonzero(free[:len(bins)] >= n)
        if k.size:
            b = int(k[0])
            bins[b].append(i)
        else:
            b = len(bins)
            bins.append([i])
            free[b] = budget
        free[b] -= n
    return bins


def next_fit(lengths, budget):
    """Greedy in order, a full micro-batch is closed and the item carried to the next one (the
    policy of the DPO trainer in FIELD_NOTES)."""
    bins, room = [], 0
    for i, n in enumerate(lengths.tolist()):
        if n > room:
            bins.append([])
            room = budget
        bins[-1].append(i)
        room -= n
    return bins


def packer_row(packer, lengths, budget):
    global_bins = len(packer(lengths, budget))
    step_bins = [len(packer(lengths[s:s + STEP], budget)) for s in range(0, len(lengths), STEP)]
    total = lengths.sum()
    return total / (global_bins * budget), total / (sum(step_bins) * budget), np.mean(step_bins)


def padded_row(lengths, budget):
    groups = [lengths[s:s + PAD_K] for s in range(0, len(lengths), PAD_K)]
    positions = sum(len(g) * g.max() for g in groups)
    eff = lengths.sum() / positions
    return eff, eff, STEP / PAD_K  # the same per step; T can exceed the budget (up to k * max)


def trl_rows(lengths, budget):
    """trl's pack_dataset(strategy="bfd"): by default it maps in batches of 1000 examples, so BFD
    only sees 1000 at a time; with one map batch it sees them all."""
    import pyarrow as pa
    from datasets import Dataset
    from trl import pack_dataset
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(offsets[-1], np.int32)))
    dataset = Dataset(pa.table({"input_ids": column}))
    rows = []
    for name, kwargs in (("trl bfd (default)", None), ("trl bfd (one batch)", {"batch_size": len(lengths)})):
        t = time.perf_counter()
        packed = pack_dataset(dataset, budget, strategy="bfd", map_kwargs=kwargs)
        rows.append((name, lengths.sum() / (len(packed) * budget), time.perf_counter() - t))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a quick smoke run")
    p.parse_args()  # SMALL above reads it
    try:
        import trl  # noqa: F401
        have_trl = True
    except ImportError:
        have_trl = False
        print("trl not installed")
    rng = np.random.default_rng(0)
    print(f"{N:,} lengths per distribution; per step = {STEP} examples; "
          f"pad to longest = {PAD_K} seqs/micro-batch")
    print(f"{'distribution':<24} {'budget':>6}  {'method':<20} {'fill global':>11} {'fill/step':>9} "
          f"{'pad computed':>12} {'mb/step':>8}")
    for dist_name, make in DISTRIBUTIONS.items():
        for budget in (4096, 16384):
            lengths = make(N, budget, rng)
            rows = [("BFD (ours)",) + packer_row(pack, lengths, budget),
                    ("first-fit in order",) + packer_row(first_fit, lengths, budget),
                    ("next-fit (greedy)",) + packer_row(next_fit, lengths, budget),
                    (f"pad to longest k={PAD_K}",) + padded_row(lengths, budget)]
            for name, eff_global, eff_step, mb_step in rows:
                pad = 1 - eff_step if name.startswith("pad") else 0.0
                print(f"{dist_name:<24} {budget:>6}  {name:<20} {eff_global:>11.1%} {eff_step:>9.1%} "
                      f"{pad:>12.1%} {mb_step:>8.2f}")
            if have_trl:
                for name, eff, _ in trl_rows(lengths, budget):
                    print(f"{dist_name:<24} {budget:>6}  {name:<20} {eff:>11.1%} {'-':>9} "
                          f"{'0.0%':>12} {'-':>8}")

    print(f"\npacking time, {N_TIMING:,} lengths (lognormal med300 p99 4k):")
    for budget in (4096, 16384):
        lengths = DISTRIBUTIONS["lognormal med300 p99 4k"](N_TIMING, budget, rng)
        t = time.perf_counter()
        bins = pack(lengths, budget)
        dt = time.perf_counter() - t
        eff = lengths.sum() / (len(bins) * budget)
        print(f"  {'BFD (ours)':<20} budget {budget:>5}: {dt:5.2f} s for {N_TIMING:,} lengths, "
              f"{len(bins):,} bins, efficiency {eff:.4%}")
        if have_trl:
            n_trl = min(N_TIMING, 100_000)  # trl needs the token lists themselves in memory
            for name, eff, dt in trl_rows(lengths[:n_trl], budget):
                print(f"  {name:<20} budget {budget:>5}: {dt:5.2f} s for {n_trl:,} lengths, "
                      f"efficiency {eff:.4%}")


if __name__ == "__main__":
    main()
