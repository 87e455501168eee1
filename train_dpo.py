"""
Padding-free DPO, read top to bottom like train_sft.py: config, setup, reference log-probs, loop,
log, save.

    # built-in: SFT the toy model, then DPO it (CPU ok)
    python train_sft.py && python train_dpo.py
    # after train_sft.py config/sft_qwen2.5_0.5b.py
    python train_dpo.py config/dpo_qwen2.5_0.5b.py --data=prefs.jsonl
    torchrun --nproc_per_node=8 train_dpo.py config/dpo_llama3.1_8b_fsdp.py --data=prefs.jsonl

Every optimizer step takes `batch_size` preference pairs (global, whatever the world size). A pair's
chosen and rejected sequences sit in the same micro-batch, packed with other whole pairs into at
most `microbatch_tokens` tokens; one forward pass gives every sequence's log-prob sum (one
index_add_ over sequence ids). The reference model's sums are computed once before training and kept
on disk (reference='cached'), or, with LoRA, by the same network with its adapters switched off: no
second model in memory either way. The step loss is the mean over the step's pairs: any micro-batch
size and world size give the same step.
"""

import time

import torch

import data.arithmetic as builtin_task
from nanopack.checkpoint import export_hf, save_checkpoint
from nanopack import keys
from nanopack.configurator import configure
from losses import LOSS_TYPES, STATS, RewardShift, dpo_loss, pair_stats, preference_loss
from nanopack.metrics import MetricsLogger, Throughput, Timer, format_eta
from packing import PackedLoader, shared_prefixes, target_counts
from nanopack.parallel import all_reduce_sum, fail, print0, sync_gradients, teardown_distributed
from nanopack.reference import Reference, cache_key, split_logps
from nanopack.run import clip_grad_norm, lr_at, set_lr, start_run
from nanopack.startup import (data_summary, initial_weights, load_model, load_splits,
                              load_tokenizer, lora_settings, param_groups, restore)

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value, and so can the
# machinery's keys (device, precision, parallelism, LoRA, reading records, wandb): nanopack/keys.py
out_dir = "out/dpo"
# what `python train_sft.py` leaves; any Hugging Face folder or hub name, 'scratch', 'resume'
init_from = "out/sft/hf"
# 'builtin' (arithmetic pairs), records (.jsonl, .parquet, shards, glob, hub name), a prepared dir
data = "builtin"
# records: the val split (e.g. 'data/test_prefs-*.parquet'); default: hold out val_fraction
val_data = None
max_len = 4096  # records only: longest sequence kept; longer ones follow `overlong`
overlong = "error"  # records only: 'error', 'truncate' or 'skip' (counted and printed)
batch_size = 32  # preference pairs per optimizer step, all ranks together
# token budget of one forward pass on one rank (whole pairs: chosen + rejected)
microbatch_tokens = 4096
max_iters = 0  # optimizer steps; 0 = `epochs` passes over the data
epochs = 1.0
# the toy model; a pretrained init_from gets fine-tuning values (see configure below)
learning_rate = 2e-4
min_lr = 2e-5
warmup_iters = 5
weight_decay = 0.0
grad_clip = 1.0
# 'sigmoid' (DPO), 'ipo', 'hinge', 'dpo_norm' (length-averaged DPO), 'simpo' (no reference),
# 'apo_zero' (each reward against 0), 'robust' (rDPO: label noise label_smoothing),
# 'bco_pair' (BCO's classifier)
loss_type = "sigmoid"
# the inverse temperature of the implicit reward: larger = the loss saturates at smaller margins
beta = 2.0
# sigmoid, dpo_norm, simpo, robust: assumed chance that a pair's label is flipped
label_smoothing = 0.0
gamma = 0.5  # simpo: target reward margin
# adds sft_weight * NLL per target token of the step's chosen responses (train_sft.py's loss)
sft_weight = 1.0
# 'cached': log-probs computed once, kept on disk; 'live': a frozen copy; 'adapters_off': the
# policy with its LoRA adapters switched off (no copy, no cache); 'auto': adapters_off with LoRA,
# else cached
reference = "auto"
# a pair's shared prompt is computed once (prompt | chosen | rejected), not twice: same numbers
prefix_sharing = True
# logging and evaluation, as in train_sft.py (see there what each key does)
log_interval = 10
# evaluate (val loss, reward accuracy; built-in: accuracy, style) and checkpoint; 0 = at the end
eval_interval = 16
eval_examples = 200
val_fraction = 0.01
wandb_run_name = "dpo"
# a pretrained init_from gets these for keys not set: Zephyr's and Tulu's DPO of 7-8B models
# (lr 5e-7, beta 0.1); the toy values above drive a real model to loss 0 within a few steps
config = configure(globals(), machinery=keys, rules=dict(
    keys.RULES, loss_type=LOSS_TYPES, reference=("auto", "cached", "live", "adapters_off"),
    beta="(0, inf)", label_smoothing="[0, 0.5)", sft_weight="[0, inf)"),
    read_by=dict(gamma=("loss_type", ("simpo",), "SimPO's target margin")),
    finetune=dict(learning_rate=5e-7, min_lr=5e-8, beta=0.1, sft_weight=0.0))
if label_smoothing and loss_type in ("ipo", "hinge", "apo_zero", "bco_pair"):
    fail(f"config error: label_smoothing={label_smoothing}; it must be 0 for "
         f"loss_type='{loss_type}' (it has no label noise term)")
if reference == "adapters_off" and not config["lora_rank"]:
    fail("config error: reference='adapters_off'; 'adapters_off' is the base model under the "
         "adapters: it needs lora_rank > 0")
# -----------------------------------------------------------------------------

# ranks, device, precision, out_dir lock, signals, seed; on resume, its ckpt.pt
run = start_run(config, __file__, data_kind="dpo", init_maker="python train_sft.py")
tok = load_tokenizer(config, run.resumed)
# an HF folder | scratch | the resumed run's
start, model_config = initial_weights(config, tok, run.resumed)
# built-in: 64 steps of 32 pairs; a pair is a unit of two sequences, chosen and rejected
data_dir, train_data, val_data = load_splits(config, run, tok, model_config, "dpo", group_size=2,
                                             builtin_sizes=dict(n_train=2048, n_val=200))
# LoRA; DDP/FSDP2; compile
model, raw_model = load_model(config, run, model_config, start)
device, world_size = run.device, run.world_size
optimizer = torch.optim.AdamW(param_groups(raw_model, weight_decay), lr=learning_rate,
                              betas=(0.9, 0.95), fused=device.type == "cuda")
loader = PackedLoader(train_data, batch_size, microbatch_tokens * run.cp.size,
                      rank=run.cp.data_rank, world_size=run.cp.data_size, seed=config["seed"],
                      group_size=2, prefix_sharing=prefix_sharing, context=run.cp)
max_iters = max_iters or max(1, round(epochs * len(loader)))
# resume: weights, optimizer state, RNG, loader position, and this script's own state
iter_num, resumed_extras = restore(run, model, optimizer, loader)
run.begin(raw_model, iter_num, max_iters, data_summary(config, loader, train_data, data_dir,
                                                       model_config.max_seq_len, units="pairs"))
# what ckpt.pt records besides the weights: a resumed run starts from it
origin = dict(tokenizer=tok.name, data_dir=data_dir, start=start, model_config=model_config)
ref_mode = "none" if loss_type == "simpo" else (reference if reference != "auto" else
                                                "adapters_off" if config["lora_rank"] else "cached")
print0(f"DPO: {loss_type} loss, beta {beta}, reference {ref_mode}")
# what computing each shared prompt once saves, over the train split
if loader.prefix is not None:
    # each pair's rejected: what it shares with its chosen
    shared = loader.prefix[1::2]
    print0(f"prefix sharing: {(shared > 0).sum():,} of {len(shared):,} pairs share a prefix (mean "
           f"{shared.mean():.1f} tokens): {int(train_data['offsets'][-1]):,} -> "
           f"{loader.lengths.sum():,} tokens per epoch")
logger = MetricsLogger(out_dir, config["wandb_log"], config["wandb_project"], wandb_run_name,
                       config, resume_iter=iter_num if init_from == "resume" else None)

# ---- reference log-probs: computed once from the initial weights (or a live frozen copy of them)
t_ref = time.perf_counter()
ref_key = resumed_extras.get("ref_key") or cache_key(run, start, tok, (train_data, val_data))
# the train split's: loader.prefix
val_prefix = shared_prefixes(val_data) if prefix_sharing else None
ref = Reference.build(ref_mode, run, ref_key, model, raw_model, tok, origin, (train_data, val_data),
                      loader, val_prefix)
ref_cache_seconds = time.perf_counter() - t_ref
# (P, 2): what dpo_norm, ipo, simpo divide by
targets_train, targets_val = (
    torch.tensor(target_counts(d).reshape(-1, 2), dtype=torch.float32, device=device)
    for d in (train_data, val_data))
# step normaliser for sft_weight, on the host
chosen_targets = target_counts(train_data).reshape(-1, 2)[:, 0]
# bco_pair's reward shift, saved with the checkpoint
shift = RewardShift(*resumed_extras.get("bco_rewards", (0.0, 0)))


def microbatch_loss(mb, num_pairs, num_chosen_targets):
    """-> (its share of the step loss, to backpropagate; its pair_stats, for the log).
    The share: its pairs' summed losses / the step's global pairs (+ sft_weight x its chosen NLL /
    the step's chosen target tokens), times world_size as DDP and FSDP average gradients."""
    with run.autocast:
        # (K,) one per trained token
        logps = model(**mb.inputs(), logprobs=True)
    # (P,) each: one index_add_ over sequence ids
    pc, pr = mb.pair_sums(logps)
    rc, rr = ref(mb)
    lens = targets_train[mb.units]
    losses, rewards_c, rewards_r = dpo_loss(pc, pr, rc, rr, lens[:, 0], lens[:, 1], loss_type,
                                            beta, label_smoothing, gamma, shift.value)
    loss = preference_loss(losses, pc, num_pairs, num_chosen_targets, sft_weight)
    return loss * world_size, pair_stats(losses, rewards_c, rewards_r, pc, pr)


@torch.no_grad()
def evaluate():
    """Val preference loss, reward accuracy and margin; built-in task: exact-match accuracy;
    printed and logged."""
    out = {}
    if len(targets_val):
        val_logps = split_logps(model, val_data, 4 * microbatch_tokens, device, run.autocast,
                                val_prefix, cp=run.cp)
        chosen, rejected = val_logps.unbind(1)
        losses, rewards_c, rewards_r = dpo_loss(chosen, rejected, ref.val[:, 0], ref.val[:, 1],
                                                targets_val[:, 0], targets_val[:, 1], loss_type,
                                                beta, label_smoothing, gamma, shift.value)
        val_loss = preference_loss(losses, chosen, len(losses), targets_val[:, 0].sum(),
                                   sft_weight)
        out.update(val_loss=val_loss.item(),
                   val_reward_accuracy=(rewards_c > rewards_r).float().mean().item(),
                   val_reward_margin=(rewards_c - rewards_r).mean().item())
    # greedy replies: exact match, and the share in the preferred style
    if data == "builtin" and eval_examples > 0:
        model.eval()
        sync_ranks = config["parallel"] == "fsdp" and world_size > 1
        out.update(builtin_task.evaluate(raw_model, tok, eval_examples, run.autocast,
                                         sync_ranks=sync_ranks))
        model.train()
    parts = [f"val loss {out['val_loss']:.4f} | "
             f"val reward accuracy {100 * out['val_reward_accuracy']:.1f}% | "
             f"val margin {out['val_reward_margin']:.3f}"] if "val_loss" in out else []
    parts += [f"val accuracy {100 * out['val_accuracy']:.1f}% | preferred (plain style) "
              f"{100 * out['val_preferred']:.1f}%"] if "val_accuracy" in out else []
    if parts:
        print0(f"iter {iter_num}: " + " | ".join(parts))
        logger.log(dict(iter=iter_num, **out))
    return out


def log_window(elapsed, n_steps, grad_norm):
    """The log line of the steps since the last one: means over their pairs on all ranks
    (stats_acc, pairs_window)."""
    # summed over ranks: pairs_window is already global
    perf, sums = meter.read(elapsed, n_steps, [stats_acc[k].item() for k in STATS])
    total = dict(zip(STATS, sums))
    avg = {k: v / max(pairs_window, 1) for k, v in total.items()}
    # the chosen responses' NLL per target token
    nll = -total["logps_chosen"] / max(chosen_targets_window, 1)
    eta = (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
    metrics = dict(iter=iter_num, **avg,
                   reward_margin=avg["rewards_chosen"] - avg["rewards_rejected"], lr=lr,
                   grad_norm=grad_norm.item(), skipped_steps=run.guard.skipped_steps, **perf,
                   ref_cache_seconds=ref_cache_seconds)
    metrics["loss"] = avg["loss"] + sft_weight * nll if pairs_window else float("nan")
    if sft_weight:
        metrics["nll_chosen"] = nll
    if loss_type == "bco_pair":
        metrics["reward_shift"] = shift.value
    print0(f"iter {iter_num}/{max_iters} | loss {metrics['loss']:.4f} | reward acc "
           f"{100 * avg['reward_accuracy']:.1f}% | margin {metrics['reward_margin']:.3f} | "
           f"lr {lr:.2e} | grad norm {metrics['grad_norm']:.2f} | {meter.line(metrics)} | "
           f"eta {format_eta(eta)}")
    logger.log(metrics)


# ---- the loop
# the starting point, for "before -> after"
results = {} if iter_num else evaluate()
before = resumed_extras.get("before", {k: v for k, v in results.items()
                                      if k in ("val_accuracy", "val_preferred")})
timer = Timer(device)
# tokens, padding, FLOPs since the last log line; a per-step reference adds a forward (4/3 FLOPs)
meter = Throughput(raw_model, device, world_size,
                   flops_factor=1.0 if ref_mode in ("cached", "none") else 4 / 3)
zeros = lambda: {k: torch.zeros((), device=device, dtype=torch.float64) for k in STATS}
# pair_stats summed since the last log line
stats_acc = zeros()
pairs_window = chosen_targets_window = 0
# evaluation inside a log window is not training time
eval_seconds = train_seconds = 0.0
start_iter, last_log_iter, t_start = iter_num, iter_num, time.perf_counter()
while iter_num < max_iters:
    lr = set_lr(optimizer, lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters))
    t0 = time.perf_counter()
    step = next(loader)
    # global, like step.num_groups
    num_chosen_targets = int(chosen_targets[step.units].sum())
    mbs = [mb.to(device) for mb in step.microbatches]
    meter.count(step.microbatches, data_time=time.perf_counter() - t0)
    step_stats, step_loss = zeros(), torch.zeros((), device=device, dtype=torch.float64)
    for i, mb in enumerate(mbs):
        with sync_gradients(model, enabled=i == len(mbs) - 1):
            loss, stats = microbatch_loss(mb, step.num_groups, num_chosen_targets)
            loss.backward()
        # this rank's part of the step's loss
        step_loss += loss.detach() / world_size
        for k in STATS:
            step_stats[k] += stats[k]
    grad_norm = clip_grad_norm(model, grad_clip)
    # finite on every rank? a stop signal?
    update, stopping = run.guard.check(model, step_loss, grad_norm, iter_num + 1)
    # a skipped step (NaN or infinite statistics) counts in skipped_steps, not in the averages
    if update:
        optimizer.step()
        # a CP group's ranks hold the same pairs' statistics: its first rank counts them
        for k in STATS:
            stats_acc[k] += step_stats[k] * (run.cp.rank == 0)
        pairs_window += step.num_groups
        chosen_targets_window += num_chosen_targets
        if loss_type == "bco_pair":
            # one value on every rank: the step's rewards summed over ranks (a CP group's once)
            step_rewards = (step_stats["rewards_chosen"] + step_stats["rewards_rejected"]).item()
            (step_rewards,) = all_reduce_sum([step_rewards * (run.cp.rank == 0)], device)
            shift.update(step_rewards, 2 * step.num_groups)
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1

    last = iter_num == max_iters
    # a stop logs its partial window: no step goes unlogged
    if iter_num % log_interval == 0 or last or stopping:
        elapsed = timer.lap() - eval_seconds
        eval_seconds, train_seconds = 0.0, train_seconds + elapsed
        log_window(elapsed, iter_num - last_log_iter, grad_norm)
        last_log_iter, stats_acc, pairs_window, chosen_targets_window = iter_num, zeros(), 0, 0
    extras = dict(ref_key=ref_key, before=before, bco_rewards=shift.state_dict())
    if (eval_interval and iter_num % eval_interval == 0) or last:
        t_eval = time.perf_counter()
        results = evaluate()
        save_checkpoint(run, origin, model, optimizer, iter_num, step.state, extra=extras,
                        evaluation=results)
        eval_seconds += time.perf_counter() - t_eval
    # a stop on an evaluation step is saved above, with its evaluation
    elif stopping:
        save_checkpoint(run, origin, model, optimizer, iter_num, step.state, extra=extras)
    # on the last step the run ends as usual: export
    if stopping and not last:
        logger.finish()
        run.exit_stopped(iter_num)

print0(f"time: reference log-probs {ref_cache_seconds:.1f}s, training {train_seconds:.1f}s")
if before and "val_accuracy" in results:
    print0(f"held-out, greedy: preferred behaviour (plain style) "
           f"{100 * before['val_preferred']:.1f}% -> {100 * results['val_preferred']:.1f}% | "
           f"exact-match accuracy {100 * before['val_accuracy']:.1f}% -> "
           f"{100 * results['val_accuracy']:.1f}% (before DPO -> after)")
logger.finish()
export_hf(run, model, raw_model, tok, start, lora_settings(config))
teardown_distributed()
