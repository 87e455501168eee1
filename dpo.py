"""
The losses on log-probs of train_dpo.py and train_rl.py: the DPO family and GRPO's, per-pair statistics, response
lengths, the per-pair log-prob sums of a whole split, and the reference model's log-probs (computed once and cached on
disk, a live frozen copy, or the policy with its adapters off). Pure functions of tensors where possible, so each is
tested on its own (tests/test_dpo_loss.py).

A pair p is sequences 2p (chosen) and 2p+1 (rejected) of the data; a packed micro-batch holds whole pairs, and
mb.pair_sums(per-position values) gives (chosen (P,), rejected (P,)) with one index_add_ over sequence ids.
"""

import hashlib
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import build_model
from lora import adapters_disabled
from packing import make_batch, pack
from parallel import all_reduce_sum, print0

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "dpo_norm", "simpo")


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


def group_advantages(rewards):
    """(G, k) rewards of k replies per prompt -> GRPO's advantages: each reward less its group's mean, over the group's
    standard deviation (0 where all k are equal: such a group teaches nothing)."""
    centred = rewards - rewards.mean(1, keepdim=True)
    return centred / rewards.std(1, keepdim=True).clamp(min=1e-6)


def policy_loss(logps, old_logps, advantages, clip_eps, ref_logps=None, kl_coef=0.0):
    """Per-token losses (K,) of GRPO: PPO's clipped objective with each token's reply advantage, ratios to the policy
    that sampled (old_logps; logps.detach() on a batch's first update, where the ratio is 1 and only its gradient
    counts), plus kl_coef times the k3 estimate of KL(policy || reference) per token."""
    ratio = torch.exp(logps - old_logps)
    losses = -torch.min(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    if kl_coef:
        log_ratio = ref_logps - logps
        losses = losses + kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
    return losses


STATS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "logps_chosen", "logps_rejected")


def pair_stats(losses, rewards_chosen, rewards_rejected, policy_chosen, policy_rejected):
    """Sums over pairs, by name (STATS); reward_accuracy counts the pairs whose chosen reward is the higher (a
    per-pair comparison, not a comparison of mean rewards). Summed over steps and ranks, then divided."""
    values = (losses, rewards_chosen, rewards_rejected, (rewards_chosen > rewards_rejected).float(), policy_chosen,
              policy_rejected)
    return {k: v.detach().sum() for k, v in zip(STATS, values)}


def response_lengths(split_data, device):
    """(P, 2) float32: target tokens of each pair's chosen and rejected response (a sequence's first token is
    never a target): what dpo_norm / ipo / simpo divide by, and what sft_weight's NLL is normalised by."""
    offsets, mask = np.asarray(split_data["offsets"]), np.asarray(split_data["loss_mask"])
    if len(offsets) == 1:
        return torch.zeros(0, 2, device=device)
    targets = np.add.reduceat(mask, offsets[:-1], dtype=np.int64) - mask[offsets[:-1]]
    return torch.tensor(targets.reshape(-1, 2), dtype=torch.float32, device=device)


@torch.no_grad()
def split_logps(model, split_data, budget, device, autocast, prefix=None, group_size=2):
    """(P, 2) log-prob sums [chosen, rejected] of every pair of a split (groups of k sequences: (U, k)), forward only,
    the same on every rank: each rank runs its share of the packed bins and the shares are summed over ranks. Every
    rank runs the same number of forwards (a filler when its share is done), since under FSDP each forward is a
    collective. prefix: the split's shared_prefixes(), each computed once (None: sequences laid out whole)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    was_training = model.training
    model.eval()
    lengths = np.diff(np.asarray(split_data["offsets"])).reshape(-1, group_size).sum(1)  # (U,) tokens per group
    if prefix is not None:
        lengths = lengths - (group_size - 1) * prefix  # each group's prompt computed once
    bins = pack(lengths, budget) if len(lengths) else []
    sums = torch.zeros(len(lengths), group_size, device=device)
    for i in range(-(-len(bins) // world_size)):
        j = rank + i * world_size
        units = bins[j] if j < len(bins) else []  # [] a filler
        mb = make_batch(split_data, units, dpo=True, prefix=prefix, group_size=group_size).to(device)
        with autocast:
            logps = model(**mb.inputs(), logprobs=True)
        sums[mb.units] = mb.group_sums(logps, group_size)
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train(was_training)
    return sums


class Reference:
    """The reference model's log-prob sums for the policy's micro-batches and the val split: looked up from
    (P, 2) tables computed once (mode 'cached'; zeros for simpo, which has none), or computed on the same packed
    micro-batch by a live frozen copy (mode 'live': it costs a second model) or by the policy itself with its LoRA
    adapters switched off (mode 'adapters_off': no copy, no cache)."""

    def __init__(self, train=None, val=None, model=None, autocast=None, switch=nullcontext):
        self.train, self.val, self.model, self.autocast, self.switch = train, val, model, autocast, switch

    def __call__(self, mb):
        """-> (chosen (P,), rejected (P,)) for the pairs of a training micro-batch."""
        if self.model is None:
            ref = self.train[mb.units]
            return ref[:, 0], ref[:, 1]
        return mb.pair_sums(self.logps(mb))

    def logps(self, mb):
        """The reference model's log-prob of each trained token of a micro-batch (K,) (not with cached tables)."""
        with torch.no_grad(), self.autocast, self.switch():
            return self.model(**mb.inputs(), logprobs=True)


def model_reference(mode, run, seed, parallel):
    """A Reference computed on each micro-batch: 'live', a frozen copy of the initial weights (under FSDP2 sharded
    like the policy, so both compute in the same precision), or 'adapters_off', the policy without its adapters."""
    if mode == "adapters_off":
        return Reference(model=run.model, autocast=run.autocast, switch=lambda: adapters_disabled(run.raw_model))
    parallel = "fsdp" if parallel == "fsdp" else None  # no gradients: nothing for DDP to do
    ref_model, _ = build_model(run.raw_model.config, run.start, seed, run.device, parallel, run.world_size,
                               getattr(torch, run.dtype))
    return Reference(model=ref_model.requires_grad_(False).eval(), autocast=run.autocast)


def reference(mode, run, config, key, val_prefix=None):
    """Build the Reference for `mode` ('cached', 'live', 'adapters_off' or 'none'). Cached log-probs live in
    out_dir/reference/<key>_{train,val}.npy, with <key>.json written last (its presence means complete).
    The train split's shared prefixes are the loader's, the val split's val_prefix (None: no prefix sharing)."""
    c, device = config, run.device
    budget = 4 * c["microbatch_tokens"]  # forward only, nothing kept for a backward pass: bigger bins fit
    train_logps = lambda model: split_logps(model, run.train_data, budget, device, run.autocast, run.loader.prefix)
    val_logps = lambda model: split_logps(model, run.val_data, budget, device, run.autocast, val_prefix)
    n_train, n_val = len(run.loader.lengths), len(run.val_data["offsets"]) // 2
    if mode == "none":
        return Reference(torch.zeros(n_train, 2, device=device), torch.zeros(n_val, 2, device=device))
    if mode in ("live", "adapters_off"):
        ref = model_reference(mode, run, c["seed"], c["parallel"])
        with ref.switch():
            ref.val = val_logps(ref.model)
        return ref

    folder = os.path.join(c["out_dir"], "reference")
    paths = {split: os.path.join(folder, f"{key}_{split}.npy") for split in ("train", "val")}
    key_path = os.path.join(folder, f"{key}.json")
    if all_reduce_sum([float(os.path.exists(key_path))], device)[0] == run.world_size:
        print0(f"reference log-probs: loaded {key_path}")
        return Reference(*(torch.from_numpy(np.load(paths[s])).to(device) for s in ("train", "val")))
    if run.start_iter:
        raise SystemExit(f"{key_path} is missing: the reference log-probs of the run being resumed are gone, and "
                         f"its checkpoint holds the trained weights, not the reference; start the run again")
    t0 = time.perf_counter()
    train, val = train_logps(run.model), val_logps(run.model)  # the policy has not moved yet
    seconds = time.perf_counter() - t0
    if run.master:
        os.makedirs(folder, exist_ok=True)
        for split, values in (("train", train), ("val", val)):
            np.save(paths[split] + ".tmp.npy", values.cpu().numpy())
            os.replace(paths[split] + ".tmp.npy", paths[split])
        with open(key_path, "w") as f:
            json.dump(dict(key=key, reference=run.start, data_dir=run.data_dir, tokenizer=run.tok.name,
                           template=run.tok.template_id, dtype=run.dtype, train_pairs=n_train, val_pairs=n_val,
                           seconds=seconds), f, indent=2)
    if dist.is_initialized():
        dist.barrier()
    tokens = int(run.loader.lengths.sum()) + int(run.val_data["offsets"][-1]) - int(
        0 if val_prefix is None else val_prefix.sum())  # as computed: a shared prompt once
    print0(f"reference log-probs: {n_train} train + {n_val} val pairs, {tokens:,} tokens in {seconds:.1f}s "
           f"({tokens / seconds / run.world_size:,.0f} tok/s/gpu), saved as {key_path}")
    return Reference(train, val)


def reference_key(run, seed):
    """What the reference log-probs depend on, hashed: the initial weights themselves (run.start: the model folder's
    fingerprint, or the preset and seed: not a path, so new weights in the same folder miss the cache), the token
    files of both splits, the tokenizer, template and dtype."""
    h = hashlib.sha256(json.dumps(["nanopack-reference-v2", run.start, run.tok.name, run.tok.template_id, run.dtype,
                                   seed if run.start["init_from"] == "scratch" else None,
                                   torch.__version__ if run.start["init_from"] == "scratch" else None]).encode())
    for split_data in (run.train_data, run.val_data):
        for k in ("ids", "offsets", "loss_mask"):
            h.update(np.ascontiguousarray(split_data[k]))
    return h.hexdigest()[:16]
