"""
The reference model's log-probs, for DPO's loss and RL's KL term and online DPO, in one of three
ways:
  cached        the initial model's log-prob sums of every pair, computed once before training
                (forward only) and kept in out_dir/reference/<key>_{train,val}.npy, keyed by what
                they depend on: no second model in memory
  live          a frozen copy of the initial weights, run on each micro-batch
  adapters_off  the policy itself with its LoRA adapters switched off, on the same micro-batch: no
                copy, no cache
split_logps gives the log-prob sums of a whole split (the cache, and the policy's at evaluation).
"""
import hashlib
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from nanopack import startup
from nanopack.context import ContextParallel
from nanopack.lora import adapters_disabled
from packing import rank_microbatches, unit_lengths
from nanopack.parallel import all_reduce_sum, print0


@torch.no_grad()
def split_logps(model, data, budget, device, autocast, prefix=None, group_size=2, cp=None):
    """(U, k) log-prob sums of every group of k sequences of a split (DPO pairs: [chosen,
    rejected]), the same on every rank: each runs its share, summed over ranks. A CP group's ranks'
    sums are alike: its first rank's count."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    cp = cp or ContextParallel(data_rank=rank, data_size=world_size)
    was_training = model.training
    model.eval()
    lengths = unit_lengths(data, group_size, prefix)
    sums = torch.zeros(len(lengths), group_size, device=device)
    units = np.arange(len(lengths))
    for mb in rank_microbatches(data, units, lengths, budget * cp.size, group_size, prefix,
                                cp.data_rank, cp.data_size, cp):
        mb = mb.to(device)
        with autocast:
            logps = model(**mb.inputs(), logprobs=True)
        sums[mb.units] = mb.group_sums(logps, group_size)
    if dist.is_initialized():
        dist.all_reduce(sums if cp.rank == 0 else sums.zero_())
    model.train(was_training)
    return sums


def frozen_model(run, model_config, start):
    """The weights of `start` beside the policy, frozen, in the run's dtype: FSDP2-sharded like the
    policy (for the same precision); no gradients, so nothing for DDP to do."""
    parallel = "fsdp" if run.config["parallel"] == "fsdp" else None
    model, _ = startup.build_model(model_config, start, run.config["seed"], run.device, parallel,
                                   run.world_size, getattr(torch, run.dtype))
    return model.requires_grad_(False).eval()


class Reference:
    """Log-prob sums looked up from (U, 2) tables (cached; zeros for simpo), or computed on the same
    micro-batch by `model` (live, or the policy under `switch`, adapters off)."""

    def __init__(self, train=None, val=None, model=None, autocast=None, switch=nullcontext):
        self.train, self.val, self.model = train, val, model
        self.autocast, self.switch = autocast, switch

    def __call__(self, mb):
        """-> (chosen (P,), rejected (P,)) for the pairs of a training micro-batch."""
        if self.model is None:
            ref = self.train[mb.units]
            return ref[:, 0], ref[:, 1]
        return mb.pair_sums(self.logps(mb))

    def logps(self, mb, temperature=1.0):
        """(K,) the reference model's log-prob of each trained token (not with cached tables)."""
        with torch.no_grad(), self.autocast, self.switch():
            return self.model(**mb.inputs(), logprobs=True, temperature=temperature)

    @classmethod
    def of_model(cls, mode, run, model, raw_model, start):
        """'live': a frozen copy of the initial weights `start` (FSDP2: sharded like the policy,
        for the same precision); 'adapters_off': the policy without its adapters."""
        if mode == "adapters_off":
            return cls(model=model, autocast=run.autocast,
                       switch=lambda: adapters_disabled(raw_model))
        return cls(model=frozen_model(run, raw_model.config, start), autocast=run.autocast)

    @classmethod
    def build(cls, mode, run, key, model, raw_model, tok, origin, splits, loader, val_prefix=None):
        """A DPO run's: mode 'none' (simpo), 'cached', 'live' or 'adapters_off'; splits: (train,
        val) token data; origin: the run's start and data_dir; val_prefix: the val split's."""
        train_data, val_data = splits
        # forward only, nothing kept for a backward pass: bigger bins fit
        budget = 4 * run.config["microbatch_tokens"]

        def logps(model, data, prefix):
            return split_logps(model, data, budget, run.device, run.autocast, prefix, cp=run.cp)
        n_train, n_val = len(loader.lengths), len(val_data["offsets"]) // 2
        if mode == "none":
            return cls(torch.zeros(n_train, 2, device=run.device),
                       torch.zeros(n_val, 2, device=run.device))
        if mode in ("live", "adapters_off"):
            ref = cls.of_model(mode, run, model, raw_model, origin["start"])
            with ref.switch():
                # training's: computed on each micro-batch
                ref.val = logps(ref.model, val_data, val_prefix)
            return ref
        folder = os.path.join(run.out_dir, "reference")
        paths = {split: os.path.join(folder, f"{key}_{split}.npy") for split in ("train", "val")}
        # written last: its presence means complete
        key_path = os.path.join(folder, f"{key}.json")
        if all_reduce_sum([float(os.path.exists(key_path))], run.device)[0] == run.world_size:
            print0(f"reference log-probs: loaded {key_path}")
            return cls(*(torch.from_numpy(np.load(paths[s])).to(run.device)
                         for s in ("train", "val")))
        if run.resumed:
            raise SystemExit(f"{key_path} is missing: the reference log-probs of the run being "
                             f"resumed are gone, and its checkpoint holds the trained weights, "
                             f"not the reference; start the run again")
        t0 = time.perf_counter()
        # the policy has not moved yet
        train = logps(model, train_data, loader.prefix)
        val = logps(model, val_data, val_prefix)
        seconds = time.perf_counter() - t0
        if run.master:
            os.makedirs(folder, exist_ok=True)
            for split, values in (("train", train), ("val", val)):
                np.save(paths[split] + ".tmp.npy", values.cpu().numpy())
                os.replace(paths[split] + ".tmp.npy", paths[split])
            with open(key_path, "w") as f:
                json.dump(dict(key=key, reference=origin["start"], data_dir=origin["data_dir"],
                               tokenizer=tok.name, template=tok.template_id, dtype=run.dtype,
                               train_pairs=n_train, val_pairs=n_val, seconds=seconds), f, indent=2)
        if dist.is_initialized():
            dist.barrier()
        # as computed
        tokens = int(loader.lengths.sum()) + int(unit_lengths(val_data, 2, val_prefix).sum())
        print0(f"reference log-probs: {n_train} train + {n_val} val pairs, {tokens:,} tokens "
               f"in {seconds:.1f}s ({tokens / seconds / run.world_size:,.0f} tok/s/gpu), "
               f"saved as {key_path}")
        return cls(train, val)


def cache_key(run, start, tok, splits):
    """What the cached log-probs depend on, hashed: the initial weights (a fingerprint, not a path:
    new weights in the same folder miss the cache), both splits' tokens, the tokenizer,
    template and dtype."""
    scratch = start["init_from"] == "scratch"
    h = hashlib.sha256(json.dumps(["nanopack-reference-v2", start, tok.name, tok.template_id,
                                   run.dtype, run.config["seed"] if scratch else None,
                                   torch.__version__ if scratch else None]).encode())
    for split_data in splits:
        for k in ("ids", "offsets", "loss_mask"):
            h.update(np.ascontiguousarray(split_data[k]))
    return h.hexdigest()[:16]
