"""
Multi-turn rollouts on the built-in task (train_rl.py --env=builtin), side by side in one run: k trajectories of
each prompt with the engine (each later turn reads only its observation into the live KV cache), against k
single-turn replies to the same prompts; and the tokens a training step computes for those trajectories laid out
three ways: as a tree (each prompt once, its k trajectories after it: train_rl.py), each trajectory whole with its
own prompt (prefix_sharing=False), and each turn as its own sequence (the prompt and the history through that turn's
reply, as a trainer that makes a sample of every turn computes them).

    python bench/bench_env.py --init_from=out/dpo/hf        # the workshop's model
    python bench/bench_env.py --init_from=scratch --prompts 4 --k 2 --rounds 1   # seconds: the smoke test

tokens: sampled and observation tokens (multi-turn), reply tokens (single-turn); sampled tok/s: the tokens drawn /
the call (observations are read in one prefill each, not drawn); best of --rounds, the two taking turns; env ms: the
environments' own time inside the multi-turn call.
"""
import argparse
import os
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import model as M  # noqa: E402
from data.arithmetic import env_prompts  # noqa: E402
from nanopack.env import Multiturn  # noqa: E402
from nanopack.hf import from_pretrained  # noqa: E402
from nanopack.rollout import Rollouts  # noqa: E402
from nanopack.tokenizer import get_tokenizer  # noqa: E402


def layouts(prompts, trajectories, k):
    """-> tokens computed: (a tree per prompt, each trajectory whole, each turn whole)."""
    tree = whole = turns = 0
    for i, t in enumerate(trajectories):
        p = len(prompts[i // k][0])
        tree += len(t.ids) + p * (i % k == 0)
        whole += p + len(t.ids)
        # a turn ends where a sampled run of the mask ends
        ends = [j + 1 for j in range(len(t.mask)) if t.mask[j] and (j + 1 == len(t.mask) or not t.mask[j + 1])]
        turns += sum(p + e for e in ends)
    return tree, whole, turns


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--init_from", default="out/dpo/hf")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.init_from == "scratch":
        tok = get_tokenizer("byte")
        torch.manual_seed(0)
        net = M.Transformer(M.config_from_preset("tiny", vocab_size=tok.vocab_size))
    else:
        tok = get_tokenizer("byte") if not os.path.exists(os.path.join(a.init_from, "tokenizer.json")) \
            else get_tokenizer(a.init_from)
        net = from_pretrained(a.init_from)
    net.eval()
    config = dict(max_new_tokens=a.max_new_tokens, top_p=1.0, seed=0, k=a.k, temperature=1.0)
    run = SimpleNamespace(autocast=nullcontext(), device=torch.device("cpu"), cp=SimpleNamespace(rank=0))
    rollouts = Rollouts(run, config, [], None, net, net, tok, False, Multiturn("builtin", None, 4))
    prompts = [(tok.render_prompt(m), m, f, f"builtin:train:{i}")
               for i, (m, f) in enumerate(env_prompts("train", a.prompts))]
    best = dict(multi=float("inf"), single=float("inf"))
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        trajectories = rollouts.play(prompts, list(range(len(prompts))), a.k, 1.0)
        best["multi"] = min(best["multi"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        replies, _ = rollouts.generate(prompts, temperature=1.0, top_p=1.0, seed=0, keys=list(range(len(prompts))),
                                       num_samples=a.k)
        best["single"] = min(best["single"], time.perf_counter() - t0)
    n_multi = sum(len(t.ids) for t in trajectories)
    n_single = sum(map(len, replies))
    env_ms = 1000 * sum(t.env_seconds for t in trajectories)
    n = len(trajectories)
    print(f"{a.prompts} prompts x {a.k} | {os.path.basename(a.init_from.rstrip('/'))} | max_new_tokens "
          f"{a.max_new_tokens} | torch threads {torch.get_num_threads()}")
    drawn = n_multi - sum(t.observation_tokens for t in trajectories)
    print("| rollout | tokens | s | sampled tok/s | turns | observation tokens | truncated | env ms |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| multi-turn (env=builtin) | {n_multi:,} | {best['multi']:.2f} | {drawn / best['multi']:,.0f} | "
          f"{sum(t.turns for t in trajectories) / n:.2f} | {sum(t.observation_tokens for t in trajectories):,} | "
          f"{sum(t.truncated for t in trajectories) / n:.0%} | {env_ms:.0f} |")
    print(f"| single-turn | {n_single:,} | {best['single']:.2f} | {n_single / best['single']:,.0f} | 1 | 0 | - | - |")
    tree, whole, turns = layouts(prompts, trajectories, a.k)
    print("\n| training layout of these trajectories | tokens computed | vs tree |")
    print("|---|---|---|")
    for name, x in [("tree: each prompt once, its k trajectories after it", tree),
                    ("each trajectory whole (prefix_sharing=False)", whole),
                    ("each turn its own sequence (prompt + history + reply)", turns)]:
        print(f"| {name} | {x:,} | {x / tree:.2f}x |")


if __name__ == "__main__":
    main()
