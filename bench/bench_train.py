"""
End-to-end training steps, side by side on the same data, model shape, initial weights and example order:

  packed          nanopack as train_sft.py / train_dpo.py run it (whole sequences packed into microbatch_tokens)
  packed+compile  the same with torch.compile per block (micro-batches padded to one fixed shape)
  padded          nanopack with packing disabled: every micro-batch padded to its longest sequence
  hf              Hugging Face transformers LlamaForCausalLM (SDPA attention) on the same padded micro-batches,
                  full logits + cross-entropy (SFT) or log_softmax + gather (DPO): what most users run today

    python bench/bench_train.py --mode sft                          # CPU: small model; CUDA: Llama-3.2-1B shape
    python bench/bench_train.py --mode dpo --data builtin
    python bench/bench_train.py --mode sft --size tiny --steps 1    # seconds; what the smoke test runs

A step is `batch_size` examples (DPO: pairs) drawn in one seeded order; packed configurations pack them by
best-fit-decreasing into bins of at most microbatch_tokens tokens, padded ones group them in that order while
(examples x longest) fits the same budget. Reported tokens are real tokens (padding excluded), timed over
--steps steps after --warmup steps; MFU counts FLOPs of real tokens from the actual lengths (CUDA only).
DPO uses reference log-probs computed before timing by each configuration's own forward (as the cached mode
does), so the steps compare the policy's forward + backward only. Each configuration runs in a fresh
subprocess, so its peak memory (CUDA max allocated, or on CPU the peak RSS growth) is its own.
TRL's trainers are not run here: see bench/RESULTS.md.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {  # model shape, token budget per micro-batch, examples per step, length scale of the lognormal set
    "tiny": dict(model=dict(d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64, vocab_size=512, max_seq_len=8192),
                 microbatch_tokens=1024, batch_size=8, scale=1 / 16),
    "small": dict(model=dict(d_model=256, n_layer=4, n_head=4, n_kv_head=2, ffn_hidden=688, vocab_size=8192, max_seq_len=8192),
                  microbatch_tokens=8192, batch_size=16, scale=1.0),
    "1b": dict(model="llama-3.2-1b", microbatch_tokens=16384, batch_size=64, scale=1.0),
}
CONFIGS = ("packed", "packed+compile", "padded", "hf")


# -----------------------------------------------------------------------------
# data: {"ids", "offsets", "loss_mask"} as data/prepare.py writes them; DPO pairs are sequences 2i, 2i+1


def lognormal_data(n, mode, vocab, scale, seed=0):
    """Chat-like lengths: lognormal with median 300 and p99 ~4k tokens (sigma 1.11), times scale. SFT: the
    second half of each sequence is the response. DPO: a shared prompt, then two responses of their own
    lengths. Random token ids: speed does not depend on them, and the loss is still comparable across runs."""
    rng = np.random.default_rng(seed)
    draw = lambda size: np.clip(np.round(rng.lognormal(np.log(300 * scale), 1.11, size)), 8, 8192 * scale).astype(int)
    seqs = []
    if mode == "sft":
        for L in draw(n):
            seqs.append((rng.integers(0, vocab, L), np.r_[np.zeros(L // 2), np.ones(L - L // 2)]))
    else:
        for p, c, r in zip(draw(n) // 2 + 1, draw(n) // 2 + 1, draw(n) // 2 + 1):
            prompt = rng.integers(0, vocab, p)
            for resp in (c, r):
                seqs.append((np.r_[prompt, rng.integers(0, vocab, resp)], np.r_[np.zeros(p), np.ones(resp)]))
    return as_data(seqs)


def builtin_data(n, mode):
    from data.arithmetic import dpo_examples, sft_examples
    from tokenizer import get_tokenizer
    tok = get_tokenizer("byte")
    seqs = []
    if mode == "sft":
        for rec in sft_examples("train", n):
            seqs.append(tok.render(rec["messages"]))
    else:
        for rec in dpo_examples("train", n):
            seqs.extend(tok.render_pair(rec["prompt"], rec["chosen"], rec["rejected"]))
    return as_data(seqs)


def as_data(seqs):
    lengths = [len(ids) for ids, _ in seqs]
    return dict(ids=np.concatenate([np.asarray(i) for i, _ in seqs]).astype(np.int64),
                offsets=np.r_[0, np.cumsum(lengths)].astype(np.int64),
                loss_mask=np.concatenate([np.asarray(m) for _, m in seqs]).astype(np.uint8))


# -----------------------------------------------------------------------------
# micro-batches


def steps_of(data, mode, batch_size, budget, n_steps, packed, seed=0):
    """[[micro-batch unit indices]] per step: the same units per step for every configuration."""
    from packing import pack
    lengths = np.diff(data["offsets"])
    if mode == "dpo":
        lengths = lengths.reshape(-1, 2)
    order = np.random.default_rng(seed).permutation(len(lengths))
    steps = []
    for s in range(n_steps):
        units = order[(s * batch_size) % len(order):][:batch_size]
        if packed:
            size = lengths[units].sum(1) if mode == "dpo" else lengths[units]
            steps.append([units[b] for b in pack(size, budget)])
        else:  # in order, while (sequences x longest) fits the budget
            longest = lengths[units].max(1) if mode == "dpo" else lengths[units]
            per = 2 if mode == "dpo" else 1
            groups, cur, cur_max = [], [], 0
            for u, L in zip(units, longest):
                if cur and (len(cur) + 1) * per * max(cur_max, L) > budget:
                    groups.append(np.array(cur))
                    cur, cur_max = [], 0
                cur.append(u)
                cur_max = max(cur_max, L)
            steps.append(groups + [np.array(cur)])
    return steps


def padded_batch(data, units, dpo):
    """A PackedBatch whose sequences are each padded to the longest: n x L positions, the padding after each
    sequence's real tokens inside its own segment (causal, so it never changes a real token's result)."""
    import torch
    from packing import IGNORE_INDEX, PackedBatch, make_batch
    mb = make_batch(data, units, dpo=dpo)
    lens = np.diff(mb.cu_seqlens.numpy())
    n, L = len(lens), int(lens.max())
    idx = (np.arange(n)[:, None] * L + np.arange(L)[None, :])[np.arange(L)[None, :] < lens[:, None]]
    grid = lambda fill, src: torch.full((n * L,), fill, dtype=torch.long).index_copy_(0, torch.from_numpy(idx), src)
    return PackedBatch(
        input_ids=grid(0, mb.input_ids), labels=grid(IGNORE_INDEX, mb.labels),
        position_ids=torch.arange(L).repeat(n), seq_ids=torch.arange(n).repeat_interleave(L),
        cu_seqlens=torch.arange(0, n * L + 1, L, dtype=torch.int32), max_seqlen=L,
        example_indices=mb.example_indices, pair_indices=mb.pair_indices, num_sequences=n, num_pairs=mb.num_pairs,
        num_tokens=mb.num_tokens, num_target_tokens=mb.num_target_tokens, num_padding=n * L - mb.num_tokens)


# -----------------------------------------------------------------------------
# one configuration, in its own process


def run_config(name, args):
    import torch
    import torch.nn.functional as F
    from model import Transformer, config_from_preset
    import common

    size = SIZES[args.size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast("cuda", dtype=dtype) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    dpo = args.mode == "dpo"
    n_units = args.batch_size * (args.warmup + args.steps)
    data = (builtin_data(n_units, args.mode) if args.data == "builtin" else
            lognormal_data(n_units, args.mode, vocab=args.vocab, scale=size["scale"]))
    steps = steps_of(data, args.mode, args.batch_size, args.microbatch_tokens, args.warmup + args.steps,
                     packed=name.startswith("packed"))

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    torch.manual_seed(0)
    cfg = (config_from_preset(size["model"]) if isinstance(size["model"], str) else
           config_from_preset("tiny", **size["model"]))
    net = Transformer(cfg)
    if name == "hf":  # the same weights, through a Hugging Face checkpoint
        from transformers import AutoModelForCausalLM
        with tempfile.TemporaryDirectory() as tmp:
            net.save_pretrained(tmp)
            del net
            net = AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32, attn_implementation="sdpa")
    net.to(device).train()
    if name == "packed+compile":
        for block in net.layers:
            block.compile()
    opt = common.make_optimizer(net, 1e-3, 0.0, device_type=device.type)
    flops_model = net  # FLOPs per token from our formula for every row; hf: a weightless copy of our model
    if name == "hf":
        with torch.device("meta"):
            flops_model = Transformer(cfg)

    def batches(step):
        """-> [(micro-batch on device, real sequence lengths)]"""
        from packing import make_batch
        out = []
        for units in step:
            mb = (padded_batch(data, units, dpo) if name in ("padded", "hf") else
                  make_batch(data, units, pad_to=args.microbatch_tokens if name == "packed+compile" else None, dpo=dpo))
            lens = np.diff(data["offsets"])[mb.example_indices.numpy()]
            out.append((mb.to(device), lens))
        return out

    def forward(mb, lens):
        """SFT: summed token loss. DPO: (T,) token log-probs aligned with mb.labels (0 where ignored)."""
        if name != "hf":
            out = net(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels, logprobs=dpo)
            return out if dpo else out[0]
        n, L = mb.num_sequences, mb.max_seqlen
        ids, labels = mb.input_ids.view(n, L), mb.labels.view(n, L)
        mask = torch.arange(L, device=device)[None, :] < torch.as_tensor(lens, device=device)[:, None]
        logits = net(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()  # (n, L-1, V)
        targets = labels[:, 1:]
        if not dpo:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return F.pad(logp * (targets != -100), (1, 0)).reshape(-1)

    def microbatch_loss(mb, lens, normaliser, ref):
        with autocast:
            out = forward(mb, lens)
        if not dpo:
            return out / normaliser
        pc, pr = mb.pair_sums(out)
        rc, rr = ref[mb.pair_indices, 0], ref[mb.pair_indices, 1]
        return -F.logsigmoid(0.1 * ((pc - rc) - (pr - rr))).sum() / normaliser

    all_steps = [batches(step) for step in steps]
    ref = None
    if dpo:  # reference log-probs of the initial weights, before timing (what reference='cached' does)
        ref = torch.zeros(len(data["offsets"]) // 2, 2, device=device)
        with torch.no_grad():
            for mbs in all_steps:
                for mb, lens in mbs:
                    with autocast:
                        pc, pr = mb.pair_sums(forward(mb, lens))
                    ref[mb.pair_indices] = torch.stack([pc, pr], 1).float()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens = positions = padding = flops = 0.0
    for i, mbs in enumerate(all_steps):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        normaliser = sum(mb.num_pairs for mb, _ in mbs) if dpo else sum(mb.num_target_tokens for mb, _ in mbs)
        loss = 0.0
        for mb, lens in mbs:
            mb_loss = microbatch_loss(mb, lens, normaliser, ref)
            mb_loss.backward()
            loss += mb_loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            for mb, lens in mbs:
                flops += flops_model.flops_per_token(lens, mb.num_target_tokens) * mb.num_tokens
                tokens += mb.num_tokens
                padding += mb.num_padding
                positions += mb.input_ids.numel()
    loss = float(loss)  # waits for the last step
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - rss0)
    peak_flops = common.peak_flops(device)
    return dict(tokens_per_sec=tokens / elapsed, mfu=flops / elapsed / peak_flops if peak_flops else None,
                peak_gib=peak, padding=padding / positions, loss=loss, tokens=tokens)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("sft", "dpo"), default="sft")
    p.add_argument("--data", choices=("lognormal", "builtin"), default="lognormal")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: 1b on CUDA, small on CPU")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--batch_size", type=int, default=None, help="examples (DPO: pairs) per step")
    p.add_argument("--microbatch_tokens", type=int, default=None)
    p.add_argument("--mem_limit_gb", type=float, default=20.0, help="CPU: address-space limit of each child")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    cuda = torch.cuda.is_available()
    args.size = args.size or ("1b" if cuda else "small")
    size = SIZES[args.size]
    args.batch_size = args.batch_size or size["batch_size"]
    args.microbatch_tokens = args.microbatch_tokens or size["microbatch_tokens"]
    model = size["model"]
    args.vocab = 128256 if isinstance(model, str) else model["vocab_size"]
    if args.child:  # inside a subprocess: one configuration, its result as JSON
        if not cuda:
            limit = int(args.mem_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            res = run_config(args.child, args)
        except (RuntimeError, MemoryError) as e:  # CPU allocator failure or torch.OutOfMemoryError
            res = dict(error="OOM" if "memory" in str(e).lower() else str(e)[:120])
        print("RESULT " + json.dumps(res))
        return

    dev = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.mode.upper()} | device {dev} | torch {torch.__version__} | {'bfloat16 autocast' if cuda else 'float32'} | "
          f"model {model if isinstance(model, str) else args.size + ' ' + json.dumps(model)} | data {args.data} | "
          f"{args.batch_size} {'pairs' if args.mode == 'dpo' else 'examples'}/step, microbatch_tokens "
          f"{args.microbatch_tokens} | {args.steps} timed steps after {args.warmup}")
    rows = []
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", name] + [a for a in sys.argv[1:]]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        res = json.loads(line[-1][7:]) if line else dict(error=f"crashed (exit {out.returncode}): "
                                                            + (out.stderr.strip().splitlines() or [""])[-1][:120])
        print(f"  {name}: {time.perf_counter() - t:.0f}s", flush=True)
        rows.append((name, res))
    base = dict(rows).get("hf", {}).get("tokens_per_sec")
    mem_name = "peak GiB (CUDA alloc)" if cuda else "peak GiB (RSS growth)"
    header = f"| config | real tok/s (per GPU) | MFU | {mem_name} | padding | loss after {args.steps + args.warmup} steps | speed vs hf |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, r in rows:
        if "error" in r:
            print(f"| {name} | {r['error']} | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = f"{r['tokens_per_sec'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['tokens_per_sec']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {100 * r['padding']:.1f}% | "
              f"{r['loss']:.4f} | {ratio} |")


if __name__ == "__main__":
    main()
