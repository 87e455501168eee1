"""
Agent traces as trees (issue 45), side by side in one run: one SFT training step on a conversation's turn examples
(reasoning_turns='each': example j = the history up to turn j, earlier reasoning removed, then turn j's reasoning and
reply, only those trained) laid out as a tree (packing.make_batch with prefix=: what each example shares with the one
before it computed once) vs expanded (every example whole). Tokens computed, step time (forward, backward, AdamW;
median of --rounds), peak memory of a process running only that step.

    python bench/bench_trees.py                               # 5, 10, 30 turns, the toy preset, CPU (~10 min)
    python bench/bench_trees.py --prompt=4000 --turns=5,10 --rounds=3   # an agent's system prompt and tool schemas
    python bench/bench_trees.py --turns=10 --preset=tiny --rounds=5

Synthetic traces (random ids, --seed): a prompt of --prompt tokens, then per turn reasoning of 500-2,000 tokens and a
reply (with its tool call and result) of 200-800 tokens. The tree computes the longest history once and each turn's
reasoning and reply: what any exact layout must (a reply follows its reasoning in its own example, not in the
history), so the tokens ratio is (sum of histories + turns) / (longest history + turns). Each layout runs in a
process of its own (peak RSS: the process's, torch and the model included; its baseline printed).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import Transformer, config_from_preset  # noqa: E402
from packing import make_batch, shared_prefixes  # noqa: E402


def trace(turns, prompt, seed, vocab):
    """One conversation's turn examples as token data with its unit: example j = prompt + replies 0..j-1 + reasoning j +
    reply j, trained on reasoning j + reply j."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab, prompt)
    replies = [rng.integers(0, vocab, rng.integers(200, 801)) for _ in range(turns)]
    thoughts = [rng.integers(0, vocab, rng.integers(500, 2001)) for _ in range(turns)]
    seqs, masks = [], []
    for j in range(turns):
        history = np.concatenate([head, *replies[:j]])
        seqs.append(np.concatenate([history, thoughts[j], replies[j]]))
        masks.append(np.r_[np.zeros(len(history)), np.ones(len(thoughts[j]) + len(replies[j]))])
    return dict(ids=np.concatenate(seqs), loss_mask=np.concatenate(masks).astype(np.uint8),
                offsets=np.r_[0, np.cumsum([len(s) for s in seqs])].astype(np.int64), units=np.array([0, turns]))


def one(args):
    """The step of one layout in this process -> a JSON line."""
    torch.manual_seed(0)
    model = Transformer(config_from_preset(args.preset, max_seq_len=1 << 17))
    data = trace(args.one, args.prompt, args.seed, model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mb = make_batch(data, [0], 1, shared_prefixes(data, 1) if args.layout == "tree" else None)
    times = []
    for _ in range(args.rounds + 1):  # the first: warm-up
        t0 = time.perf_counter()
        loss, n = model(**mb.inputs())
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    print(json.dumps(dict(tokens=mb.num_tokens, targets=mb.num_target_tokens, loss=loss.item() / float(n),
                          ms=1000 * statistics.median(times[1:]), base_mib=base,
                          peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", default="5,10,30")
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: this many turns, one layout
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args)
    print(f"{args.preset}, {torch.get_num_threads()} threads, prompt {args.prompt} tokens, median of {args.rounds} "
          f"steps after a warm-up\n")
    print("| turns | layout | tokens computed | trained | step ms | peak RSS MiB (baseline) | tokens ratio | speed-up "
          "| loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for turns in map(int, args.turns.split(",")):
        rows = {}
        for layout in ("expanded", "tree"):
            cmd = [sys.executable, os.path.abspath(__file__), f"--one={turns}", f"--layout={layout}",
                   f"--preset={args.preset}", f"--prompt={args.prompt}", f"--rounds={args.rounds}",
                   f"--seed={args.seed}"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-2000:])
            rows[layout] = json.loads(out.stdout.splitlines()[-1])
        for layout, r in rows.items():
            e = rows["expanded"]
            print(f"| {turns} | {layout} | {r['tokens']:,} | {r['targets']:,} | {r['ms']:,.0f} | {r['peak_mib']:,.0f} "
                  f"({r['base_mib']:,.0f}) | {e['tokens'] / r['tokens']:.2f}x | {e['ms'] / r['ms']:.2f}x | "
                  f"{r['loss']:.6f} |")


if __name__ == "__main__":
    main()
