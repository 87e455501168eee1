"""
On-policy RL from the model's own replies, read top to bottom like train_sft.py and train_dpo.py: config, setup,
prompts, loop (sample -> reward -> loss -> step), log, save.

    python train_sft.py && python train_dpo.py && python train_rl.py   # built-in: the hard split (CPU ok)
    python train_rl.py --init_from=/models/Qwen2.5-0.5B-Instruct --data=prompts.jsonl --reward=my_rewards:exact
    torchrun --nproc_per_node=8 train_rl.py --init_from=... --data=... --reward=... --loss=online_dpo

Each step samples k replies to each of `prompts_per_step` prompts (all ranks together) with the KV cache, every
prompt prefilled once, scores them with `reward`, and trains on them with each prompt computed once for its group:
prompt | reply 1 | ... | reply k. loss='grpo': each reply's group-normalised advantage on each of its tokens, over the
step's reply tokens, PPO's clipped ratio when a batch makes more than one update, and kl_coef x a KL estimate to the
initial model; 'online_dpo': each group's best and worst reply become a DPO pair, the reference computed on the fly.
Replies are drawn from generators seeded by (seed, step, prompt, reply): a step's samples depend neither on the world
size nor on a resume. Data: the built-in task's hard split, or records {"messages": [prompt turns]} or {"prompt": str
| [messages]} (read as data/prepare.py reads them); the record's other fields go to the reward functions (rewards.py),
named 'module:function': reward(prompt messages, reply text, **fields) -> float (e.g. in a my_rewards.py beside you).
"""

import math
import time
from functools import lru_cache

import numpy as np
import torch

import common
from checkpoint import export_hf, save_checkpoint
from configurator import configure
from data.dataset import read_prompts
from generate import generate
from losses import dpo_loss, group_advantages, policy_loss
from metrics import MetricsLogger, Throughput, Timer, format_eta
from packing import group_data, make_batch, rank_bins, shared_prefixes, unit_lengths
from parallel import all_reduce_sum, fail, print0, sync_gradients, teardown_distributed
from reference import Reference
from rewards import RewardError, Rewards

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value
out_dir = "out/rl"
init_from = "out/dpo/hf"  # what `python train_dpo.py` leaves; any Hugging Face folder or hub name, 'scratch', 'resume'
preset = "toy"  # the model shape for init_from='scratch', from model.PRESETS
tokenizer = ""  # 'byte', or a folder with tokenizer files; default: init_from's folder if it has them, else 'byte'
chat_template_kwargs = {}  # variables for the model's chat template, e.g. {'enable_thinking': False}
data = "builtin"  # 'builtin' (the arithmetic task's hard split) or records {"prompt" or "messages", reward fields}
data_split = None  # records: the split of a folder holding several (e.g. 'train'), by file-name prefix
val_data = None  # records: held-out prompts for evaluation (builtin: the hard split's val chats)
val_split = None  # records: the split of a val_data folder holding several (e.g. 'test')
reward = "builtin"  # 'builtin' (exact answer), 'math' (math-verify) or 'module:function' (see rewards.py); 'a,b': both
reward_weights = None  # one per reward, e.g. 1,0.5: the total reward is their weighted sum; default: 1 each
k = 8  # replies sampled per prompt (a group)
prompts_per_step = 32  # prompts per step, all ranks together
temperature = 1.0
top_p = 1.0
max_new_tokens = 20  # a reply that has not stopped by then is cut here (and trained as it is)
loss = "grpo"  # 'grpo' or 'online_dpo'
beta = 0.1  # online_dpo: DPO's inverse temperature
kl_coef = 0.0  # grpo: weight of the KL estimate to the initial model (0: no reference model at all)
clip_eps = 0.2  # grpo: PPO's ratio clipping, active from a batch's second update on
updates_per_batch = 1  # optimizer steps taken on each step's samples
prefix_sharing = True  # each prompt computed once for its group, not k times: same numbers
microbatch_tokens = 4096  # token budget of one forward pass on one rank (whole groups)
context_parallel = 1  # ranks splitting each training micro-batch's tokens (generation runs without: see sample())
max_iters = 100  # steps (sample, then updates_per_batch updates)
learning_rate = 2e-4  # the toy model; a pretrained init_from gets fine-tuning values (see configure below)
min_lr = 2e-5
warmup_iters = 5
weight_decay = 0.0
grad_clip = 1.0
# the run's machinery, as in train_sft.py (see there what each key does)
lora_rank = 0
lora_alpha = None
lora_dropout = 0.0
lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
quantize_base = ""
seed = 1337
device = "auto"
dtype = "auto"
compile = "auto"
activation_checkpointing = False
parallel = "ddp"
eval_examples = 200
eval_interval = 10  # evaluate (greedy replies to held-out prompts: reward, accuracy) and checkpoint; 0 = at the end
max_bad_steps = 3
overwrite = False
dist_timeout = 300
wandb_log = False
wandb_project = "nanopack"
wandb_run_name = "rl"
# Starting from a pretrained model, keys not set explicitly take these instead (TRL's GRPO default rate)
config = configure(globals(), finetune=dict(learning_rate=1e-6, min_lr=1e-7), rules=dict(
    common.RULES, loss=("grpo", "online_dpo"), k="[2, inf)", prompts_per_step="[1, inf)", temperature="(0, inf)",
    top_p="(0, 1]", max_new_tokens="[1, inf)", beta="(0, inf)", kl_coef="[0, inf)", clip_eps="(0, inf)",
    updates_per_batch="[1, inf)", max_iters="[1, inf)"))
# -----------------------------------------------------------------------------


try:
    reward_fns = Rewards(reward, reward_weights)
except RewardError as e:
    fail(f"config error: {e}")
run = common.setup(config, "rl")
model, raw_model, optimizer, device, tok = run.model, run.raw_model, run.optimizer, run.device, run.tok
iter_num, max_iters, world_size, rank = run.start_iter, run.max_iters, run.world_size, run.rank
sync_ranks = parallel == "fsdp" and world_size > 1  # FSDP2: every forward of generation is a collective
first_of_group = run.cp.rank == 0  # what a CP group's ranks hold alike (its groups, pairs) is counted by this one


def fits(ids, where):
    """A prompt's group must fit one micro-batch and its replies the model's positions, whatever they sample."""
    group = len(ids) + k * max_new_tokens if prefix_sharing else k * (len(ids) + max_new_tokens)
    too_many = group > microbatch_tokens * context_parallel  # else too many positions
    if len(ids) + max_new_tokens > raw_model.config.max_seq_len or too_many:
        fail(f"data error: {where}: the prompt has {len(ids)} tokens: with max_new_tokens={max_new_tokens} and k={k} "
             f"its group needs up to {group} tokens, its replies {len(ids) + max_new_tokens} positions "
             f"(microbatch_tokens={microbatch_tokens}, max_seq_len={raw_model.config.max_seq_len}); " + (
                 f"raise microbatch_tokens, split it over GPUs with --context_parallel={-(-group // microbatch_tokens)}"
                 f" (torchrun), " if too_many else "") + "lower max_new_tokens or shorten the prompt")


try:
    train_prompts = read_prompts(data, None, tok, fits, data_split, "data_split")
    has_val = eval_examples and (val_data or data == "builtin")
    val_prompts = read_prompts(val_data or data, eval_examples, tok, fits, val_split, "val_split") if has_val else []
    for _, _, fields, where in train_prompts + val_prompts:
        reward_fns.check_fields(fields, where)
except RewardError as e:
    fail(f"data error: {e}")
except SystemExit as e:
    fail(e.code)
print0(f"RL: {loss} loss, {len(train_prompts)} train prompts, {prompts_per_step} x {k} replies per step, reward "
       f"{reward_fns}, {len(val_prompts)} held-out prompts")
logger = MetricsLogger(out_dir, wandb_log, wandb_project, wandb_run_name, config,
                       resume_iter=iter_num if init_from == "resume" else None)
ref = Reference.of_model("adapters_off" if lora_rank else "live", run) if loss == "online_dpo" or kl_coef else None


@lru_cache(maxsize=2)
def permutation(epoch):
    return np.random.default_rng((seed, epoch)).permutation(len(train_prompts))


def score(prompts, replies, num_samples):
    """-> (total rewards (N,), each reward function's own (N, F)) of the N = len(prompts) * num_samples decoded replies;
    a failing reward function stops the run in one line."""
    each = np.zeros((len(replies), len(reward_fns.names)))  # host values: plan.py's fake tensors would hide them
    for i, reply in enumerate(replies):
        _, messages, fields, where = prompts[i // num_samples]
        try:
            each[i] = reward_fns(messages, tok.decode_reply(reply), fields, where)
        except RewardError as e:
            raise SystemExit(f"{e}; nothing from this step is trained or saved") from None
    return each @ reward_fns.weights, each


def sample(step):
    """This rank's share of step `step` -> (prompts, k token lists per prompt, rewards (G, k), each reward function's
    (G * k, F), seconds in `reward`)."""
    first = step * prompts_per_step
    mine = list(range(first + run.cp.data_rank, first + prompts_per_step, run.cp.data_size))  # positions in the stream
    prompts = [train_prompts[permutation(i // len(train_prompts))[i % len(train_prompts)]] for i in mine]
    gens = [torch.Generator(device).manual_seed(hash((seed, i, j)) % 2**63) for i in mine for j in range(k)]
    model.eval()
    with run.autocast:
        replies = generate(raw_model, [p[0] for p in prompts], max_new_tokens, tok.stop_ids, temperature,
                           generator=gens, sync_ranks=sync_ranks, num_samples=k, top_p=top_p)
    model.train()
    t0 = time.perf_counter()
    scored = score(prompts, replies, k) if first_of_group else None
    # generation without CP: a CP group's ranks draw the same replies (same prompts, generators and weights); its first
    # rank's replies and rewards are the group's, so that a nondeterministic kernel or reward cannot set them apart
    replies, (rewards, each) = run.cp.broadcast((replies, scored))
    return (prompts, [replies[g * k:(g + 1) * k] for g in range(len(prompts))], rewards.reshape(-1, k), each,
            time.perf_counter() - t0)


def training_batches(prompts, replies, rewards):
    """-> (host micro-batches, as many on every rank, group size, per-reply advantages or None, the global normaliser:
    reply tokens (grpo) or pairs, groups trained, tokens unshared). Groups that teach nothing (all k rewards equal, and
    no KL term) are left out."""
    keep = [g for g in range(len(prompts)) if (loss == "grpo" and kl_coef) or rewards[g].max() > rewards[g].min()]
    if loss == "grpo":
        groups, size = [replies[g] for g in keep], k
        advantages = group_advantages(torch.from_numpy(rewards))[keep].flatten().float().to(device)
    else:  # online_dpo: the best and the worst reply of each group
        groups = [[replies[g][rewards[g].argmax()], replies[g][rewards[g].argmin()]] for g in keep]
        size, advantages = 2, None
    data = group_data([prompts[g][0] for g in keep], groups)
    prefix = shared_prefixes(data, size) if prefix_sharing else None
    bins = rank_bins(np.arange(len(keep)), unit_lengths(data, size, prefix), microbatch_tokens * context_parallel)
    n_forwards = torch.tensor(len(bins), device=device)
    if world_size > 1:  # each rank's groups are its own: the busiest rank's count, found by one collective
        torch.distributed.all_reduce(n_forwards, op=torch.distributed.ReduceOp.MAX)
    mbs = [run.cp.split(make_batch(data, b, size, prefix)) for b in bins + [[]] * (n_forwards.item() - len(bins))]
    count = sum(mb.num_target_tokens for mb in mbs) if loss == "grpo" else len(keep) * first_of_group
    normaliser, trained = all_reduce_sum([count, len(keep) * first_of_group], device)
    return mbs, size, advantages, normaliser, trained, int(np.diff(data["offsets"]).sum()) * first_of_group


def microbatch_loss(mb, size, advantages, normaliser, old):
    """This micro-batch's share of the step loss (times world_size: DDP and FSDP average gradients over ranks). old: its
    state kept over a batch's updates (the sampling policy's and the reference's log-probs)."""
    with run.autocast:
        logps = model(**mb.inputs(), logprobs=True)  # (K,) one per trained token
    if "ref" not in old:
        old["ref"] = ref.logps(mb) if ref is not None else None
        old["policy"] = logps.detach()
    if loss == "grpo":
        seqs = (mb.units[:, None] * size + torch.arange(size, device=device)).flatten()  # the batch's replies
        losses = policy_loss(logps, old["policy"], advantages[seqs][mb.seq_ids], clip_eps, old["ref"], kl_coef)
    else:
        pc, pr = mb.pair_sums(logps)
        rc, rr = mb.pair_sums(old["ref"])
        losses, _, _ = dpo_loss(pc, pr, rc, rr, None, None, "sigmoid", beta)
    return losses.sum() * world_size / normaliser


@torch.no_grad()
def evaluate():
    """Greedy replies to the held-out prompts, split over ranks: mean reward and accuracy (the share rewarded 1 or
    more: the built-in task's exact answers); printed and logged."""
    if not val_prompts:
        return {}
    mine = val_prompts[rank::world_size]
    model.eval()
    with run.autocast:
        replies = generate(raw_model, [p[0] for p in mine], max_new_tokens, tok.stop_ids, sync_ranks=sync_ranks)
    model.train()
    rewards, _ = score(mine, replies, 1)
    total, right, n = all_reduce_sum([rewards.sum().item(), (rewards >= 1).sum().item(), len(mine)], device)
    out = dict(val_reward=total / n, val_accuracy=right / n)
    print0(f"iter {iter_num}: held-out, greedy: mean reward {out['val_reward']:.3f} | accuracy "
           f"{100 * out['val_accuracy']:.1f}%")
    logger.log(dict(iter=iter_num, **out))
    return out


def log_step(step_loss, rewards, each, replies, trained, unshared, gen_s, reward_s, train_s, grad_norm):
    """Every step's log line (a step takes seconds): its loss, the rewards of its samples on all ranks, its speed."""
    flat = rewards.flatten()  # a CP group's ranks hold the same samples: means over them are unchanged
    alone = first_of_group or loss == "grpo"  # online_dpo's pair losses are alike on a CP group (GRPO's: per token)
    perf, (loss_sum, r_sum, r2_sum, right, n, reply_tokens, unshared, *each_sums) = meter.read(train_s, 1, [
        step_loss.item() * alone, flat.sum().item(), (flat ** 2).sum().item(), (flat >= 1).sum().item(), len(flat),
        sum(len(r) for group in replies for r in group), unshared, *each.sum(0).tolist()])
    each_mean = {name: s / n for name, s in zip(reward_fns.names, each_sums)}  # as TRL logs them: unweighted
    mean, eta = r_sum / n, (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
    metrics = dict(iter=iter_num, loss=loss_sum, reward_mean=mean, reward_std=math.sqrt(max(r2_sum / n - mean ** 2, 0)),
                   accuracy=right / n, reply_tokens=reply_tokens / n, groups_trained=trained, gen_ms=1000 * gen_s,
                   reward_ms=1000 * reward_s, train_ms=1000 * train_s, tokens_unshared=unshared, lr=lr,
                   grad_norm=grad_norm.item(), skipped_steps=run.guard.skipped_steps, **perf,
                   **{f"rewards/{name}/mean": m for name, m in each_mean.items()})
    parts = f" ({', '.join(f'{name} {m:.3f}' for name, m in each_mean.items())})" * (len(each_mean) > 1)
    print0(f"iter {iter_num}/{max_iters} | loss {loss_sum:.4f} | reward {mean:.3f}{parts} | accuracy "
           f"{100 * metrics['accuracy']:.1f}% | groups {trained:.0f} | ms: gen {1000 * gen_s:.0f}, reward "
           f"{1000 * reward_s:.0f}, train {1000 * train_s:.0f} | tokens {perf['tokens']:,.0f} (unshared "
           f"{unshared:,.0f}) | eta {format_eta(eta)}")
    logger.log(metrics)


# ---- the loop: every step is logged
results = {} if iter_num else evaluate()  # the starting point, for "before -> after"
before = run.saved.get("before", results)
timer = Timer(device)
meter = Throughput(raw_model, device, world_size, flops_factor=1.0 if ref is None else 4 / 3)
start_iter, t_start = iter_num, time.perf_counter()
while iter_num < max_iters:
    lr = common.set_lr(optimizer, common.lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters))
    t0 = time.perf_counter()
    prompts, replies, rewards, each_reward, reward_s = sample(iter_num)
    batches, size, advantages, normaliser, trained, unshared = training_batches(prompts, replies, rewards)
    gen_s = time.perf_counter() - t0 - reward_s
    meter.count(batches, data_time=0.0)
    mbs, states = [mb.to(device) for mb in batches], [{} for _ in batches]
    stopping = False  # a stop signal is honoured after the step's last update
    for _ in range(updates_per_batch):
        step_loss = torch.zeros((), device=device, dtype=torch.float64)
        for i, (mb, old) in enumerate(zip(mbs, states)):
            with sync_gradients(model, enabled=i == len(mbs) - 1):
                mb_loss = microbatch_loss(mb, size, advantages, normaliser, old)  # `loss` is the config key
                mb_loss.backward()
            step_loss += mb_loss.detach() / world_size  # this rank's part of the step's loss
        grad_norm = common.clip_grad_norm(model, grad_clip)
        update, stop = run.guard.check(step_loss, grad_norm, iter_num + 1)  # finite on every rank? a stop signal?
        if update:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stopping |= stop
    iter_num += 1
    train_s = timer.lap() - gen_s - reward_s
    log_step(step_loss, rewards, each_reward, replies, trained, unshared, gen_s, reward_s, train_s, grad_norm)
    last = iter_num == max_iters
    if (eval_interval and iter_num % eval_interval == 0) or last:
        results = evaluate()
        save_checkpoint(run, iter_num, {}, config, extra=dict(before=before), evaluation=results)
        timer.lap()  # evaluation is not the next step's time
    elif stopping:  # a stop on an evaluation step is saved above, with its evaluation
        save_checkpoint(run, iter_num, {}, config, extra=dict(before=before))
    if stopping and not last:  # on the last step the run ends as usual: export
        logger.finish()
        run.exit_stopped(iter_num)

if before and results:
    print0(f"held-out, greedy: exact-match accuracy {100 * before['val_accuracy']:.1f}% -> "
           f"{100 * results['val_accuracy']:.1f}% | mean reward {before['val_reward']:.3f} -> "
           f"{results['val_reward']:.3f} (before RL -> after)")
logger.finish()
export_hf(run)
teardown_distributed()
