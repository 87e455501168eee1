"""
On-policy RL from the model's own replies, read top to bottom like train_sft.py and train_dpo.py:
config, start-up, prompts, loop (sample -> reward -> loss -> step), log, save.

    python train_sft.py && python train_dpo.py && python train_rl.py    # built-in (CPU ok)
    python train_rl.py --init_from=Qwen/Qwen2.5-0.5B-Instruct --data=prompts.jsonl \
        --reward=my_rewards:exact
    torchrun --nproc_per_node=8 train_rl.py --init_from=... --data=... --loss=online_dpo

Each step samples k replies to each of `prompts_per_step` prompts (every prompt prefilled once),
scores them with `reward` (nanopack/rewards.py: 'module:function', called with the prompt, the
reply and the record's other fields) and trains on them with each prompt computed once for its
group. `loss` picks the objective: the GRPO family (losses.RL_PRESETS, as TRL's GRPOTrainer) or
online DPO. Each reply's random stream is keyed by (seed, prompt position, reply): a step's samples
depend neither on the world size nor on a resume. docs/rl.md has the rest.
"""

import math
import sys
import time

import numpy as np
import torch

from nanopack.checkpoint import export_hf, save_checkpoint
from nanopack import keys
from nanopack.configurator import configure
from data.dataset import check_group_fits, read_prompts
from losses import (GRPO_FAMILY, RL_OBJECTIVES, RL_PRESETS, RL_READ_BY, group_advantages,
                    loss_weights, sampler_mismatch)
from nanopack.metrics import MetricsLogger, Throughput, Timer, format_eta
from packing import group_data, rank_microbatches, shared_prefixes, unit_lengths
from nanopack.parallel import (all_reduce_max, all_reduce_sum, fail, print0, sync_gradients,
                               teardown_distributed)
from nanopack.reference import Reference
from nanopack.env import EnvError, Multiturn
from nanopack.rewards import RewardError, Rewards
from nanopack.rollout import (Rollouts, sampled_tokens, sampler_logps, teaches, trajectory_log,
                              trajectory_sums)
from nanopack.run import clip_grad_norm, lr_at, set_lr, start_run
from nanopack.teacher import load_teacher
from nanopack.startup import (initial_weights, load_model, load_tokenizer, lora_settings,
                              param_groups, restore)

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value, and so can the
# machinery's keys (device, precision, parallelism, LoRA, reading records, wandb): nanopack/keys.py
out_dir = "out/rl"
# what `python train_dpo.py` leaves; any Hugging Face folder or hub name, 'scratch', 'resume'
init_from = "out/dpo/hf"
# 'builtin' (the arithmetic task's hard split) or records {"prompt" or "messages", reward fields}
data = "builtin"
val_data = None  # records: held-out prompts for evaluation (builtin: the hard split's val chats)
# 'builtin' (exact answer), 'math' (math-verify), 'none' or 'module:function' (rewards.py); 'a,b'
reward = "builtin"
# one per reward, e.g. 1,0.5: the total reward is their weighted sum; default: 1 each
reward_weights = None
k = 8  # replies sampled per prompt (a group)
prompts_per_step = 32  # prompts per step, all ranks together
temperature = 1.0
top_p = 1.0
max_new_tokens = 20  # a reply (with env: a trajectory after its prompt) is cut here (truncated)
# multi-turn (docs/rl.md): 'builtin' (follow-up questions on the model's own answers) or
# 'module:Class' made per trajectory from its record's fields, step(reply) -> (obs, reward, done)
env = None
tools = None  # 'module:function,...': Python functions the model calls in its template's format
max_turns = 4  # env / tools: replies in a trajectory
# 'online_dpo', or a paper's setting of the GRPO family's keys below (each printed at --help's end):
# 'grpo' (DeepSeekMath), 'dapo' (DAPO; TRL's default), 'dr_grpo' (Dr. GRPO), 'gspo' (GSPO),
# 'cispo' (MiniMax-M1), 'distill' (on-policy distillation from `teacher`: docs/distill.md)
loss = "dapo"
teacher = None  # distill: a Hugging Face folder or hub name with the student's vocabulary
distill_coef = 1.0  # distill: advantage (1 - c) x group's + c x (log p_teacher - log p_student)
# 'reply_mean': each reply's mean over its tokens, then the mean over the step's replies (TRL
# loss_type='grpo'); 'token_mean': over the step's reply tokens (TRL 'dapo'); 'constant': the sum
# over (the step's replies x max_new_tokens) (TRL 'dr_grpo')
loss_aggregation = "token_mean"
# advantage: reward less its group's mean, over the std of its 'group', the step's ('batch')
# rewards, or 'none'
scale_rewards = "group"
# the ratio clipped to [1 - clip_eps, 1 + clip_eps_high], from a batch's second update on
clip_eps = 0.2
# DAPO's clip-higher (TRL epsilon_high; for clip_mode='cispo' TRL's is 1 + this)
clip_eps_high = 0.28
# 'token': a ratio per token; 'sequence': one per reply, exp of its mean (GSPO)
importance_sampling_level = "token"
# 'ppo': -min(r A, clip(r) A); 'cispo': -sg(clip(r)) A log p, every token keeps its gradient
clip_mode = "ppo"
# the sampler/trainer mismatch corrected as TRL's vllm_importance_sampling_mode: 'none',
# 'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask' (TRL's default)
is_correction = "sequence_mask"
is_cap = 3.0  # is_correction: the largest ratio kept (truncate: clipped to it; mask: above it, 0)
# replies that have not stopped by max_new_tokens leave the loss (DAPO's overlong filtering)
mask_truncated = True
# DAPO: groups whose k rewards are all equal leave, more prompts are sampled to fill the step
dynamic_sampling = True
max_extra_rounds = 3  # dynamic_sampling: rounds of prompts_per_step more prompts a step may sample
beta = 0.1  # online_dpo: DPO's inverse temperature
# the GRPO family: weight of the k3 estimate of KL to the initial model (0: no reference model)
kl_coef = 0.0
updates_per_batch = 1  # optimizer steps taken on each step's samples
prefix_sharing = True  # each prompt computed once for its group, not k times: same numbers
microbatch_tokens = 4096  # token budget of one forward pass on one rank (whole groups)
max_iters = 100  # steps (sample, then updates_per_batch updates)
# the toy model; a pretrained init_from gets fine-tuning values (see configure below)
learning_rate = 2e-4
min_lr = 2e-5
warmup_iters = 5
weight_decay = 0.0
grad_clip = 1.0
# evaluation and logging
eval_examples = 200
# evaluate (greedy replies to held-out prompts: reward, accuracy) and checkpoint; 0 = at the end
eval_interval = 10
wandb_run_name = "rl"
# env='builtin' scores with its own rewards, its trajectories up to 4 replies and 3 follow-ups
ENV_PRESET = dict(reward="none", max_new_tokens=128)
# from a pretrained model, keys not set explicitly take these instead (TRL's GRPO default rate)
config = configure(globals(), machinery=keys, finetune=dict(learning_rate=1e-6, min_lr=1e-7),
                   presets=dict(loss=RL_PRESETS, env=dict(builtin=ENV_PRESET)),
                   read_by=RL_READ_BY, rules=dict(
    keys.RULES, loss=(*GRPO_FAMILY, "online_dpo"), k="[2, inf)",
    prompts_per_step="[1, inf)", temperature="(0, inf)", top_p="(0, 1]",
    max_new_tokens="[1, inf)", beta="(0, inf)",
    loss_aggregation=("reply_mean", "token_mean", "constant"),
    scale_rewards=("group", "batch", "none"),
    clip_eps="(0, inf)", clip_eps_high="(0, inf)",
    importance_sampling_level=("token", "sequence"),
    clip_mode=("ppo", "cispo"), max_extra_rounds="[0, inf)", kl_coef="[0, inf)",
    is_correction=("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    is_cap="(0, inf)",
    updates_per_batch="[1, inf)", max_iters="[1, inf)", distill_coef="[0, 1]",
    max_turns="[1, inf)"))
# -----------------------------------------------------------------------------


# the objective, chosen once: a micro-batch's loss and the names of its sums
objective, objective_stats = RL_OBJECTIVES[loss]
# as TRL: the GRPO family's ratios and KL are to the policy that sampled, at its temperature;
# online DPO's pairs are scored at 1
score_at = temperature if loss in GRPO_FAMILY else 1.0
if mask_truncated and loss == "online_dpo":
    fail("config error: mask_truncated=True with loss='online_dpo': a DPO pair trains whole "
         "replies; drop --mask_truncated or choose a loss of the GRPO family")
if env and tools:
    fail(f"config error: env={env!r} and tools={tools!r}: tools are the environment ToolEnv; "
         f"choose one (an environment of your own can call your functions)")
try:
    reward_fns = Rewards(reward, reward_weights)
    # trajectories: each record's environment (ToolEnv with tools), its turns
    multiturn = Multiturn(env, tools, max_turns) if env or tools else None
except (RewardError, EnvError) as e:
    fail(f"config error: {e}")
# ranks, device, precision, out_dir lock, signals, seed; on resume, its ckpt.pt
run = start_run(config, __file__, data_kind="rl",
                init_maker="python train_sft.py && python train_dpo.py")
device, world_size, rank = run.device, run.world_size, run.rank
# FSDP2: every forward of generation is a collective
sync_ranks = config["parallel"] == "fsdp" and world_size > 1
# what a CP group's ranks hold alike (its RL groups, pairs) is counted by its first rank
first_in_cp = run.cp.rank == 0
tok = load_tokenizer(config, run.resumed)
# an HF folder | scratch | the resumed run's
start, model_config = initial_weights(config, tok, run.resumed)
stop_ids = set(tok.stop_ids)


def check_prompt_length(ids, where):
    check_group_fits(ids, where, k, max_new_tokens, prefix_sharing, microbatch_tokens,
                     config["context_parallel"], model_config.max_seq_len)


def scorable(record_fields, where):
    """Missing or clashing fields stop the run; a value a reward cannot score is a bad record."""
    reward_fns.check_fields(record_fields, where)
    return reward_fns.check_values(record_fields, where)


# the prompts, every answer checked by the reward, before the model loads: a bad record costs
# seconds, not a model load
try:
    # with tools: every prompt offers them; env='builtin': the built-in task's follow-ups
    offered = dict(tools=multiturn and multiturn.schemas, builtin_env=env == "builtin")
    train_prompts = read_prompts(data, None, tok, check_prompt_length, config["data_split"],
                                 "data_split", config["fields"], scorable, config["bad_records"],
                                 **offered)
    has_val = eval_examples and (val_data or data == "builtin")
    val_prompts = read_prompts(val_data or data, eval_examples, tok, check_prompt_length,
                               config["val_split"], "val_split", config["fields"], scorable,
                               config["bad_records"], **offered) if has_val else []
    # the built-in task's too
    for _, _, record_fields, where in train_prompts + val_prompts:
        reward_fns.check_fields(record_fields, where)
except RewardError as e:
    fail(f"data error: {e}")
except SystemExit as e:
    fail(e.code)
# LoRA; DDP/FSDP2; compile
model, raw_model = load_model(config, run, model_config, start)
optimizer = torch.optim.AdamW(param_groups(raw_model, weight_decay), lr=learning_rate,
                              betas=(0.9, 0.95), fused=device.type == "cuda")
# resume: weights, optimizer state, RNG
iter_num, resumed_extras = restore(run, model, optimizer)
run.begin(raw_model, iter_num, max_iters)
# what ckpt.pt records besides the weights: a resumed run starts from it (RL has no token files)
origin = dict(tokenizer=tok.name, data_dir=None, start=start, model_config=model_config)
knobs = [*RL_PRESETS["grpo"], "kl_coef"] if loss in GRPO_FAMILY else ["beta", "dynamic_sampling"]
knobs += ["max_extra_rounds"] * dynamic_sampling + ["teacher", "distill_coef"] * (loss == "distill")
print0(f"RL: {loss} loss ({', '.join(f'{key}={config[key]}' for key in knobs)}), "
       f"{len(train_prompts)} train prompts, {prompts_per_step} x {k} replies per step, "
       f"reward {reward_fns}, {len(val_prompts)} held-out prompts")
logger = MetricsLogger(out_dir, config["wandb_log"], config["wandb_project"], wandb_run_name,
                       config, resume_iter=iter_num if init_from == "resume" else None)
ref = Reference.of_model("adapters_off" if config["lora_rank"] else "live", run, model, raw_model,
                         start) if loss == "online_dpo" or kl_coef else None
teacher_model = load_teacher(run, teacher, model_config) if loss == "distill" else None


rollouts = Rollouts(run, config, train_prompts, reward_fns, model, raw_model, tok, sync_ranks,
                    multiturn)


def reward_std(rewards, ddof=0):
    """The standard deviation of every rank's rewards (a CP group's counted once), in two passes:
    the sum of squares less the squared sum cancels to 0 for rewards with a large offset (1e8)."""
    r = np.asarray(rewards, dtype=np.float64).ravel()
    total, n = all_reduce_sum([r.sum() * first_in_cp, r.size * first_in_cp], device)
    (squares,) = all_reduce_sum([((r - total / max(n, 1)) ** 2).sum() * first_in_cp], device)
    return math.sqrt(squares / max(n - ddof, 1))


def every_reply(replies, rewards, keep, cut, lengths, sampled):
    """The GRPO family trains every reply of the kept groups (a cut one: none of its tokens) on
    its sampled tokens -> (the groups to pack, replies per group, their masks, this rank's share of
    the step's normaliser, a function of the step's normaliser -> (advantages, loss weights, trained
    tokens) of each reply of the kept groups)."""
    masks = [[m * (1 - c) for m, c in zip(sampled[g], cut[g])] for g in keep]
    per_step = dict(token_mean=lengths.sum(), reply_mean=lengths.size,
                    constant=lengths.size * max_new_tokens)

    def per_reply(normaliser):
        # TRL's: unbiased, over the step
        batch_std = reward_std(rewards, ddof=1) if scale_rewards == "batch" else None
        # (G', k); G' = 0: no group, no std to take
        kept = torch.from_numpy(rewards[keep])
        advantages = group_advantages(kept, scale_rewards, batch_std) if keep else kept
        advantages = advantages.flatten().float()
        reply_tokens = torch.from_numpy(lengths[keep].flatten()).float()
        weights = loss_weights(reply_tokens, loss_aggregation, normaliser)
        return [x.to(device) for x in (advantages, weights, reply_tokens)]
    return [replies[g] for g in keep], k, masks, per_step[loss_aggregation], per_reply


def best_and_worst(replies, rewards, keep, cut, lengths, sampled):
    """Online DPO trains each kept group's best and worst reply as a pair -> as every_reply; the
    step's normaliser is its pairs."""
    pairs = [[replies[g][rewards[g].argmax()], replies[g][rewards[g].argmin()]] for g in keep]
    return pairs, 2, None, len(keep), lambda num_pairs: num_pairs


replies_to_train = every_reply if loss in GRPO_FAMILY else best_and_worst


def training_batches(prompts, replies, logps, trajectories, rewards):
    """The step's groups -> (host micro-batches, as many on every rank; each one's sampler log-probs
    (None: online DPO, or a CP slice); what the objective needs besides (every_reply's per-reply
    values, or the step's pairs); groups that teach something; tokens unshared). A group whose k
    rewards are equal is not computed (unless kl_coef > 0: its KL term); it counts in the step's
    normaliser as TRL counts it (it has no loss)."""
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1, k)
    taught = teaches(rewards) | (loss == "distill")
    # kl_coef is the GRPO family's only (configure refuses it with online_dpo)
    keep = [g for g in range(len(prompts)) if taught[g] or kl_coef]
    # each reply's sampled tokens (not a trajectory's observations); cut: no stop token, or a limit
    each = [sampled_tokens(g, t, stop_ids) for g, t in zip(replies, trajectories)]
    sampled, cut = zip(*each) if each else ((), ())
    cut = np.array(cut, dtype=bool).reshape(-1, k) & mask_truncated
    lengths = np.array([[m.sum() for m in group] for group in sampled], dtype=np.int64)
    lengths = lengths.reshape(-1, k) * ~cut
    units, size, masks, count, step_values = replies_to_train(replies, rewards, keep, cut, lengths,
                                                              sampled)
    normaliser, trained = all_reduce_sum([count * first_in_cp, taught.sum() * first_in_cp], device)
    objective_input = step_values(max(normaliser, 1))
    data = group_data([prompts[g][0] for g in keep], units, masks)
    prefix = shared_prefixes(data, size) if prefix_sharing else None
    # each rank's groups are its own: as many micro-batches as the busiest rank's
    mbs = rank_microbatches(data, np.arange(len(keep)), unit_lengths(data, size, prefix),
                            microbatch_tokens * config["context_parallel"], size, prefix,
                            context=run.cp, busiest=lambda n: all_reduce_max(n, device))
    # a CP slice holds part of its replies' tokens: the sampler's are not sliced (yet)
    sampler = [sampler_logps(logps, keep, masks, mb.units, size)
               if masks is not None and config["context_parallel"] == 1 else None for mb in mbs]
    unshared = int(np.diff(data["offsets"]).sum()) * first_in_cp
    return mbs, sampler, objective_input, trained, unshared


def microbatch_loss(mb, objective_input, old):
    """This micro-batch's share of the step loss (times world_size: DDP and FSDP average gradients
    over ranks), and its sums for the log by name (the objective's, the sampled tokens' -log p and
    their count). old: its state kept over a batch's updates (the sampling policy's and the
    reference's log-probs)."""
    with run.autocast:
        # (K,) one per trained token
        logps = model(**mb.inputs(), logprobs=True, temperature=score_at)
    if "ref" not in old:
        old["ref"], old["teacher"] = (m and m.logps(mb, score_at) for m in (ref, teacher_model))
        old["sampling"] = logps.detach()
        # the mismatch: the sampler's log-probs (KV-cache decode) vs the trainer's (packed forward)
        k3, ratio = sampler_mismatch(old["sampling"], old["sampler"]) if old["sampler"] \
            is not None else (logps[:0], logps[:0])
        old["k3"] = k3.sum()
        mismatch["max_ratio"] = max(mismatch["max_ratio"], ratio.max().item() if len(ratio) else 0)
    # the objective reads the sampler's log-probs with the micro-batch (none: no correction)
    mb.sampler_logps = old["sampler"]
    settings = config if old["sampler"] is not None else dict(config, is_correction="none")
    loss_share, sums = objective(mb, logps, old, objective_input, settings)
    sums.update(sampled_nll=-old["sampling"].sum(), target_tokens=float(mb.num_target_tokens),
                sampler_k3=old["k3"])
    return loss_share * world_size, sums


@torch.no_grad()
def evaluate():
    """Greedy replies to the held-out prompts, split over ranks: mean reward and accuracy (the share
    rewarded 1 or more: the built-in task's exact answers); printed and logged."""
    if not val_prompts:
        return {}
    mine = val_prompts[rank::world_size]
    # multi-turn: each prompt's trajectory, greedy, to its end
    played = rollouts.play(mine, range(len(mine)), 1, 0.0) if multiturn else None
    replies = rollouts.generate(mine)[0] if played is None else None
    rewards, _ = rollouts.score(mine, replies, 1, played)
    total, right, n = all_reduce_sum(
        [rewards.sum().item(), (rewards >= 1).sum().item(), len(mine)], device)
    out = dict(val_reward=total / n, val_accuracy=right / n)
    print0(f"iter {iter_num}: held-out, greedy: mean reward {out['val_reward']:.3f} | accuracy "
           f"{100 * out['val_accuracy']:.1f}%")
    logger.log(dict(iter=iter_num, **out))
    return out


# microbatch_loss's sums
STEP_STATS = ("loss", "sampled_nll", "target_tokens", "sampler_k3", *objective_stats)


def log_step(sums, sampled, trained, unshared, gen_s, reward_s, train_s, grad_norm):
    """Every step's log line (a step takes seconds): its loss, the rewards and lengths of its
    samples on all ranks (every round), its groups, its speed; the policy's ratios and clipping in
    the step's last update."""
    replies, rewards, each, trajectories, rounds = sampled
    # a CP group's ranks hold the same samples: means unchanged
    flat = np.concatenate([r.flatten() for r in rewards])
    each = np.concatenate(each)
    every = [r for group in replies for r in group]
    lengths = np.array([len(r) for r in every])
    cut = [c for g, t in zip(replies, trajectories) for c in sampled_tokens(g, t, stop_ids)[1]]
    # the step's sums by name, all-reduced in one collective with the samples' own
    samples = dict(r_sum=flat.sum(), right=(flat >= 1).sum(), n=len(flat),
                   reply_tokens=lengths.sum(), cut=sum(cut),
                   sampled_groups=len(replies) * first_in_cp, unshared=unshared,
                   **trajectory_sums(trajectories))
    step_sums = [sums[name].item() for name in STEP_STATS]
    perf, values = meter.read(train_s, 1, [*step_sums, *samples.values(), *each.sum(0).tolist()])
    totals = dict(zip([*STEP_STATS, *samples], values))
    each_sums = values[len(totals):]
    r_sum, right, n, reply_tokens, cut, sampled_groups, unshared = map(totals.get,
                                                                       list(samples)[:7])
    # turns, observations, tool calls, the environment's time
    multi, multi_line = trajectory_log(totals, n, world_size) if multiturn else ({}, "")
    # as TRL logs them: unweighted
    each_mean = {name: s / n for name, s in zip(reward_fns.names, each_sums)}
    tally[0], tally[1] = tally[0] + trained, tally[1] + sampled_groups
    longest = all_reduce_max(int(lengths.max(initial=0)), device)
    mean = r_sum / n
    eta = (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
    n_tokens = max(totals["target_tokens"], 1)
    # the GRPO family's
    per_token = {name: totals[name] / n_tokens for name in objective_stats}
    metrics = dict(iter=iter_num, loss=totals["loss"], reward_mean=mean,
                   reward_std=reward_std(flat), accuracy=right / n, reply_tokens=reply_tokens / n,
                   reply_tokens_max=longest, truncated=cut / n, groups_trained=trained,
                   groups_sampled=sampled_groups, sampling_rounds=rounds,
                   sampled_nll=totals["sampled_nll"] / n_tokens,
                   sampler_kl=totals["sampler_k3"] / n_tokens,
                   sampler_ratio_max=all_reduce_max(mismatch["max_ratio"], device),
                   ratio_mean=per_token.get("ratio_sum"), clip_low=per_token.get("clipped_low"),
                   clip_high=per_token.get("clipped_high"),
                   distill_loss=per_token.get("distill_loss"),
                   gen_ms=1000 * gen_s, reward_ms=1000 * reward_s, train_ms=1000 * train_s,
                   tokens_unshared=unshared, lr=lr, grad_norm=grad_norm.item(),
                   skipped_steps=run.guard.skipped_steps, **perf, **multi,
                   **{f"rewards/{name}/mean": m for name, m in each_mean.items()})
    capped = "; max_extra_rounds reached" if trained < prompts_per_step else ""
    groups_line = f"groups {trained:.0f}/{sampled_groups:.0f} trained"
    groups_line += f" ({rounds} rounds{capped})" * (rounds > 1)
    if not trained:
        groups_line += ": every group's rewards were equal, nothing learned"
    parts = ", ".join(f"{name} {m:.3f}" for name, m in each_mean.items())
    parts = f" ({parts})" * (len(each_mean) > 1)
    parts += "" if loss != "distill" else f" | distill {metrics['distill_loss']:.4f}"
    parts += multi_line
    print0(f"iter {iter_num}/{max_iters} | loss {totals['loss']:.4f} | reward {mean:.3f}{parts} | "
           f"accuracy {100 * metrics['accuracy']:.1f}% | {groups_line} | reply "
           f"{reply_tokens / n:.1f} tokens (max {longest}, {100 * cut / n:.0f}% cut) | sampler kl "
           f"{metrics['sampler_kl']:.1e} | ms: gen "
           f"{1000 * gen_s:.0f}, reward {1000 * reward_s:.0f}, train {1000 * train_s:.0f} | tokens "
           f"{perf['tokens']:,.0f} (unshared {unshared:,.0f}) | eta {format_eta(eta)}")
    logger.log(metrics)


# ---- the loop: every step is logged
# the starting point, for "before -> after"
results = {} if iter_num else evaluate()
before = resumed_extras.get("before", results)
# positions of the prompt stream used
prompts_drawn = resumed_extras.get("prompts_drawn", iter_num * prompts_per_step)
# groups trained, sampled, since the run began
tally = resumed_extras.get("groups", [0, 0])
timer = Timer(device)
meter = Throughput(raw_model, device, world_size, flops_factor=1.0 if ref is None else 4 / 3)
start_iter, t_start = iter_num, time.perf_counter()
while iter_num < max_iters:
    lr = set_lr(optimizer, lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters))
    t0 = time.perf_counter()
    to_train, sampled, reward_s, prompts_drawn = rollouts.collect(prompts_drawn)
    batches, sampler, objective_input, trained, unshared = training_batches(*to_train)
    gen_s = time.perf_counter() - t0 - reward_s
    meter.count(batches, data_time=0.0)
    mbs = [mb.to(device) for mb in batches]
    states = [dict(sampler=None if s is None else s.to(device)) for s in sampler]
    mismatch = dict(max_ratio=0.0)
    # a stop signal is honoured after the step's last update
    stopping = False
    for _ in range(updates_per_batch):
        # this rank's part, checked finite
        step_loss = torch.zeros((), device=device, dtype=torch.float64)
        # for the log: microbatch_loss's sums by name, this update's
        sums = {name: torch.zeros((), device=device, dtype=torch.float64) for name in STEP_STATS}
        for i, (mb, old) in enumerate(zip(mbs, states)):
            with sync_gradients(model, enabled=i == len(mbs) - 1):
                loss_share, mb_sums = microbatch_loss(mb, objective_input, old)
                loss_share.backward()
            step_loss += loss_share.detach() / world_size
            for name in STEP_STATS:
                sums[name] += mb_sums[name]
        grad_norm = clip_grad_norm(model, grad_clip)
        # finite on every rank? a stop signal?
        update, stop = run.guard.check(model, step_loss, grad_norm, iter_num + 1)
        if update:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stopping |= stop
    iter_num += 1
    train_s = timer.lap() - gen_s - reward_s
    log_step(sums, sampled, trained, unshared, gen_s, reward_s, train_s, grad_norm)
    last = iter_num == max_iters
    extras = dict(before=before, prompts_drawn=prompts_drawn, groups=tally)
    if (eval_interval and iter_num % eval_interval == 0) or last:
        results = evaluate()
        save_checkpoint(run, origin, model, optimizer, iter_num, {}, extra=extras,
                        evaluation=results)
        # evaluation is not the next step's time
        timer.lap()
    # a stop on an evaluation step is saved above, with its evaluation
    elif stopping:
        save_checkpoint(run, origin, model, optimizer, iter_num, {}, extra=extras)
    # on the last step the run ends as usual: export
    if stopping and not last:
        logger.finish()
        run.exit_stopped(iter_num)

print0(f"groups trained: {tally[0]:,.0f} of {tally[1]:,.0f} sampled "
       f"({100 * tally[0] / max(tally[1], 1):.1f}%)")
if not tally[0]:
    print0("warning: no group's rewards ever differed, so this run learned nothing from its "
           "rewards: check the reward function on a few replies, or use prompts this model "
           "sometimes gets right", file=sys.stderr)
if before and results:
    # a trajectory's reward sums its turns': no one exact match
    exact = f"exact-match accuracy {100 * before['val_accuracy']:.1f}% -> " \
        f"{100 * results['val_accuracy']:.1f}% | " * (multiturn is None)
    print0(f"held-out, greedy: {exact}mean reward {before['val_reward']:.3f} -> "
           f"{results['val_reward']:.3f} (before RL -> after)")
logger.finish()
export_hf(run, model, raw_model, tok, start, lora_settings(config))
teardown_distributed()
