"""
train_rl.py's training step with and without prefix sharing, side by side in one run on the CPU: k replies per
prompt laid out `prompt | reply 1 | ... | reply k` (each prompt computed once) vs every reply with its own copy of the
prompt (prefix_sharing=False). One step = the GRPO loss's forward, backward and AdamW update over all groups in one
micro-batch, as train_rl.py computes it; random advantages (the cost does not depend on them).

    python bench/bench_rl.py                       # toy model: prompt-heavy groups (512 | 8 x 64) and the built-in task
    python bench/bench_rl.py --preset smollm2-135m --groups 1 --rounds 1   # a real model's shape (slow on a CPU)

Cases: 'prompt-heavy', --groups groups of a 512-token prompt and k = 8 replies of 64 tokens (random ids); 'built-in',
16 prompts of the built-in hard split with k = 8 right answers as replies ("57-8 = 49" or "Sure! 57-8 = 49", and the
stop token). The two
layouts take turns for --rounds rounds; each time is the median of its rounds.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data.arithmetic as arithmetic  # noqa: E402
from losses import loss_weights, policy_loss  # noqa: E402
from model import Transformer, config_from_preset  # noqa: E402
from packing import group_data, make_batch, shared_prefixes  # noqa: E402
from nanopack.tokenizer import get_tokenizer  # noqa: E402


def cases(groups, k, vocab):
    rng = np.random.default_rng(0)
    heavy = ([rng.integers(0, vocab, 512).tolist() for _ in range(groups)],
             [[rng.integers(0, vocab, 64).tolist() for _ in range(k)] for _ in range(groups)])
    tok = get_tokenizer("byte")
    chats = list(arithmetic.conversations("train", 16, hard=True))
    replies = [[tok.encode(arithmetic.answer(a, op, b, arithmetic.OPS[op](a, b), arithmetic.STYLES[j % 2]))
                + tok.stop_ids[:1] for j in range(k)] for _, (*_, (a, op, b, _)) in chats]
    builtin = ([tok.render_prompt(messages[:-1]) for messages, _ in chats], replies)
    return {f"prompt-heavy (512 | {k} x 64)": heavy, "built-in (hard split)": builtin}


def step(model, optimizer, mb, advantages):
    """train_rl.py's default (DAPO): a token mean over the step's reply tokens, the ratio 1 on a batch's first update."""
    t0 = time.perf_counter()
    logps = model(**mb.inputs(), logprobs=True)
    lengths = torch.bincount(mb.seq_ids, minlength=len(advantages)).float()  # trained tokens per reply
    weights = loss_weights(lengths, "token_mean", lengths.sum())
    loss, _ = policy_loss(logps, logps.detach(), mb.seq_ids, advantages, weights, lengths, 0.2, 0.28)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    byte_vocab = dict(vocab_size=get_tokenizer("byte").vocab_size) if args.preset in ("tiny", "toy") else {}
    model = Transformer(config_from_preset(args.preset, **byte_vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    print(f"{args.preset}: {model.num_params() / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, "
          f"k={args.k}, {args.rounds} rounds\n")
    print("| case | layout | tokens computed | train ms (median) | tokens ratio | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, (prompts, replies) in cases(args.groups, args.k, model.config.vocab_size).items():
        data = group_data(prompts, replies)
        layouts = {"shared prompt": shared_prefixes(data, args.k), "own copy each": None}
        mbs = {n: make_batch(data, range(len(prompts)), group_size=args.k, prefix=p)
               for n, p in layouts.items()}
        advantages = torch.randn(len(prompts) * args.k)
        times = {n: [] for n in mbs}
        step(model, optimizer, mbs["shared prompt"], advantages)  # warm-up
        for _ in range(args.rounds):
            for n, mb in mbs.items():
                times[n].append(step(model, optimizer, mb, advantages))
        base = statistics.median(times["own copy each"])
        for n, mb in mbs.items():
            ms = statistics.median(times[n])
            print(f"| {name} | {n} | {mb.num_tokens:,} | {1000 * ms:,.0f} | "
                  f"{mbs['own copy each'].num_tokens / mb.num_tokens:.2f}x | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
