"""
End-to-end training steps, side by side on the same data, model shape, initial weights and example order:

  packed          nanopack packing whole sequences into microbatch_tokens (train_sft.py; train_dpo.py with
                  prefix_sharing=False)
  packed+shared   DPO as train_dpo.py runs it: a pair's shared prompt computed once (prompt | chosen | rejected)
  packed+compile  the same with torch.compile per block, dynamic shapes (as the scripts do: no padding)
  packed+compile-static  compiled with one static shape: every micro-batch padded to microbatch_tokens (before)
  padded          nanopack with packing disabled: every micro-batch padded to its longest sequence
  hf              Hugging Face transformers LlamaForCausalLM (SDPA attention) on the same padded micro-batches,
                  full logits + cross-entropy (SFT) or log_softmax + gather (DPO): what most users run today
  trl-padfree     SFT: TRL's SFTTrainer with padding_free=True (same examples per step, see run_trl)
  trl-packed      SFT: TRL's SFTTrainer with packing=True (BFD into rows of microbatch_tokens)
  trl             DPO: TRL's DPOTrainer with precomputed reference log-probs (padded: see run_trl)

    python bench/bench_train.py --mode sft                          # CPU: small model; CUDA: Llama-3.2-1B shape
    python bench/bench_train.py --mode dpo --data builtin
    python bench/bench_train.py --mode dpo --data prompt_heavy --configs packed,packed+shared,hf,trl
    python bench/bench_train.py --mode sft --size tiny --steps 1    # seconds; what the smoke test runs

A step is `batch_size` examples (DPO: pairs) drawn in one seeded order; packed configurations pack them by
best-fit-decreasing into bins of at most microbatch_tokens tokens, padded ones group them in that order while
(examples x longest) fits the same budget. Reported tokens are real tokens (padding excluded), timed over
--steps steps after --warmup steps; MFU counts FLOPs of real tokens from the actual lengths (CUDA only). Compiled rows
also give the graphs compiled, the recompiles (each failed guard is printed below the table) and dynamo's compile
seconds (bench/compile_stats.py).
DPO uses reference log-probs computed before timing by each configuration's own forward (as the cached mode
does), so the steps compare the policy's forward + backward only; pairs/s is the figure to compare there, since
packed+shared computes fewer tokens for the same pairs. DPO data: lognormal (prompt and each response ~150
tokens), prompt_heavy (prompt median 4x the responses': RAG, summarisation, multi-turn), ultrafeedback (prompt
~160, responses ~250 tokens: the lengths issue 18 quotes for UltraFeedback; not re-measured, no network here). Each configuration runs in a fresh
subprocess, so its peak memory (CUDA max allocated, or on CPU the peak RSS growth) is its own.
All rows use the same optimizer: AdamW, lr 1e-3 constant, betas (0.9, 0.95), no weight decay, clip 1.0.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

import compile_stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {  # model shape, token budget per micro-batch, examples per step, length scale of the lognormal set
    "tiny": dict(model=dict(d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=64, vocab_size=512, max_seq_len=8192),
                 microbatch_tokens=1024, batch_size=8, scale=1 / 16),
    "small": dict(model=dict(d_model=256, n_layer=4, n_head=4, n_kv_head=2, ffn_hidden=688, vocab_size=8192, max_seq_len=8192),
                  microbatch_tokens=8192, batch_size=16, scale=1.0),
    "1b": dict(model="llama-3.2-1b", microbatch_tokens=16384, batch_size=64, scale=1.0),
    # the Llama-3 vocabulary on a narrow model: what the LM head alone costs in memory at 16k-token micro-batches
    "vocab128k": dict(model=dict(d_model=256, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=688, vocab_size=128256,
                                 max_seq_len=16384), microbatch_tokens=16384, batch_size=16, scale=1.0),
}
CONFIGS = dict(sft=("packed", "packed+compile", "packed+compile-static", "padded", "hf", "trl-padfree", "trl-packed"),
               dpo=("packed", "packed+shared", "packed+compile", "packed+compile-static", "padded", "hf", "trl"))


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


PAIR_LENGTHS = {  # DPO sets with a shared prompt: (prompt median, response median, sigma, cap), times scale
    "prompt_heavy": (800, 200, 0.5, (2000, 1000)),
    "ultrafeedback": (160, 250, 0.8, (1500, 1500)),
}


def pair_data(n, kind, vocab, scale, seed=0):
    """Preference pairs with lognormal prompt and response lengths (PAIR_LENGTHS), random token ids."""
    rng = np.random.default_rng(seed)
    p_med, r_med, sigma, (p_cap, r_cap) = PAIR_LENGTHS[kind]
    draw = lambda med, cap: int(np.clip(round(rng.lognormal(np.log(med * scale), sigma)), 1, max(1, cap * scale)))
    seqs = []
    for _ in range(n):
        prompt = rng.integers(0, vocab, draw(p_med, p_cap))
        for _ in range(2):
            resp = rng.integers(0, vocab, draw(r_med, r_cap))
            seqs.append((np.r_[prompt, resp], np.r_[np.zeros(len(prompt)), np.ones(len(resp))]))
    return as_data(seqs)


def builtin_data(n, mode):
    from data.arithmetic import dpo_examples, sft_examples
    from nanopack.tokenizer import get_tokenizer
    tok = get_tokenizer("byte")
    seqs = []
    if mode == "sft":
        for rec in sft_examples("train", n):
            seqs.append(tok.render(rec["messages"]))
    else:
        for rec in dpo_examples("train", n):
            seqs.extend(tok.render_pair(rec["prompt"], rec["chosen"], rec["rejected"]))
    return as_data(seqs)


def make_data(args, n):
    if args.data == "builtin":
        return builtin_data(n, args.mode)
    if args.data in PAIR_LENGTHS:
        return pair_data(n, args.data, vocab=args.vocab, scale=SIZES[args.size]["scale"])
    return lognormal_data(n, args.mode, vocab=args.vocab, scale=SIZES[args.size]["scale"])


def as_data(seqs):
    lengths = [len(ids) for ids, _ in seqs]
    return dict(ids=np.concatenate([np.asarray(i) for i, _ in seqs]).astype(np.int64),
                offsets=np.r_[0, np.cumsum(lengths)].astype(np.int64),
                loss_mask=np.concatenate([np.asarray(m) for _, m in seqs]).astype(np.uint8))


# -----------------------------------------------------------------------------
# micro-batches


def steps_of(data, mode, batch_size, budget, n_steps, packed, seed=0, prefix=None):
    """[[micro-batch unit indices]] per step: the same units per step for every configuration. prefix: DPO
    pairs packed by what they compute with their shared prefix computed once."""
    from packing import pack
    lengths = np.diff(data["offsets"]) - (0 if prefix is None else prefix)  # what each sequence computes
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


def sequences(mb, dpo):
    """The data's sequences in a micro-batch, in order: its units (SFT), or pair u's 2u, 2u+1 (DPO)."""
    u = mb.units.cpu().numpy()
    return np.stack([2 * u, 2 * u + 1], 1).reshape(-1) if dpo else u


def padded_batch(data, units, dpo):
    """A PackedBatch whose sequences are each padded to the longest: n x L positions, the padding after each
    sequence's real tokens inside its own segment (causal, so it never changes a real token's result)."""
    import torch
    from packing import IGNORE_INDEX, PackedBatch, make_batch
    mb = make_batch(data, units, 2 if dpo else 1)
    flat = make_batch(data, sequences(mb, dpo))  # the same sequences, one target slot per position
    lens = np.diff(flat.cu_seqlens.numpy())
    n, L = len(lens), int(lens.max())
    idx = (np.arange(n)[:, None] * L + np.arange(L)[None, :])[np.arange(L)[None, :] < lens[:, None]]
    grid = lambda fill, src: torch.full((n * L,), fill, dtype=torch.long).index_copy_(0, torch.from_numpy(idx), src)
    return PackedBatch(
        input_ids=grid(0, flat.input_ids), targets=grid(IGNORE_INDEX, flat.targets), target_rows=None,
        position_ids=torch.arange(L).repeat(n), seq_ids=torch.arange(n).repeat_interleave(L),
        cu_seqlens=torch.arange(0, n * L + 1, L, dtype=torch.int32), max_seqlen=L, kv=None, units=mb.units,
        num_sequences=n, num_groups=mb.num_groups, num_tokens=mb.num_tokens, num_target_tokens=mb.num_target_tokens,
        num_padding=n * L - mb.num_tokens)


def pad_batch(mb, T, segment=128):
    """mb padded to exactly T positions (one static shape for torch.compile; the core never pads): a tail of dummy
    segments of at most `segment` tokens, each its own cu_seqlens entry with positions 0.., so attention never mixes
    them with real tokens and no position passes the model's range; the tail has no targets."""
    import torch
    from packing import IGNORE_INDEX
    n_pad = T - len(mb.input_ids)
    assert n_pad >= 0 and mb.kv is None, f"{len(mb.input_ids)} tokens, or a shared prefix, cannot be padded to {T}"
    if n_pad == 0:
        return mb
    tail = [min(segment, n_pad - s) for s in range(0, n_pad, segment)]
    grow = lambda t, fill: torch.cat([t, torch.full((n_pad,), fill, dtype=t.dtype)])
    per_position = mb.target_rows is None  # SFT: targets and seq_ids per position; DPO's are per target, unchanged
    return replace(
        mb, input_ids=grow(mb.input_ids, 0), position_ids=torch.cat([mb.position_ids, *map(torch.arange, tail)]),
        targets=grow(mb.targets, IGNORE_INDEX) if per_position else mb.targets,
        seq_ids=grow(mb.seq_ids, mb.num_sequences) if per_position else mb.seq_ids,
        cu_seqlens=torch.cat([mb.cu_seqlens, mb.cu_seqlens[-1] + torch.tensor(tail).cumsum(0).int()]),
        max_seqlen=max(mb.max_seqlen, tail[0]), num_padding=mb.num_padding + n_pad)


# -----------------------------------------------------------------------------
# one configuration, in its own process


def model_config(args):
    from model import config_from_preset
    model = SIZES[args.size]["model"]
    return config_from_preset(model) if isinstance(model, str) else config_from_preset("tiny", **model)


def rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def matmul_peak(cuda, iters=10):
    """FLOP/s of this machine's best large matmul (CUDA: bf16 8192^3; CPU: fp32 2048^3), the best of iters: the ceiling
    the training rows are measured against, where no datasheet figure exists (a CPU) or to check the one that does."""
    import torch
    n, dtype, device = (8192, torch.bfloat16, "cuda") if cuda else (2048, torch.float32, "cpu")
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    best = float("inf")
    for _ in range(iters + 1):  # the first warms up
        t = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def result(tokens, positions, flops, elapsed, loss, rss0):
    """The row of one configuration: real tokens/s, MFU (CUDA), peak memory (CUDA allocated / CPU RSS growth)."""
    import torch
    from nanopack import metrics
    cuda = torch.cuda.is_available()
    peak_flops = metrics.peak_flops(torch.device("cuda" if cuda else "cpu"))
    return dict(tokens_per_sec=tokens / elapsed, mfu=flops / elapsed / peak_flops if peak_flops else None, elapsed=elapsed, flops=flops,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else rss_gib() - rss0,
                padding=1 - tokens / positions, loss=loss, tokens=tokens, positions=positions, **compile_stats.read())


def run_config(name, args):
    import torch
    import torch.nn.functional as F
    from model import Transformer
    from nanopack.hf import save_pretrained
    from nanopack.startup import param_groups

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = torch.autocast("cuda", dtype=dtype) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    dpo = args.mode == "dpo"
    data = make_data(args, args.batch_size * (args.warmup + args.steps))
    from packing import shared_prefixes
    prefix = shared_prefixes(data) if name == "packed+shared" else None
    steps = steps_of(data, args.mode, args.batch_size, args.microbatch_tokens, args.warmup + args.steps,
                     packed=name.startswith("packed"), prefix=prefix)

    rss0 = rss_gib()
    torch.manual_seed(0)
    cfg = model_config(args)
    with device:  # initialised where it trains: a 1B model's random init takes seconds on the CPU
        net = Transformer(cfg)
    if name == "hf":  # the same weights, through a Hugging Face checkpoint
        from transformers import AutoModelForCausalLM
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(net, tmp)
            del net
            net = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
    net.to(device).train()
    if name.startswith("packed+compile"):
        for block in net.layers:
            block.compile(dynamic=name == "packed+compile")
    opt = torch.optim.AdamW(param_groups(net, 0.0), lr=1e-3, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    flops_model = net  # FLOPs per token from our formula for every row; hf: a weightless copy of our model
    if name == "hf":
        with torch.device("meta"):
            flops_model = Transformer(cfg)

    def batches(step):
        """-> [(micro-batch on device, real sequence lengths)]"""
        from packing import make_batch
        out = []
        for units in step:
            mb = padded_batch(data, units, dpo) if name in ("padded", "hf") else make_batch(data, units, 2 if dpo else 1, prefix)
            if name.endswith("static"):
                mb = pad_batch(mb, args.microbatch_tokens)
            lens = np.diff(data["offsets"])[sequences(mb, dpo)]
            out.append((mb.to(device), lens))
        return out

    def forward(mb, lens):
        """SFT: summed token loss. DPO: (T,) log-probs of mb.targets per predicting position (0 where ignored)."""
        if name != "hf":
            out = net(**mb.inputs(), logprobs=dpo)
            return out if dpo else out[0]
        n, L = mb.num_sequences, mb.max_seqlen
        ids, targets = mb.input_ids.view(n, L), mb.targets.view(n, L)
        mask = torch.arange(L, device=device)[None, :] < torch.as_tensor(lens, device=device)[:, None]
        logits = net(input_ids=ids, attention_mask=mask.long()).logits.float()  # (n, L, V)
        if not dpo:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (logp * (targets != -100)).reshape(-1)

    def microbatch_loss(mb, lens, normaliser, ref):
        with autocast:
            out = forward(mb, lens)
        if not dpo:
            return out / normaliser
        pc, pr = mb.pair_sums(out)
        rc, rr = ref[mb.units, 0], ref[mb.units, 1]
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
                    ref[mb.units] = torch.stack([pc, pr], 1).float()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens = positions = flops = 0.0
    profiler = None
    for i, mbs in enumerate(all_steps):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            if args.profile:
                activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
                profiler = torch.profiler.profile(activities=activities)
                profiler.start()
            t0 = time.perf_counter()
            compiling0 = compile_stats.read()["compile_s"]  # a recompile inside the timed steps: left out below
        normaliser = sum(mb.num_groups for mb, _ in mbs) if dpo else sum(mb.num_target_tokens for mb, _ in mbs)
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
                if mb.kv is not None:  # query segments over longer key segments (see model.flops_per_token)
                    lens = np.diff(mb.cu_seqlens.cpu().numpy())[:mb.num_sequences]
                flops += flops_model.flops_per_token(lens, mb.num_target_tokens, mb.key_lengths()) * mb.num_tokens
                tokens += mb.num_tokens
                positions += mb.input_ids.numel()
    loss = float(loss)  # waits for the last step
    compiling = compile_stats.read()["compile_s"] - compiling0
    elapsed = time.perf_counter() - t0 - compiling
    if profiler is not None:
        profiler.stop()
        print_profile(name, profiler, device.type == "cuda", elapsed)
    return dict(result(tokens, positions, flops, elapsed, loss, rss0), timed_compile_s=compiling)

PROFILE_GROUPS = (  # (group, substrings of aten op names), first match wins; self time only, so no double counting
    ("attention", ("attention", "flash", "varlen")),
    ("matmul (linear layers, LM head)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")),
    ("softmax / log-softmax / cross-entropy", ("softmax", "nll_loss", "logsumexp", "cross_entropy")),
    ("optimizer (AdamW, grad clipping)", ("_foreach", "adam", "norm")),
    ("copies, casts, gathers, fills", ("copy", "_to_copy", "clone", "cat", "index", "gather", "scatter", "fill", "zero",
                                       "pad", "contiguous", "empty", "slice", "select", "view", "reshape", "split")),
)


def print_profile(name, prof, cuda, elapsed):
    """Where the time of the timed steps goes: aten ops' self time (device time on CUDA), grouped, then the top ops."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = [(e.key, getattr(e, key) / 1e3, e.count) for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(ms for _, ms, _ in ops)
    groups = {}
    for op, ms, _ in ops:
        g = next((g for g, subs in PROFILE_GROUPS if any(x in op for x in subs)), "other element-wise (norms, SiLU, RoPE, ...)")
        groups[g] = groups.get(g, 0.0) + ms
    print(f"\nprofile of {name}: {elapsed:.2f}s of timed steps under the profiler, aten self {'device' if cuda else 'CPU'} time {total / 1e3:.2f}s")
    print("| where | ms | share |\n|---|---|---|")
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {ms:,.0f} | {100 * ms / total:.1f}% |")
    print("| top ops | ms | calls |\n|---|---|---|")
    for op, ms, n in sorted(ops, key=lambda o: -o[1])[:12]:
        print(f"| {op} | {ms:,.0f} | {n} |")


# -----------------------------------------------------------------------------
# TRL's trainers on the same token ids, weights, optimizer and (where the method allows) the same steps


def hf_tokenizer(vocab):
    """A word-level tokenizer over ids 0..vocab-1: TRL wants a processing class for its pad token; the
    token ids themselves are handed over ready-made, so every configuration trains on the same tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def run_trl(name, args):
    """trl-padfree  SFTTrainer(padding_free=True): each micro-batch's examples concatenated into one row,
                 the same examples per step as the other rows (sequential order, token-weighted loss).
    trl-packed   SFTTrainer(packing=True, packing_strategy="bfd"): the data set packed once into rows of
                 microbatch_tokens; a step is a whole number of rows, so its examples differ from the others'.
    trl          DPOTrainer(precompute_ref_log_probs=True), padded: TRL 1.x disables padding_free for DPO."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from nanopack.hf import save_pretrained
    from model import Transformer

    cuda = torch.cuda.is_available()
    dpo = args.mode == "dpo"
    n_steps = args.warmup + args.steps
    if dpo and name != "trl" or not dpo and name not in ("trl-padfree", "trl-packed"):
        raise ValueError(f"{name} is not a TRL configuration for --mode {args.mode}")
    # micro-batches per step: as many as the packed rows need for a step's tokens on average
    n_units = args.batch_size * n_steps * (4 if name == "trl-packed" else 1)  # packing needs rows to spare
    data = make_data(args, n_units)
    lengths = np.diff(data["offsets"])
    per_step = lengths.reshape(-1, 2).sum(1).mean() if dpo else lengths.mean()
    rows_per_step = max(1, int(np.ceil(per_step * args.batch_size / args.microbatch_tokens)))
    accum = min(d for d in range(rows_per_step, args.batch_size + 1) if args.batch_size % d == 0)
    seqs = [(data["ids"][a:b].tolist(), data["loss_mask"][a:b]) for a, b in zip(data["offsets"][:-1], data["offsets"][1:])]
    order = np.random.default_rng(0).permutation(len(seqs) // 2 if dpo else len(seqs))  # as steps_of draws it
    if dpo:
        rows = []
        for u in order:
            (c, cm), (r, rm) = seqs[2 * u], seqs[2 * u + 1]
            p = int(np.argmax(cm))  # the shared prompt: everything before the first loss token
            if c[:p] != r[:p] or not (cm[p:].all() and rm[p:].all()):
                raise ValueError(f"pair {u} is not prompt + completion: TRL cannot take it")
            rows.append(dict(prompt_ids=c[:p], chosen_ids=c[p:], rejected_ids=r[p:]))
    else:
        rows = [dict(input_ids=seqs[u][0], labels=np.where(seqs[u][1], seqs[u][0], -100).tolist()) for u in order]
    dataset = datasets.Dataset.from_list(rows)

    rss0 = rss_gib()
    torch.manual_seed(0)
    cfg = model_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        with torch.device("cuda" if cuda else "cpu"):  # initialised as run_config does
            init = Transformer(cfg)
        save_pretrained(init, tmp)  # the same initial weights as every other row
        del init
        net = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
    with torch.device("meta"):
        flops_model = Transformer(cfg)
    shared = dict(output_dir=tempfile.mkdtemp(), max_steps=n_steps, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.95,
                  weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
                  gradient_accumulation_steps=1 if name == "trl-packed" else accum,
                  per_device_train_batch_size=rows_per_step if name == "trl-packed" else args.batch_size // accum,
                  train_sampling_strategy="sequential", bf16=cuda, use_cpu=not cuda, logging_steps=1,
                  save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0)
    if dpo:
        from trl import DPOConfig, DPOTrainer as Base
        config = DPOConfig(beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=None, **shared)
    else:
        from trl import SFTConfig, SFTTrainer as Base
        config = SFTConfig(padding_free=True, packing=name == "trl-packed", packing_strategy="bfd",
                           max_length=args.microbatch_tokens if name == "trl-packed" else None, **shared)

    class Trainer(Base):
        """Counts real tokens, positions, FLOPs and the loss of each micro-batch it trains on."""
        tally = dict(tokens=0, positions=0, flops=0.0, loss=0.0)

        def _prepare_dataset(self, dataset, *a, **k):  # DPO: the ids are ready; SFT's own path keeps them as is
            return dataset if dpo else super()._prepare_dataset(dataset, *a, **k)

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            if mask is not None:
                lens, heads = mask.sum(1), inputs["completion_mask"].sum()
            else:
                lens, heads = inputs["cu_seq_lens_q"].diff(), (inputs["labels"] != -100).sum()
            loss = super().training_step(model, inputs, num_items_in_batch)
            t = self.tally
            t["tokens"] += int(lens.sum())
            t["positions"] += ids.numel()
            t["flops"] += flops_model.flops_per_token(lens.cpu(), int(heads)) * int(lens.sum())
            t["loss"] += loss
            return loss

    class Clock(TrainerCallback):
        """Real tokens and time of the steps after the warm-up ones."""
        marks = []

        def on_train_begin(self, *a, **k):
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append((time.perf_counter(), dict(Trainer.tally, loss=float(Trainer.tally["loss"]))))
            Trainer.tally.update(tokens=0, positions=0, flops=0.0, loss=0.0)

    trainer = Trainer(model=net, args=config, train_dataset=dataset, processing_class=hf_tokenizer(args.vocab),
                      callbacks=[Clock()])
    trainer.train()
    marks = Clock.marks
    if len(marks) != n_steps:
        raise RuntimeError(f"TRL ran {len(marks)} steps, not {n_steps}: too little data for its rows")
    timed = [m for _, m in marks[args.warmup:]]
    elapsed = marks[-1][0] - marks[args.warmup - 1][0]
    total = lambda key: sum(m[key] for m in timed)
    return result(total("tokens"), total("positions"), total("flops"), elapsed, marks[-1][1]["loss"], rss0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("sft", "dpo"), default="sft")
    p.add_argument("--data", choices=("lognormal", "builtin") + tuple(PAIR_LENGTHS), default="lognormal")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: 1b on CUDA, small on CPU")
    p.add_argument("--configs", default=None, help="comma-separated; default: all of the mode's: "
                   + "; ".join(f"{m}: {','.join(c)}" for m, c in CONFIGS.items()))
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--batch_size", type=int, default=None, help="examples (DPO: pairs) per step")
    p.add_argument("--microbatch_tokens", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="also print where the time of the timed steps goes "
                   "(torch.profiler, nanopack and hf rows; timings then include the profiler's overhead)")
    p.add_argument("--mem_limit_gb", type=float, default=20.0, help="CPU: address-space limit of each child")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    cuda = torch.cuda.is_available()
    args.size = args.size or ("1b" if cuda else "small")
    size = SIZES[args.size]
    args.batch_size = args.batch_size or size["batch_size"]
    args.microbatch_tokens = args.microbatch_tokens or size["microbatch_tokens"]
    model = size["model"]
    args.configs = args.configs or ",".join(CONFIGS[args.mode])
    args.vocab = 128256 if isinstance(model, str) else model["vocab_size"]
    if args.child:  # inside a subprocess: one configuration, its result as JSON
        compile_stats.watch()
        if not cuda:
            limit = int(args.mem_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            res = (run_trl if args.child.startswith("trl") else run_config)(args.child, args)
        except (RuntimeError, MemoryError) as e:  # CPU allocator failure or torch.OutOfMemoryError
            res = dict(error="OOM" if "memory" in str(e).lower() else str(e)[:120])
        except ImportError as e:  # trl is a dev requirement; a row without it says so
            res = dict(error=f"not installed: {e.name}")
        print("RESULT " + json.dumps(res))
        return

    dev = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.mode.upper()} | device {dev} | torch {torch.__version__} | {'bfloat16 autocast' if cuda else 'float32'} | "
          f"model {model if isinstance(model, str) else args.size + ' ' + json.dumps(model)} | data {args.data} | "
          f"{args.batch_size} {'pairs' if args.mode == 'dpo' else 'examples'}/step, microbatch_tokens "
          f"{args.microbatch_tokens} | {args.steps} timed steps after {args.warmup}")
    matmul = matmul_peak(cuda)
    print(f"matmul peak measured here: {matmul / 1e12:.3f} TFLOP/s ({'bf16 8192' if cuda else 'fp32 2048'}^3, best "
          f"of 10): the '% of matmul' column is each row's model FLOPs/s against it")
    rows = []
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", name] + [a for a in sys.argv[1:]]
        t = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            out = subprocess.CompletedProcess(cmd, "timeout", "", f"no result within --timeout {args.timeout:.0f}s")
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        res = json.loads(line[-1][7:]) if line else dict(error=f"crashed (exit {out.returncode}): "
                                                            + (out.stderr.strip().splitlines() or [""])[-1][:120])
        done = f", {res['tokens_per_sec']:,.0f} tok/s, loss {res['loss']:.4f}" if "loss" in res else f": {res['error']}"
        print(f"  {name}: {time.perf_counter() - t:.0f}s{done}", flush=True)  # what a killed run leaves
        if args.profile:
            print("\n".join(l for l in out.stdout.splitlines() if not l.startswith(("RESULT ", "{"))), flush=True)
        rows.append((name, res))
    base = dict(rows).get("hf", {}).get("tokens_per_sec")
    mem_name = "peak GiB (CUDA alloc)" if cuda else "peak GiB (RSS growth)"
    unit = "pairs" if args.mode == "dpo" else "examples"
    header = (f"| config | real tok/s (per GPU) | MFU | {mem_name} | padding | loss after {args.steps + args.warmup} steps "
              f"| speed vs hf | compiled graphs | {unit}/s | vs packed | tokens computed/step | % of matmul "
              f"| recompiles | compile s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, r in rows:
        if "error" in r:
            print(f"| {name} | {r['error']} |" + " |" * 12)
            continue
        units_per_sec = args.batch_size * args.steps / r["elapsed"]
        packed = dict(rows).get("packed", {})
        vs_packed = f"{units_per_sec / (args.batch_size * args.steps / packed['elapsed']):.2f}x" if "elapsed" in packed else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = f"{r['tokens_per_sec'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['tokens_per_sec']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {100 * r['padding']:.1f}% | "
              f"{r['loss']:.4f} | {ratio} | {r.get('graphs') or '-'} | {units_per_sec:.2f} | {vs_packed} | "
              f"{r['tokens'] / args.steps:,.0f} | {100 * r['flops'] / r['elapsed'] / matmul:.1f}% | "
              f"{r['recompiles'] if r['graphs'] else '-'} | {r['compile_s']:.1f} |")
    for name, r in rows:  # TORCH_LOGS=recompiles prints each one in full
        for reason, n in r.get("recompile_reasons", {}).items():
            print(f"recompiled in {name} ({n}x): {reason}")
        if r.get("timed_compile_s"):  # H200, 2026-11-28: a 1B recompile in the timed steps read as 0.25x eager
            print(f"{name}: {r['timed_compile_s']:.1f} s of compiling fell inside the timed steps: left out of its "
                  "tok/s and MFU (more --warmup steps avoid it)")
    got = dict(rows)
    if all("elapsed" in got.get(n, {}) for n in ("packed", "packed+shared")):
        a, b = got["packed"], got["packed+shared"]
        print(f"prefix sharing: tokens computed {a['tokens'] / b['tokens']:.2f}x fewer ((2P+C+R)/(P+C+R) over the timed "
              f"pairs), FLOPs {a['flops'] / b['flops']:.2f}x fewer, pairs/s {a['elapsed'] / b['elapsed']:.2f}x")


if __name__ == "__main__":
    main()
