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

The second table: k sampled replies to each prompt (train_rl.py's sampling by default), each reply's length drawn from
a lognormal (most stop early, a few run long, as RL replies do; a reply ends at its drawn length, standing in for its
stop token): the engine (nanopack/generate.py) eager with every reply in a slot, eager with half as many slots
(continuous batching: a slot refilled when its reply ends), compiled (torch.compile of the decode step); the generator
before the engine (nanopack/generate.py at that commit, from git: a fixed batch, rows leaving the cache, a torch.Generator and a multinomial
per reply); transformers' generate (num_return_sequences, a row computed until the longest ends). tok/s = tokens of
the replies / the call; best of --rounds. The split: seconds in the model's forward calls, in sampling, and the rest
(Python, packing, cache bookkeeping).

    python bench/bench_generate.py --batches "" --threads 2      # only the varied-lengths table
    python bench/bench_generate.py --batches "" --device cuda --preset llama-3.2-1b   # + the CUDA-graph row, bf16

On CUDA the varied-lengths table adds "engine, CUDA graphs" (nanopack/decode_graphs.py: one graph per bucket of live
replies, captured in the warm-up round) and every time is taken after torch.cuda.synchronize().
"""

import argparse
import math
import os
import subprocess
import types
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack import generate as generation  # noqa: E402
from nanopack.generate import Engine, Sampling, generate  # noqa: E402
from nanopack.hf import save_pretrained  # noqa: E402
from model import Transformer, config_from_preset  # noqa: E402


def hf_generate(model, prompts, new_tokens):
    """transformers' generate on a left-padded batch -> the new tokens of each prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0)  # no stop token: every row runs new_tokens steps
    return out[:, width:].tolist()


def hf_generate_k(model, prompts, new_tokens, k):
    """transformers' generate, k sampled replies per prompt (num_return_sequences) -> the new tokens of each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=k, temperature=1.0,
                         top_k=50, top_p=0.95, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


BEFORE = "ecd0cb2"  # the last commit before the engine
BEFORE_ROW = f"before the engine ({BEFORE})"


def generator_before():
    """nanopack/generate.py at BEFORE, from git, as a module; one change: `limits`, each reply's own max_new_tokens
    (this bench's varied lengths). None outside a git checkout."""
    try:
        source = subprocess.run(["git", "show", f"{BEFORE}:nanopack/generate.py"], capture_output=True, text=True,
                                check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    source = source.replace("num_samples=1, top_p=None):", "num_samples=1, top_p=None, limits=None):")
    source = source.replace("and len(seqs[i]) < positions:", "and len(seqs[i]) < positions and len(new[i]) < limits[i]:")
    module = types.ModuleType("generate_before")
    exec(compile(source, f"{BEFORE}:nanopack/generate.py", "exec"), module.__dict__)
    return module


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timed:
    """A callable timed on every call (its seconds summed): the decode step's split into model and sampling."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync()
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):  # model.config, model.parameters()
        return getattr(self.fn, name)


class StopPerRow(transformers.StoppingCriteria):
    """transformers' per-row stopping: row r is done after limits[r] new tokens (it keeps being computed, padded)."""

    def __init__(self, width, limits):
        self.width, self.limits = width, torch.tensor(limits)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] - self.width >= self.limits.to(input_ids.device)


def hf_generate_varied(model, prompts, limits, k, sampling):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    stop = transformers.StoppingCriteriaList([StopPerRow(width, limits)])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=k,
                         max_new_tokens=max(limits), stopping_criteria=stop, eos_token_id=None, pad_token_id=0,
                         top_k=sampling.get("top_k") or 0, **{n: sampling[n] for n in ("temperature", "top_p")})
    return [row[:n] for row, n in zip(out[:, width:].tolist(), limits)]


def varied_table(ours, ref, args):
    """k sampled replies to each prompt, each reply's length drawn from a lognormal (most stop early, as RL replies
    do): the engine (all replies in slots at once; half as many slots, refilled; compiled) vs the generator before
    it vs transformers (see the module docstring)."""
    n, k = args.group_prompts, args.k
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, ours.config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    limits = torch.empty(n * k).log_normal_(math.log(args.median_len), args.sigma, generator=g)
    limits = limits.clamp(1, args.new_tokens).round().long().tolist()
    sampling = dict(temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p)
    model, compiled, before = Timed(ours), Engine(ours, compile=True), generator_before()
    sampler = generation.sample = Timed(generation.sample)
    engine = lambda m, **kw: Engine(m, **kw).generate(prompts, Sampling(limits, **sampling), k)  # noqa: E731
    methods = {
        "engine, eager": lambda: engine(model),
        f"engine, eager, {n * k // 2} slots": lambda: engine(model, slots=n * k // 2),
        "engine, compiled": lambda: compiled.generate(prompts, Sampling(limits, **sampling), k),
        "transformers generate": lambda: hf_generate_varied(ref, prompts, limits, k, sampling),
    }
    if args.device == "cuda":  # one engine: its cache and graphs kept from call to call
        graphs = Engine(ours, cuda_graphs=True)
        methods["engine, CUDA graphs"] = lambda: graphs.generate(prompts, Sampling(limits, **sampling), k)
    methods = {name: run for name, run in methods.items() if not any(x and x in name for x in args.skip.split(","))}
    if before is not None:
        before.sample = Timed(before.sample)
        gens = lambda: [torch.Generator().manual_seed(r) for r in range(n * k)]  # noqa: E731
        methods[BEFORE_ROW] = lambda: before.generate(model, prompts, max(limits), num_samples=k, limits=limits,
                                                      generator=gens(), **sampling)
    samplers = [sampler] + [before.sample] * (before is not None)
    best, split = {}, {}
    with torch.no_grad():
        for run in methods.values():
            run()  # warm-up (and the compile)
        for _ in range(args.rounds):
            for name, run in methods.items():
                for timed in [model, *samplers]:
                    timed.seconds = 0.0
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                total = time.perf_counter() - t0
                if total < best.get(name, 1e9):
                    best[name] = total
                    drawn = sum(timed.seconds for timed in samplers)
                    split[name] = (model.seconds, drawn, total - model.seconds - drawn)
    print(f"\n{n} prompts of {args.prompt_len} tokens x {k} sampled replies ({sampling}), lengths lognormal: median "
          f"{args.median_len}, sigma {args.sigma}, cut at {args.new_tokens}: {sum(limits)} tokens, mean "
          f"{sum(limits) / len(limits):.1f}, longest {max(limits)}")
    print("| method | seconds | tok/s | vs before | model s | sampling s | Python and the rest s |\n|---|---|---|---|---|---|---|")
    for name in methods:
        parts = " | ".join(f"{x:.2f}" for x in split[name]) if "eager" in name or "before" in name \
            else "- | - | -"
        print(f"| {name} | {best[name]:.2f} | {sum(limits) / best[name]:.0f} | "
              f"{best.get(BEFORE_ROW, math.nan) / best[name]:.2f}x | {parts} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=50)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--k", type=int, default=8, help="replies per prompt in the second table; 0: no table")
    parser.add_argument("--group_prompts", type=int, default=8)
    parser.add_argument("--median_len", type=float, default=12, help="the second table's reply lengths: lognormal")
    parser.add_argument("--sigma", type=float, default=1.0)
    # the second table's sampling: train_rl.py's default
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", help="cuda: the model in bfloat16, and the CUDA-graph row")
    parser.add_argument("--skip", default="", help="the second table's methods left out, e.g. compiled,transformers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = Transformer(config_from_preset(args.preset)).eval()
    with tempfile.TemporaryDirectory() as folder:  # the same weights, loaded by transformers
        save_pretrained(ours, folder)
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().eval()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    ours, ref = ours.to(args.device, dtype), ref.to(args.device, dtype)
    V = ours.config.vocab_size
    print(f"{args.preset} (random weights, {ours.num_params() / 1e6:.1f}M parameters), {dtype}, {args.device}, "
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
        varied_table(ours, ref, args)


if __name__ == "__main__":
    main()
