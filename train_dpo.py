"""
Padding-free DPO, read top to bottom like train_sft.py: config, setup, reference log-probs, loop, log, save.

    python train_sft.py && python train_dpo.py                  # built-in: SFT the toy model, then DPO it (CPU ok)
    python train_dpo.py config/dpo_qwen2.5_0.5b.py --data=prefs.jsonl     # after train_sft.py config/sft_qwen2.5_0.5b.py
    torchrun --nproc_per_node=8 train_dpo.py config/dpo_llama3.1_8b_fsdp.py --data=prefs.jsonl

Every optimizer step takes `batch_size` preference pairs (global, whatever the world size). A pair's chosen and
rejected sequences sit in the same micro-batch, packed with other whole pairs into at most `microbatch_tokens`
tokens; one forward pass gives every sequence's log-prob sum (one index_add_ over sequence ids). The reference
model's sums are computed once before training and kept on disk (reference='cached'), so no second model is in
memory. The step loss is the mean over the step's pairs: any micro-batch size and world size give the same step.
"""

import copy
import hashlib
import json
import os
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
from common import print0
from configurator import configure
from model import ModelConfig, Transformer, config_from_preset
from packing import PackedLoader, make_batch, pack

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value
out_dir = "out/dpo"
init_from = "out/sft/hf"  # the model `python train_sft.py` leaves; any Hugging Face folder, 'scratch' or 'resume'
model = "toy"  # preset name for init_from='scratch'
tokenizer = ""  # 'byte', or a folder with tokenizer files; default: init_from's folder if it has them, else 'byte'
data = "builtin"  # 'builtin' (arithmetic preference pairs), a .jsonl of pairs, or a folder written by data/prepare.py
max_len = 4096  # JSONL only: longest sequence kept; longer ones follow `overlong`
overlong = "error"  # JSONL only: 'error', 'truncate' or 'skip' (counted and printed)
batch_size = 32  # preference pairs per optimizer step, all ranks together
microbatch_tokens = 4096  # token budget of one forward pass on one rank (whole pairs: chosen + rejected)
max_iters = 0  # optimizer steps; 0 = `epochs` passes over the data
epochs = 1.0
learning_rate = 2e-4  # the toy model; fine-tuned real models want ~5e-7 with beta 0.1 (see config/)
min_lr = 2e-5
warmup_iters = 5
weight_decay = 0.0
grad_clip = 1.0
loss_type = "sigmoid"  # 'sigmoid' (DPO), 'ipo', 'hinge', 'dpo_norm' (length-averaged DPO), 'simpo' (no reference)
beta = 2.0  # the inverse temperature of the implicit reward: larger = the loss saturates at smaller margins
label_smoothing = 0.0  # sigmoid, dpo_norm, simpo: assumed chance that a pair's label is flipped (conservative DPO)
gamma = 0.5  # simpo: target reward margin
sft_weight = 0.0  # adds sft_weight * NLL per target token of the step's chosen responses (train_sft.py's loss)
reference = "cached"  # 'cached': reference log-probs computed once, kept on disk; 'live': a frozen copy in memory
seed = 1337
device = "auto"  # 'auto', 'cpu', 'cuda'
dtype = "auto"  # 'auto' = bfloat16 on CUDA, float32 on CPU
compile = False
activation_checkpointing = False
parallel = "ddp"  # 'ddp' or 'fsdp' (used when launched with torchrun on more than one process)
log_interval = 10
eval_interval = 100  # evaluate (val loss, reward accuracy; built-in task: exact match) and checkpoint; 0 = at the end only
eval_examples = 200  # built-in task: held-out prompts answered greedily for accuracy
wandb_log = False
wandb_project = "nanopack"
wandb_run_name = "dpo"
config = configure(globals())
# -----------------------------------------------------------------------------

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "dpo_norm", "simpo")
BUILTIN_PAIRS = dict(n_train=2048, n_val=200)  # the built-in run trains one epoch of these (64 steps of 32 pairs)
if loss_type not in LOSS_TYPES:
    raise SystemExit(f"config error: loss_type={loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
if reference not in ("cached", "live"):
    raise SystemExit(f"config error: reference={reference!r}; choose 'cached' or 'live'")
if not 0.0 <= label_smoothing < 0.5 or (label_smoothing and loss_type in ("ipo", "hinge")):
    raise SystemExit(f"config error: label_smoothing={label_smoothing} must be in [0, 0.5), and 0 for ipo and hinge")


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, len_chosen, len_rejected,
             loss_type, beta, label_smoothing=0.0, gamma=0.0):
    """Per-pair losses (P,) and rewards (chosen (P,), rejected (P,)) from per-sequence log-prob sums of the
    policy and the reference, and the response lengths in target tokens. Rewards are beta * (policy - reference),
    on log-probs per response token for ipo (TRL's convention), dpo_norm and simpo, and on the policy alone
    for simpo, which has no reference."""
    pc, pr, rc, rr = policy_chosen, policy_rejected, ref_chosen, ref_rejected
    if loss_type in ("ipo", "dpo_norm", "simpo"):
        pc, pr, rc, rr = pc / len_chosen, pr / len_rejected, rc / len_chosen, rr / len_rejected
    if loss_type == "simpo":
        rc, rr = torch.zeros_like(rc), torch.zeros_like(rr)
    h = (pc - rc) - (pr - rr)  # how much more than the reference the policy prefers chosen over rejected
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:  # sigmoid, dpo_norm, simpo: logistic, with a margin gamma for simpo
        z = beta * h - (gamma if loss_type == "simpo" else 0.0)
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, beta * (pc - rc).detach(), beta * (pr - rr).detach()


def pair_stats(losses, rewards_chosen, rewards_rejected, policy_chosen, policy_rejected):
    """Sums over pairs, (6,): loss, rewards chosen / rejected, pairs whose chosen reward is the higher (a per-pair
    comparison, not a comparison of mean rewards), log-probs chosen / rejected. Summed, all-reduced, then divided."""
    return torch.stack([losses.sum(), rewards_chosen.sum(), rewards_rejected.sum(),
                        (rewards_chosen > rewards_rejected).sum(), policy_chosen.sum(), policy_rejected.sum()]).detach()


rank, world_size, device = common.setup_distributed(device)
master = rank == 0
torch.manual_seed(seed)
dtype, ptdtype, autocast = common.precision(device, dtype, parallel, world_size)
resume = init_from == "resume"
ckpt_path = os.path.join(out_dir, "ckpt.pt")
ckpt = common.load_checkpoint(ckpt_path) if resume else None
if resume:  # a resumed run continues with the data, tokenizer, initial model and reference of the run it continues
    tokenizer, data_dir = ckpt["tokenizer"], ckpt["data_dir"]
os.makedirs(out_dir, exist_ok=True)

# ---- tokenizer and data
hf_folder = init_from not in ("scratch", "resume")
if hf_folder and not os.path.isdir(init_from):
    raise SystemExit(f"init_from={init_from!r} does not exist: DPO starts from a fine-tuned model; make the default one "
                     f"with `python train_sft.py` (it writes out/sft/hf), or pass --init_from=<Hugging Face folder>")
tok = common.choose_tokenizer(tokenizer, init_from)
if not resume:
    data_dir = common.prepare_data(data, out_dir, tok, "dpo", max_len, overlong, seed, **BUILTIN_PAIRS)
train_data, val_data = common.load_data(data_dir, tok, "dpo")


def response_lengths(split_data):
    """(P, 2) float: target tokens of each pair's chosen and rejected response (first token excluded, as in
    make_batch): what dpo_norm / ipo / simpo divide by, and what sft_weight's NLL is normalised by."""
    offsets, mask = np.asarray(split_data["offsets"]), np.asarray(split_data["loss_mask"])
    if len(offsets) == 1:
        return torch.zeros(0, 2, device=device)
    targets = np.add.reduceat(mask, offsets[:-1], dtype=np.int64) - mask[offsets[:-1]]
    return torch.tensor(targets.reshape(-1, 2), dtype=torch.float32, device=device)


lengths_train, lengths_val = response_lengths(train_data), response_lengths(val_data)
chosen_targets = lengths_train[:, 0].cpu().numpy()  # step normaliser for sft_weight, read on the host


# ---- model: the initial weights are the policy's start and, for DPO, the reference
def initial_model(start):
    if start["init_from"] == "scratch":
        torch.manual_seed(seed)  # the same weights on every rank, and again when a live reference is rebuilt
        return Transformer(config_from_preset(start["model"], vocab_size=tok.vocab_size))
    return Transformer.from_pretrained(start["init_from"], dtype=torch.float32)


start = ckpt["start"] if resume else dict(init_from=init_from, model=model)
if resume:
    model_config = ModelConfig(**{k: v for k, v in ckpt["model_config"].items() if k != "padded_vocab_size"})
    net = Transformer(model_config)
else:
    net = initial_model(start)
model_config = net.config
if tok.vocab_size > model_config.vocab_size:
    raise SystemExit(f"the tokenizer has {tok.vocab_size} tokens but the model only {model_config.vocab_size} embeddings")
use_reference = loss_type != "simpo"
ref_net = None
if use_reference and reference == "live":  # a frozen copy, for comparisons: the cached mode needs no second model
    ref_net = (initial_model(start) if resume else copy.deepcopy(net)).requires_grad_(False).eval().to(device)
    if parallel == "fsdp":  # sharded like the policy, so both compute in the same precision
        ref_net = common.wrap_model(ref_net, parallel, world_size, ptdtype)


def reference_key(weights):
    """What the reference log-probs depend on, hashed: the reference weights themselves (not a path: new weights
    in the same folder miss the cache), the token files of both splits, the tokenizer, template and dtype."""
    h = hashlib.sha256(json.dumps(["nanopack-reference-v1", tok.name, tok.template, dtype]).encode())
    for name, t in weights.items():
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    for split_data in (train_data, val_data):
        for key in ("ids", "offsets", "loss_mask"):
            h.update(np.ascontiguousarray(split_data[key]))
    return h.hexdigest()[:16]


ref_key = None  # names the cached reference log-probs
if use_reference and reference == "cached":
    ref_key = ckpt["ref_key"] if resume else reference_key(net.state_dict())
net.to(device)
net.activation_checkpointing = activation_checkpointing
if compile:  # per block, as in train_sft.py; the reference and eval passes are padded to one shape of their own
    for block in net.layers:
        block.compile()
raw_model = net
net = common.wrap_model(net, parallel, world_size, ptdtype)
optimizer = common.make_optimizer(net, learning_rate, weight_decay, device_type=device.type)

# compile wants a fixed shape: every micro-batch is padded to microbatch_tokens (the tail is a dummy segment)
try:
    loader = PackedLoader(train_data, batch_size, microbatch_tokens, rank=rank, world_size=world_size, seed=seed,
                          dpo=True, pad_to=microbatch_tokens if compile else None)
except ValueError as e:  # a pair longer than the budget: how much to raise it
    raise SystemExit(f"{data_dir}: {e}") from None
if max_iters == 0:
    max_iters = max(1, round(epochs * len(loader)))
iter_num = 0
accuracy_before = None
if resume:
    common.restore_checkpoint(ckpt, net, optimizer)
    loader.load_state_dict(ckpt["loader"])
    iter_num, accuracy_before = ckpt["iter_num"], ckpt["accuracy_before"]
    del ckpt

n_params = raw_model.num_params()
n_train, n_val = len(lengths_train), len(lengths_val)
print0(f"model: {n_params / 1e6:.2f}M parameters | data: {data_dir}, {n_train} train pairs, {len(loader)} steps/epoch | "
       f"{loss_type} loss, beta {beta}, reference {reference if use_reference else 'none'} | world size {world_size} "
       f"({parallel}) | device {device}, {dtype} | {max_iters} iterations")
logger = common.MetricsLogger(out_dir, wandb_log, wandb_project, wandb_run_name, config, resume=resume)


# ---- reference log-probs
ref_budget = 4 * microbatch_tokens  # forward only, nothing kept for a backward pass: bigger bins fit


@torch.no_grad()
def pair_logps(model_, split_data):
    """(P, 2) log-prob sums [chosen, rejected] of every pair of a split, forward only, the same on every rank:
    each rank runs its share of the packed bins and the shares are summed over ranks. Every rank runs the same
    number of forwards (a filler when its share is done), since under FSDP each forward is a collective."""
    was_training = model_.training
    model_.eval()
    lengths = np.diff(np.asarray(split_data["offsets"])).reshape(-1, 2).sum(1)  # (P,) tokens per pair
    bins = pack(lengths, ref_budget) if len(lengths) else []
    sums = torch.zeros(len(lengths), 2, device=device)
    for i in range(-(-len(bins) // world_size)):
        j = rank + i * world_size
        mb = make_batch(split_data, bins[j] if j < len(bins) else [], ref_budget if compile else None, dpo=True)
        mb = mb.to(device)
        with autocast:
            logps = model_(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels, logprobs=True)
        sums[mb.pair_indices] = torch.stack(mb.pair_sums(logps), 1)
    if dist.is_initialized():
        dist.all_reduce(sums)
    model_.train(was_training)
    return sums


t_ref = time.perf_counter()
ref_train = ref_val = None  # (P, 2) per split; live mode computes the train side per micro-batch instead
if not use_reference:  # simpo: reference-free
    ref_train, ref_val = torch.zeros(n_train, 2, device=device), torch.zeros(n_val, 2, device=device)
elif reference == "live":
    ref_val = pair_logps(ref_net, val_data)
else:
    ref_paths = {split: os.path.join(out_dir, "reference", f"{ref_key}_{split}.npy") for split in ("train", "val")}
    key_path = os.path.join(out_dir, "reference", f"{ref_key}.json")  # written last: its presence means complete
    if common.all_reduce_sum([float(os.path.exists(key_path))], device)[0] == world_size:
        ref_train, ref_val = (torch.from_numpy(np.load(ref_paths[s])).to(device) for s in ("train", "val"))
        print0(f"reference log-probs: loaded {key_path}")
    elif resume:
        raise SystemExit(f"{key_path} is missing: the reference log-probs of the run being resumed are gone, and "
                         f"its checkpoint holds the trained weights, not the reference; start the run again")
    else:
        ref_train, ref_val = pair_logps(net, train_data), pair_logps(net, val_data)
        if master:
            os.makedirs(os.path.dirname(key_path), exist_ok=True)
            for split, values in (("train", ref_train), ("val", ref_val)):
                np.save(ref_paths[split] + ".tmp.npy", values.cpu().numpy())
                os.replace(ref_paths[split] + ".tmp.npy", ref_paths[split])
            with open(key_path, "w") as f:
                json.dump(dict(key=ref_key, reference=start, data_dir=data_dir, tokenizer=tok.name, template=tok.template,
                               dtype=dtype, train_pairs=n_train, val_pairs=n_val,
                               seconds=time.perf_counter() - t_ref), f, indent=2)
        if dist.is_initialized():
            dist.barrier()
        tokens = int(train_data["offsets"][-1]) + int(val_data["offsets"][-1])
        seconds = time.perf_counter() - t_ref
        print0(f"reference log-probs: {n_train} train + {n_val} val pairs, {tokens:,} tokens in {seconds:.1f}s "
               f"({tokens / seconds / world_size:,.0f} tok/s/gpu), saved as {key_path}")
ref_cache_seconds = time.perf_counter() - t_ref


def reference_logps(mb):
    """(chosen (P,), rejected (P,)) reference sums for a micro-batch's pairs: looked up by pair index, or (live)
    a forward pass of the frozen copy over the same packed micro-batch."""
    if ref_train is not None:
        ref = ref_train[mb.pair_indices]
        return ref[:, 0], ref[:, 1]
    with torch.no_grad(), autocast:
        return mb.pair_sums(ref_net(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels,
                                    logprobs=True))


def microbatch_loss(mb, num_pairs, num_chosen_targets):
    """This micro-batch's share of the step loss: its pairs' summed losses / the step's global number of pairs
    (+ sft_weight * its chosen responses' NLL / the step's global chosen target tokens). Times world_size because
    DDP and FSDP average gradients over ranks, and we want their sum. Returns (loss, pair_stats)."""
    with autocast:
        logps = net(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels, logprobs=True)
    pc, pr = mb.pair_sums(logps)  # (P,) each: one index_add_ over sequence ids
    rc, rr = reference_logps(mb)
    lens = lengths_train[mb.pair_indices]
    losses, rewards_c, rewards_r = dpo_loss(pc, pr, rc, rr, lens[:, 0], lens[:, 1], loss_type, beta, label_smoothing, gamma)
    loss = losses.sum() / num_pairs
    if sft_weight:
        loss = loss - sft_weight * pc.sum() / num_chosen_targets
    return loss * world_size, pair_stats(losses, rewards_c, rewards_r, pc, pr)


@torch.no_grad()
def evaluate():
    """Val preference loss, reward accuracy and margin over the whole val split, and exact-match accuracy on
    the built-in task. Every rank runs the same number of forwards (FSDP's all-gathers are collectives)."""
    net.eval()
    out = {}
    if n_val:
        policy = pair_logps(net, val_data)
        losses, rewards_c, rewards_r = dpo_loss(policy[:, 0], policy[:, 1], ref_val[:, 0], ref_val[:, 1],
                                                lengths_val[:, 0], lengths_val[:, 1], loss_type, beta, label_smoothing, gamma)
        val_loss = losses.mean() - sft_weight * policy[:, 0].sum() / lengths_val[:, 0].sum()
        out.update(val_loss=val_loss.item(), val_reward_accuracy=(rewards_c > rewards_r).float().mean().item(),
                   val_reward_margin=(rewards_c - rewards_r).mean().item())
    if data == "builtin" and eval_examples > 0:
        out["val_accuracy"] = common.builtin_accuracy(raw_model, tok, eval_examples, device, autocast,
                                                      sync_ranks=parallel == "fsdp" and world_size > 1)
    net.train()
    parts = [f"val loss {out['val_loss']:.4f} | val reward accuracy {100 * out['val_reward_accuracy']:.1f}% | "
             f"val margin {out['val_reward_margin']:.3f}"] if n_val else []
    parts += [f"val accuracy {100 * out['val_accuracy']:.1f}%"] if "val_accuracy" in out else []
    if parts:
        print0(f"iter {iter_num}: " + " | ".join(parts))
        logger.log(dict(iter=iter_num, **out))
    return out


def save(loader_state):
    common.save_checkpoint(ckpt_path, net, optimizer, dict(
        model_config=asdict(model_config), iter_num=iter_num, loader=loader_state, config=config,
        tokenizer=tok.name, data_dir=data_dir, start=start, ref_key=ref_key, accuracy_before=accuracy_before))


# ---- the loop
results = {}
if not resume:  # the starting point, for "before -> after"
    results = evaluate()
    accuracy_before = results.get("val_accuracy")
timer = common.Timer(device)
# tokens, padding, FLOPs since the last log line; a live reference adds a forward pass (1/3 of fwd+bwd)
meter = common.Throughput(raw_model, device, world_size, flops_factor=4 / 3 if ref_net is not None else 1.0)
stats_acc = torch.zeros(6, device=device, dtype=torch.float64)  # pair_stats summed since the last log line
nonfinite = torch.zeros((), device=device, dtype=torch.bool)  # set on device, read only when logging: no sync per step
pairs_window = chosen_targets_window = 0
eval_seconds = train_seconds = 0.0  # evaluation inside a log window is not training time
start_iter, last_log_iter, t_start = iter_num, iter_num, time.perf_counter()
loader_state = loader.state_dict()
while iter_num < max_iters:
    lr = common.lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    step = next(loader)
    num_chosen_targets = int(chosen_targets[loader.step_units(step.epoch, step.step)].sum())  # global, like num_pairs
    mbs = [mb.to(device) for mb in step.microbatches]
    meter.count(step.microbatches, data_time=time.perf_counter() - t0)
    for i, mb in enumerate(mbs):
        with common.no_grad_sync(net, parallel, last_microbatch=i == len(mbs) - 1):
            loss, stats = microbatch_loss(mb, step.num_pairs, num_chosen_targets)
            loss.backward()
        stats_acc += stats
    pairs_window += step.num_pairs
    chosen_targets_window += num_chosen_targets
    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    nonfinite |= ~torch.isfinite(stats_acc[0])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    loader_state = step.state

    last = iter_num == max_iters
    if iter_num % log_interval == 0 or last:
        elapsed = timer.lap() - eval_seconds
        eval_seconds, train_seconds = 0.0, train_seconds + elapsed
        n_steps, last_log_iter = iter_num - last_log_iter, iter_num
        perf, (*sums, bad) = meter.read(elapsed, n_steps, stats_acc.tolist() + [float(nonfinite.item())])
        if bad:
            raise SystemExit(f"iter {iter_num}: the loss is NaN or infinite; stopping. The last good checkpoint "
                             f"({ckpt_path}, if one was written) is untouched. Lower learning_rate or check the data.")
        loss_sum, rewards_c, rewards_r, n_right, logps_c, logps_r = (s / pairs_window for s in sums)
        nll = -sums[4] / chosen_targets_window  # the chosen responses' NLL per target token
        eta = (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
        metrics = dict(
            iter=iter_num, loss=loss_sum + sft_weight * nll,
            rewards_chosen=rewards_c, rewards_rejected=rewards_r, reward_margin=rewards_c - rewards_r,
            reward_accuracy=n_right, logps_chosen=logps_c, logps_rejected=logps_r, lr=lr,
            grad_norm=common.grad_norm_value(grad_norm), **perf, ref_cache_seconds=ref_cache_seconds)
        if sft_weight:
            metrics["nll_chosen"] = nll
        print0(f"iter {iter_num}/{max_iters} | loss {metrics['loss']:.4f} | reward acc {100 * n_right:.1f}% | "
               f"margin {metrics['reward_margin']:.3f} | lr {lr:.2e} | grad norm {metrics['grad_norm']:.2f} | "
               f"{meter.line(metrics)} | eta {common.format_eta(eta)}")
        logger.log(metrics)
        stats_acc.zero_()
        pairs_window = chosen_targets_window = 0
    if (eval_interval and iter_num % eval_interval == 0) or last:
        t_eval = time.perf_counter()
        results = evaluate()
        save(loader_state)
        eval_seconds += time.perf_counter() - t_eval

# ---- finish: a Hugging Face folder next to the checkpoint
hf_dir = os.path.join(out_dir, "hf")
common.export_hf(net, model_config, hf_dir, tokenizer_from=None if tok.name == "byte" else tok.name)
if master:
    print0(f"time: reference log-probs {ref_cache_seconds:.1f}s, training {train_seconds:.1f}s")
    if accuracy_before is not None and "val_accuracy" in results:
        print0(f"held-out exact-match accuracy: {100 * accuracy_before:.1f}% before DPO -> "
               f"{100 * results['val_accuracy']:.1f}% after")
    print0(f"done: checkpoint {ckpt_path}, Hugging Face folder {hf_dir}"
           + (" (byte-level tokenizer: sample.py uses it by default)" if tok.name == "byte" else ""))
logger.finish()
common.teardown_distributed()
