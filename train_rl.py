"""
On-policy RL from the model's own replies, read top to bottom like train_sft.py and train_dpo.py: config, setup,
prompts, loop (sample -> reward -> loss -> step), log, save.

    python train_sft.py && python train_dpo.py && python train_rl.py   # built-in: the hard split (CPU ok)
    python train_rl.py --init_from=/models/Qwen2.5-0.5B-Instruct --data=prompts.jsonl --reward=my_rewards:exact
    torchrun --nproc_per_node=8 train_rl.py --init_from=... --data=... --reward=... --loss=online_dpo

Each step samples k replies to each of `prompts_per_step` prompts (all ranks together, each rank its share) with the
KV cache, every prompt prefilled once, scores them with `reward`, and trains on them with each prompt computed once
for its whole group: prompt | reply 1 | ... | reply k, every reply attending to the prompt through the key stream.
loss='grpo': each reply's group-normalised advantage on each of its tokens, over the step's reply tokens, PPO's
clipped ratio when a batch makes more than one update, and kl_coef times a KL estimate to the initial model;
'online_dpo': each group's best and worst reply become a DPO pair (dpo.py's loss), the reference computed on the fly.
Replies are drawn from generators seeded by (seed, step, prompt, reply): a step's samples do not depend on the world
size, and a resumed run draws what the straight run drew.
Data: the built-in task's hard split, or records {"messages": [prompt turns]} or {"prompt": str | [messages]} (JSONL,
Parquet, a folder or a glob, as data/prepare.py reads them); the record's other fields go to the reward function:
reward(prompt messages, reply text, **fields) -> float, named 'module:function' (e.g. a my_rewards.py beside you).
"""

import importlib
import math
import os
import sys
import time
from functools import lru_cache

import numpy as np
import torch

import common
import dpo
import data.arithmetic as builtin_task
from checkpoint import export_hf, save_checkpoint
from configurator import configure, one_line
from data.prepare import DataError, as_messages, data_files, read_records, template_inputs
from generate import generate
from metrics import MetricsLogger, Throughput, Timer, format_eta
from packing import group_data, make_batch, pack, shared_prefixes
from parallel import all_reduce_sum, print0, sync_gradients, teardown_distributed

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value
out_dir = "out/rl"
init_from = "out/dpo/hf"  # the model `python train_dpo.py` leaves; any Hugging Face folder, 'scratch' or 'resume'
preset = "toy"  # the model shape for init_from='scratch', from model.PRESETS
tokenizer = ""  # 'byte', or a folder with tokenizer files; default: init_from's folder if it has them, else 'byte'
chat_template_kwargs = {}  # variables for the model's chat template, e.g. {'enable_thinking': False}
data = "builtin"  # 'builtin' (the arithmetic task's hard split) or prompt records (see above)
val_data = None  # records: held-out prompts for evaluation (builtin: the hard split's val chats)
reward = "builtin"  # 'builtin' (the exact answer: data.arithmetic.reward) or 'module:function' (see above)
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
max_iters = 100  # steps (sample, then updates_per_batch updates)
learning_rate = 2e-4  # the toy model; a pretrained init_from gets fine-tuning values (see configure below)
min_lr = 2e-5
warmup_iters = 5
weight_decay = 0.0
grad_clip = 1.0
# the run's machinery, as in train_sft.py (see there what each key does)
lora_rank, lora_alpha, lora_dropout, quantize_base = 0, None, 0.0, ""
lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
seed, device, dtype, compile, activation_checkpointing, parallel = 1337, "auto", "auto", "auto", False, "ddp"
eval_examples = 200
eval_interval = 10  # evaluate (greedy replies to held-out prompts: reward, accuracy) and checkpoint; 0 = at the end
max_bad_steps, overwrite, dist_timeout = 3, False, 300
wandb_log, wandb_project, wandb_run_name = False, "nanopack", "rl"
# Starting from a pretrained model, keys not set explicitly take these instead (TRL's GRPO default rate)
config = configure(globals(), finetune=dict(learning_rate=1e-6, min_lr=1e-7), kind="rl",
                   choices=dict(loss=("grpo", "online_dpo")))
# -----------------------------------------------------------------------------


def load_reward(spec):
    """'builtin' or 'module:function' -> the function; a bad name is one line."""
    module, _, name = ("data.arithmetic:reward" if spec == "builtin" else spec).partition(":")
    sys.path.append(os.getcwd())  # a my_rewards.py where the run is launched
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        one_line(f"config error: reward={spec!r}: {e}; name a function (prompt, reply, **fields) -> float as "
                 f"'module:function', the module importable from here (e.g. my_rewards.py in this folder)")


reward_fn = load_reward(reward)
run = common.setup(config, "rl")
model, raw_model, optimizer, device, tok = run.model, run.raw_model, run.optimizer, run.device, run.tok
iter_num, max_iters, world_size, rank = run.start_iter, run.max_iters, run.world_size, run.rank
sync_ranks = parallel == "fsdp" and world_size > 1  # FSDP2: every forward of generation is a collective


def read_prompts(source, n):
    """-> [(prompt token ids, prompt messages, reward fields, where)], the first n (None: all)."""
    if source == "builtin":
        split, seed_ = ("val", 0) if n else ("train", 0)
        found = [(p, dict(answer=a), f"builtin:{split}:{i}")
                 for i, (p, a) in enumerate(builtin_task.rl_prompts(split, n or 2000, seed_, hard=True))]
    else:
        found = []
        try:
            for where, record in read_records(data_files(source), verbose=False):
                field = "messages" if "messages" in record else "prompt"
                messages = as_messages(record.get(field), field, "user", where)
                if messages[-1]["role"] != "user":
                    raise DataError(f"{where}: '{field}' ends with a {messages[-1]['role']} turn — a prompt ends "
                                    f"with the user's turn, the reply is the model's")
                found.append((messages, {k: v for k, v in record.items() if k != field}, where))
                if n and len(found) == n:
                    break
        except (ValueError, OSError) as e:
            one_line(f"data error: {e}")
    out = []
    for m, fields, where in found:
        try:  # a bad 'tools' field (DataError names the line), a template that refuses the prompt or leaves part out
            out.append((tok.render_prompt(m, **template_inputs(fields, where)), m, fields, where))
        except ValueError as e:
            one_line(f"data error: {e}" if isinstance(e, DataError) else f"data error: {where}: {e}")
    for ids, _, _, where in out:
        group = len(ids) + k * max_new_tokens if prefix_sharing else k * (len(ids) + max_new_tokens)
        if len(ids) + max_new_tokens > raw_model.config.max_seq_len or group > microbatch_tokens:
            one_line(f"data error: {where}: the prompt has {len(ids)} tokens: with max_new_tokens={max_new_tokens} "
                     f"and k={k} its group needs up to {group} tokens, its replies {len(ids) + max_new_tokens} "
                     f"positions (microbatch_tokens={microbatch_tokens}, max_seq_len="
                     f"{raw_model.config.max_seq_len}); raise microbatch_tokens, or shorten the prompt")
    return out


train_prompts = read_prompts(data, None)
val_prompts = read_prompts(val_data or data, eval_examples) if eval_examples and (val_data or data == "builtin") else []
print0(f"RL: {loss} loss, {len(train_prompts)} train prompts, {prompts_per_step} x {k} replies per step, reward "
       f"{reward}, {len(val_prompts)} held-out prompts")
logger = MetricsLogger(out_dir, wandb_log, wandb_project, wandb_run_name, config,
                       resume_iter=iter_num if init_from == "resume" else None)
ref = dpo.model_reference("adapters_off" if lora_rank else "live", run, seed, parallel) if (
    loss == "online_dpo" or kl_coef) else None


@lru_cache(maxsize=2)
def permutation(epoch):
    return np.random.default_rng((seed, epoch)).permutation(len(train_prompts))


def score(prompts, replies, num_samples):
    """Rewards (len(prompts) * num_samples,) of decoded replies; a reward function that raises or gives a non-number
    stops the run in one line naming it and the prompt."""
    out = []
    for i, reply in enumerate(replies):
        _, messages, fields, where = prompts[i // num_samples]
        text = tok.decode([t for t in reply if t not in tok.stop_ids])
        try:
            value = float(reward_fn(messages, text, **fields))
        except Exception as e:
            raise SystemExit(f"reward {reward} raised {type(e).__name__}: {e} (prompt {where}, reply {text!r}); "
                             f"nothing from this step is trained or saved") from None
        if not math.isfinite(value):
            raise SystemExit(f"reward {reward} returned {value} for prompt {where} (reply {text!r}); a reward must "
                             f"be a finite number; nothing from this step is trained or saved")
        out.append(value)
    return torch.tensor(out, dtype=torch.float64)


def sample(step):
    """This rank's share of step `step`: (prompts, replies: k token lists per prompt, rewards (G, k))."""
    first = step * prompts_per_step
    mine = list(range(first + rank, first + prompts_per_step, world_size))  # global positions in the prompt stream
    prompts = [train_prompts[permutation(i // len(train_prompts))[i % len(train_prompts)]] for i in mine]
    gens = [torch.Generator(device).manual_seed(hash((seed, i, j)) % 2**63) for i in mine for j in range(k)]
    model.eval()
    with run.autocast:
        replies = generate(raw_model, [p[0] for p in prompts], max_new_tokens, tok.stop_ids, temperature,
                           generator=gens, sync_ranks=sync_ranks, num_samples=k, top_p=top_p)
    model.train()
    return prompts, [replies[g * k:(g + 1) * k] for g in range(len(prompts))], score(prompts, replies, k).view(-1, k)


def training_batches(prompts, replies, rewards):
    """-> (micro-batches on the host (the same number on every rank), group size, per-reply advantages or None, the
    global normaliser: reply tokens (grpo) or pairs (online_dpo), groups trained, tokens without sharing). Groups that
    teach nothing (all k rewards equal, and no KL term) are left out."""
    if loss == "grpo":
        keep = [g for g in range(len(prompts)) if kl_coef or rewards[g].std() > 0]
        groups, size = [replies[g] for g in keep], k
        advantages = dpo.group_advantages(rewards)[keep].flatten().float().to(device)
    else:  # online_dpo: the best and the worst reply of each group whose rewards differ
        keep = [g for g in range(len(prompts)) if rewards[g].max() > rewards[g].min()]
        groups = [[replies[g][rewards[g].argmax()], replies[g][rewards[g].argmin()]] for g in keep]
        size, advantages = 2, None
    data = group_data([prompts[g][0] for g in keep], groups)
    prefix = shared_prefixes(data, size) if prefix_sharing else None
    lengths = np.diff(data["offsets"]).reshape(-1, size).sum(1) - (0 if prefix is None else (size - 1) * prefix)
    bins = pack(lengths, microbatch_tokens) if len(keep) else []
    n_micro = torch.tensor(len(bins), device=device)
    if world_size > 1:
        torch.distributed.all_reduce(n_micro, op=torch.distributed.ReduceOp.MAX)
    bins += [[]] * (n_micro.item() - len(bins))  # [] a filler: every rank runs as many forwards
    mbs = [make_batch(data, b, dpo=True, prefix=prefix, group_size=size) for b in bins]
    count = sum(mb.num_target_tokens for mb in mbs) if loss == "grpo" else len(keep)
    normaliser, trained = all_reduce_sum([count, len(keep)], device)
    return mbs, size, advantages, normaliser, trained, int(np.diff(data["offsets"]).sum())


def microbatch_loss(mb, size, advantages, normaliser, old):
    """This micro-batch's share of the step loss (times world_size: DDP and FSDP average gradients over ranks).
    old: per micro-batch state kept over a batch's updates (the sampling policy's and the reference's log-probs)."""
    with run.autocast:
        logps = model(**mb.inputs(), logprobs=True)  # (K,) one per trained token
    if "ref" not in old:
        old["ref"] = ref.logps(mb) if ref is not None else None
        old["policy"] = logps.detach()
    if loss == "grpo":
        seqs = (mb.units[:, None] * size + torch.arange(size, device=device)).flatten()  # the batch's replies
        losses = dpo.policy_loss(logps, old["policy"], advantages[seqs][mb.seq_ids], clip_eps, old["ref"], kl_coef)
    else:
        pc, pr = mb.pair_sums(logps)
        rc, rr = mb.pair_sums(old["ref"])
        losses, _, _ = dpo.dpo_loss(pc, pr, rc, rr, None, None, "sigmoid", beta)
    return losses.sum() * world_size / normaliser


@torch.no_grad()
def evaluate():
    """Greedy replies to the held-out prompts, split over ranks: mean reward and accuracy (replies rewarded 1 or
    more: the built-in task's exact answers); printed and logged."""
    if not val_prompts:
        return {}
    mine = val_prompts[rank::world_size]
    model.eval()
    with run.autocast:
        replies = generate(raw_model, [p[0] for p in mine], max_new_tokens, tok.stop_ids, sync_ranks=sync_ranks)
    model.train()
    rewards = score(mine, replies, 1)
    total, right, n = all_reduce_sum([rewards.sum().item(), (rewards >= 1).sum().item(), len(mine)], device)
    out = dict(val_reward=total / n, val_accuracy=right / n)
    print0(f"iter {iter_num}: held-out, greedy: mean reward {out['val_reward']:.3f} | accuracy "
           f"{100 * out['val_accuracy']:.1f}%")
    logger.log(dict(iter=iter_num, **out))
    return out


# ---- the loop: every step is logged (it takes seconds)
results = {} if iter_num else evaluate()  # the starting point, for "before -> after"
before = run.saved.get("before", results)
timer = Timer(device)
meter = Throughput(raw_model, device, world_size, flops_factor=1.0 if ref is None else 4 / 3)
start_iter, t_start = iter_num, time.perf_counter()
while iter_num < max_iters:
    lr = common.set_lr(optimizer, common.lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters))
    t0 = time.perf_counter()
    prompts, replies, rewards = sample(iter_num)
    batches, size, advantages, normaliser, trained, unshared = training_batches(prompts, replies, rewards)
    gen_s = time.perf_counter() - t0
    meter.count(batches, data_time=0.0)
    mbs, states = [mb.to(device) for mb in batches], [{} for _ in batches]
    stopping = False  # a stop signal is honoured after the step's last update
    for _ in range(updates_per_batch):
        step_loss = torch.zeros((), device=device, dtype=torch.float64)
        for i, (mb, old) in enumerate(zip(mbs, states)):
            with sync_gradients(model, enabled=i == len(mbs) - 1):
                mb_loss = microbatch_loss(mb, size, advantages, normaliser, old)
                mb_loss.backward()
            step_loss += mb_loss.detach() / world_size
        grad_norm, updated, stop = run.optimizer_step(step_loss, grad_clip, iter_num + 1)
        stopping |= stop
    iter_num += 1
    train_s = timer.lap() - gen_s

    flat = rewards.flatten()
    perf, (loss_sum, r_sum, r2_sum, right, n, reply_tokens, unshared) = meter.read(train_s, 1, [
        step_loss.item(), flat.sum().item(), (flat ** 2).sum().item(), (flat >= 1).sum().item(), len(flat),
        sum(len(r) for group in replies for r in group), unshared])
    mean, eta = r_sum / n, (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
    metrics = dict(iter=iter_num, loss=loss_sum, reward_mean=mean, reward_std=math.sqrt(max(r2_sum / n - mean ** 2, 0)),
                   accuracy=right / n, reply_tokens=reply_tokens / n, groups_trained=trained, gen_ms=1000 * gen_s,
                   train_ms=1000 * train_s, tokens_unshared=unshared, lr=lr, grad_norm=grad_norm,
                   skipped_steps=run.skipped_steps, **perf)
    print0(f"iter {iter_num}/{max_iters} | loss {loss_sum:.4f} | reward {mean:.3f} | accuracy "
           f"{100 * metrics['accuracy']:.1f}% | groups {trained:.0f} | gen {1000 * gen_s:.0f} ms | train "
           f"{1000 * train_s:.0f} ms | tokens {perf['tokens']:,.0f} (unshared {unshared:,.0f}) | eta {format_eta(eta)}")
    logger.log(metrics)
    last = iter_num == max_iters
    if stopping and not last:  # on the last step the run ends as usual: evaluation, checkpoint, export
        save_checkpoint(run, iter_num, {}, config, extra=dict(before=before))
        logger.finish()
        run.exit_stopped(iter_num)
    if (eval_interval and iter_num % eval_interval == 0) or last:
        results = evaluate()
        save_checkpoint(run, iter_num, {}, config, extra=dict(before=before), evaluation=results)
        timer.lap()  # evaluation is not the next step's time

if before and results:
    print0(f"held-out, greedy: exact-match accuracy {100 * before['val_accuracy']:.1f}% -> "
           f"{100 * results['val_accuracy']:.1f}% | mean reward {before['val_reward']:.3f} -> "
           f"{results['val_reward']:.3f} (before RL -> after)")
logger.finish()
export_hf(run)
teardown_distributed()
