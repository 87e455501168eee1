"""
Generation speed on the CPU: generate.generate with the KV cache, without it (every step re-reads every
sequence), and transformers' generate (DynamicCache, SDPA), greedy, on the same random weights saved as a
Hugging Face folder. Prompts of ~50 tokens, batch 1 and 8 (transformers pads the batch on the left; we pack).

    python bench/bench_generate.py                          # SmolLM2-135M shape, 64 new tokens, all threads
    python bench/bench_generate.py --threads 1              # one core: steadier on a shared machine
    python bench/bench_generate.py --preset tiny --new_tokens 8 --batches 1,3 --rounds 1   # seconds: the smoke test

    python bench/bench_generate.py --k 8 --group_prompts 4 --batches ""    # only the k-replies table

Per row: prefill = a generate call with 1 new token; decode = (the full call - prefill) / (new_tokens - 1),
the time of one step that adds a token to every sequence; tok/s = batch x new_tokens / the full call. The
methods take turns for --rounds rounds and each time is the best of its rounds, so a burst of load from
another process hits all of them alike (the slow no-cache rows run once). "same tokens": how many
sequences' greedy output equals the cached run's.

The second table: k sampled replies to each prompt (temperature 1, top_k 50, top_p 0.95, RL's setting), each prompt
prefilled once (generate(num_samples=k)), prefilled k times (the prompt repeated k times), and transformers'
generate(num_return_sequences=k); prefill and decode as above, tok/s = new tokens / the full call. Both nanopack rows draw from one generator per
reply, seeded alike, so "same tokens" counts the replies where the two agree.
"""

import argparse
import os
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack.generate import generate  # noqa: E402
from nanopack.hf import save_pretrained  # noqa: E402
from model import Transformer, config_from_preset  # noqa: E402


def hf_generate(model, prompts, new_tokens):
    """transformers' generate on a left-padded batch -> the new tokens of each prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0)  # no stop token: every row runs new_tokens steps
    return out[:, width:].tolist()


def hf_generate_k(model, prompts, new_tokens, k):
    """transformers' generate, k sampled replies per prompt (num_return_sequences) -> the new tokens of each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=k, temperature=1.0,
                         top_k=50, top_p=0.95, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def group_table(ours, ref, args):
    """k replies per prompt: one prefill vs k prefills vs transformers (see the module docstring)."""
    n, k, new_tokens = args.group_prompts, args.k, args.new_tokens
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, ours.config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    sampling = dict(temperature=1.0, top_k=50, top_p=0.95)
    seeded = lambda: [torch.Generator().manual_seed(r) for r in range(n * k)]  # one per reply
    methods = {
        "nanopack, one prefill per prompt": lambda m: generate(ours, prompts, m, num_samples=k, generator=seeded(),
                                                               **sampling),
        "nanopack, k prefills per prompt": lambda m: generate(ours, [p for p in prompts for _ in range(k)], m,
                                                              generator=seeded(), **sampling),
        "transformers generate(num_return_sequences)": lambda m: hf_generate_k(ref, prompts, m, k),
    }
    prefill, total, outs = {}, {}, {}
    with torch.no_grad():
        for run in methods.values():
            run(2)  # warm-up
        for _ in range(args.rounds):
            for name, run in methods.items():
                t0 = time.perf_counter()
                run(1)
                t1 = time.perf_counter()
                outs[name] = run(new_tokens)
                prefill[name] = min(prefill.get(name, 1e9), t1 - t0)
                total[name] = min(total.get(name, 1e9), time.perf_counter() - t1)
    print(f"\n{n} prompts of {args.prompt_len} tokens x {k} sampled replies of {new_tokens} new tokens")
    print("| replies | method | prompt tokens read | prefill ms | decode ms/step | tok/s | same tokens |")
    print("|---|---|---|---|---|---|---|")
    read = {"nanopack, one prefill per prompt": n * args.prompt_len}
    base = outs["nanopack, one prefill per prompt"]
    for name in methods:
        same = f"{sum(a == b for a, b in zip(outs[name], base))}/{n * k}" if name.startswith("nanopack") else "-"
        decode = (total[name] - prefill[name]) / max(new_tokens - 1, 1)
        print(f"| {n} x {k} | {name} | {read.get(name, n * k * args.prompt_len)} | {prefill[name] * 1e3:.0f} | "
              f"{decode * 1e3:.1f} | {n * k * new_tokens / total[name]:.1f} | {same} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=50)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--k", type=int, default=8, help="replies per prompt in the second table; 0: no table")
    parser.add_argument("--group_prompts", type=int, default=4)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = Transformer(config_from_preset(args.preset)).eval()
    with tempfile.TemporaryDirectory() as folder:  # the same weights, loaded by transformers
        save_pretrained(ours, folder)
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().eval()
    V = ours.config.vocab_size
    print(f"{args.preset} (random weights, {ours.num_params() / 1e6:.1f}M parameters), float32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{args.new_tokens} new tokens, greedy")

    methods = {
        "nanopack, KV cache": lambda prompts, n: generate(ours, prompts, n),
        "nanopack, no cache": lambda prompts, n: generate(ours, prompts, n, kv_cache=False),
        "transformers generate": lambda prompts, n: hf_generate(ref, prompts, n),
    }
    batches = [int(b) for b in args.batches.split(",") if b]
    if batches:
        print("| batch | method | prefill ms | decode ms/step | tok/s | same tokens |\n|---|---|---|---|---|---|")
    for B in batches:
        g = torch.Generator().manual_seed(B)
        lens = [args.prompt_len] if B == 1 else (args.prompt_len + torch.randint(-8, 9, (B,), generator=g)).tolist()
        prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
        prefill, total, outs = {}, {}, {}
        with torch.no_grad():
            for name, run in methods.items():
                run(prompts, 2)  # warm-up: allocator, SDPA kernels, first-call paths
            for r in range(args.rounds):
                for name, run in methods.items():
                    if r > 0 and "no cache" in name:
                        continue
                    t0 = time.perf_counter()
                    run(prompts, 1)
                    t1 = time.perf_counter()
                    outs[name] = run(prompts, args.new_tokens)
                    t2 = time.perf_counter()
                    prefill[name] = min(prefill.get(name, 1e9), t1 - t0)
                    total[name] = min(total.get(name, 1e9), t2 - t1)
        for name in methods:
            decode = (total[name] - prefill[name]) / max(args.new_tokens - 1, 1)
            same = sum(a == b for a, b in zip(outs[name], outs["nanopack, KV cache"]))
            print(f"| {B} | {name} | {prefill[name] * 1e3:.1f} | {decode * 1e3:.1f} | "
                  f"{B * args.new_tokens / total[name]:.1f} | {same}/{B} |", flush=True)
    if args.k:
        group_table(ours, ref, args)


if __name__ == "__main__":
    main()
