"""
Padding-free supervised fine-tuning, read top to bottom: config, setup, loop, log, save.

    python train_sft.py                     # toy model, built-in arithmetic chats, CPU ok
    python train_sft.py config/sft_qwen2.5_0.5b.py --data=my.jsonl
    torchrun --nproc_per_node=8 train_sft.py config/sft_llama3.1_8b_fsdp.py

Every optimizer step takes `batch_size` examples (global, whatever the world size), packs each
rank's share into micro-batches of at most `microbatch_tokens` tokens, and divides the summed token
loss by the step's global number of target tokens: any micro-batch size and any number of GPUs give
the same step.
"""

import time

import numpy as np
import torch

import data.arithmetic as builtin_task
from nanopack.checkpoint import export_hf, save_checkpoint
from nanopack import keys
from nanopack.configurator import configure
from nanopack.metrics import MetricsLogger, Throughput, Timer, format_eta
from packing import IGNORE_INDEX, PackedLoader, layout, rank_microbatches
from nanopack.parallel import all_reduce_sum, print0, sync_gradients, teardown_distributed
from nanopack.run import clip_grad_norm, lr_at, set_lr, start_run
from nanopack.teacher import load_teacher
from nanopack.startup import (data_summary, initial_weights, load_model, load_splits,
                              load_tokenizer, lora_settings, param_groups, restore)

# -----------------------------------------------------------------------------
# config: every global below can be set by a config/*.py file or --key=value, and so can the
# machinery's keys (device, precision, parallelism, LoRA, reading records, wandb): nanopack/keys.py
out_dir = "out/sft"
# 'scratch' (a `preset`), a Hugging Face folder or hub name (org/name[@revision]), or 'resume'
init_from = "scratch"
# 'builtin' (arithmetic chats), records (.jsonl, .parquet, shards, glob, hub name), a prepared dir
data = "builtin"
# records: the val split (e.g. 'data/test_prefs-*.parquet'); default: hold out val_fraction
val_data = None
max_len = 4096  # records only: longest example kept; longer ones follow `overlong`
overlong = "error"  # records only: 'error', 'truncate' or 'skip' (counted and printed)
# records: 'each' also trains every turn rendered without its reasoning on its own
reasoning_turns = "conversation"
prefix_sharing = True  # reasoning_turns='each': a conversation's shared history computed once
batch_size = 32  # examples per optimizer step, all ranks together ('each': conversations)
microbatch_tokens = 4096  # token budget of one forward pass on one rank
max_iters = 1100  # optimizer steps; 0 = `epochs` passes over the data
epochs = 1.0
# the toy model from scratch; a pretrained init_from gets fine-tuning values (configure below)
learning_rate = 5e-3
min_lr = 5e-4
warmup_iters = 20
weight_decay = 0.1
grad_clip = 1.0
# 'token': every target token counts the same; 'sequence': every example does
loss_weighting = "token"
log_interval = 10
# evaluate (val loss; built-in: exact-match accuracy, style) and checkpoint; 0 = at the end
eval_interval = 275
eval_examples = 200  # built-in task: held-out prompts answered greedily for accuracy
val_fraction = 0.01  # records only: the share of lines held out for val loss
wandb_run_name = "sft"
# logit distillation (docs/distill.md): a Hugging Face folder or hub name, the student's vocabulary
teacher = None
distill_beta = 0.5  # generalized JSD: 0 KL(teacher || student), 1 KL(student || teacher), between
distill_temperature = 1.0  # both models' logits are divided by it in the JSD (not in the NLL)
distill_weight = 0.5  # each trained token's loss: (1 - distill_weight) NLL + distill_weight JSD
# a pretrained init_from (its own tokenizer) gets these for keys not set: AdamW at ~1e-5-2e-5,
# cosine decay, as the published SFT recipes for 0.1-8B models (Tulu 3, Zephyr, SmolLM2)
config = configure(globals(), machinery=keys,
                   rules=dict(keys.RULES, reasoning_turns=("conversation", "each"),
                              distill_beta="[0, 1]", distill_temperature="(0, inf)",
                              distill_weight="[0, 1]"),
                   read_by={key: ("teacher", None, "only logit distillation reads it")
                            for key in ("distill_beta", "distill_temperature", "distill_weight")},
                   finetune=dict(learning_rate=2e-5, min_lr=2e-6, warmup_iters=20,
                                 weight_decay=0.0, max_iters=0, epochs=2.0))
# -----------------------------------------------------------------------------

# ranks, device, precision, out_dir lock, signals, seed; on resume, its ckpt.pt
run = start_run(config, __file__, data_kind="sft")
tok = load_tokenizer(config, run.resumed)
# scratch | HF folder | the resumed run's
start, model_config = initial_weights(config, tok, run.resumed)
# tokenized once, every example checked against the model and a micro-batch
data_dir, train_data, val_data = load_splits(config, run, tok, model_config, "sft")
# LoRA; DDP/FSDP2; compile
model, raw_model = load_model(config, run, model_config, start)
# frozen, beside the student, sharded like it
teacher_model = load_teacher(run, teacher, model_config) if teacher else None
device, world_size = run.device, run.world_size
optimizer = torch.optim.AdamW(param_groups(raw_model, weight_decay), lr=learning_rate,
                              betas=(0.9, 0.95), fused=device.type == "cuda")
loader = PackedLoader(train_data, batch_size, microbatch_tokens * run.cp.size,
                      rank=run.cp.data_rank, world_size=run.cp.data_size, seed=config["seed"],
                      prefix_sharing=prefix_sharing, context=run.cp)
max_iters = max_iters or max(1, round(epochs * len(loader)))
# resume: weights, optimizer state, RNG, loader position
iter_num, _ = restore(run, model, optimizer, loader)
run.begin(raw_model, iter_num, max_iters, data_summary(config, loader, train_data, data_dir,
                                                       model_config.max_seq_len))
# what ckpt.pt records besides the weights: a resumed run starts from it
origin = dict(tokenizer=tok.name, data_dir=data_dir, start=start, model_config=model_config)
logger = MetricsLogger(out_dir, config["wandb_log"], config["wandb_project"], wandb_run_name,
                       config, resume_iter=iter_num if init_from == "resume" else None)


def microbatch_loss(mb, normaliser):
    """-> (its share of the step loss, to backpropagate; its summed token loss, for the log; its
    summed JSD to the teacher, 0 without one).
    The share is the summed (weighted) token loss / the step's global normaliser, times world_size:
    DDP and FSDP average gradients over ranks and we want their sum."""
    weights = None
    # 'sequence': each example counts once, its target tokens share weight 1
    if loss_weighting == "sequence":
        per_seq = mb.sequence_sums((mb.targets != IGNORE_INDEX).float()).clamp(min=1.0)
        # + 1: a filler's slot
        weights = 1.0 / torch.cat([per_seq, per_seq.new_ones(1)])[mb.seq_ids]
    with run.autocast:
        if teacher_model is None:
            loss_sum, jsd_sum = model(**mb.inputs(), loss_weights=weights)[0], 0.0
        else:
            head = teacher_model.distill_head(mb, distill_beta, distill_temperature,
                                              distill_weight, weights)
            loss_sum, (_, jsd_sum) = model(**mb.inputs(), head=head)
    return loss_sum * world_size / normaliser, loss_sum.detach(), jsd_sum


@torch.no_grad()
def evaluate():
    """Val loss per target token over the whole val split, and exact-match accuracy on the built-in
    task; printed and logged. Every rank runs the same number of forwards (FSDP's all-gathers are
    collectives)."""
    model.eval()
    out = {}
    val, prefix, lengths, _ = val_layout  # as training lays out its split
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    n_targets = 0
    budget = microbatch_tokens * config["context_parallel"]
    for mb in rank_microbatches(val, np.arange(len(lengths)), lengths, budget, 1, prefix,
                                run.cp.data_rank, run.cp.data_size, run.cp):
        n_targets += mb.num_target_tokens
        mb = mb.to(device)
        with run.autocast:
            loss_sum += model(**mb.inputs())[0]
    # an empty val split has no loss (setup said so), rather than a loss of 0
    if len(lengths):
        total_loss, total_targets = all_reduce_sum([loss_sum.item(), n_targets], device)
        out["val_loss"] = total_loss / max(total_targets, 1)
    # greedy replies: exact match, and the share in the plain style
    if data == "builtin" and eval_examples > 0:
        sync_ranks = config["parallel"] == "fsdp" and world_size > 1
        out.update(builtin_task.evaluate(raw_model, tok, eval_examples, run.autocast,
                                         sync_ranks=sync_ranks))
    model.train()
    parts = [f"val loss {out['val_loss']:.4f}"] if "val_loss" in out else []
    parts += [f"val accuracy {100 * out['val_accuracy']:.1f}% | "
              f"plain style {100 * out['val_preferred']:.1f}%"] if "val_accuracy" in out else []
    if parts:
        print0(f"iter {iter_num}: " + " | ".join(parts))
        logger.log(dict(iter=iter_num, **out))
    return out


# ---- the loop
val_layout = layout(val_data, microbatch_tokens * config["context_parallel"], 1, prefix_sharing)
# reasoning_turns='each': what computing each conversation's history once saves
if loader.prefix is not None:
    print0(f"prefix sharing: {int(loader.whole.sum()):,} tokens laid out whole -> "
           f"{int(loader.lengths.sum()):,} computed "
           f"({loader.whole.sum() / loader.lengths.sum():.2f}x fewer)")
timer = Timer(device)
# tokens, padding, FLOPs since the last log line
meter = Throughput(raw_model, device, world_size)
# summed (weighted) token loss and JSD to the teacher since the last log line
loss_acc, jsd_acc = (torch.zeros((), device=device, dtype=torch.float64) for _ in range(2))
# loss_acc's divisor: target tokens, or examples with loss_weighting='sequence'
normaliser_window = 0
# the window's tokens laid out whole (prefix sharing computes fewer)
unshared_window = 0
# evaluation inside a log window is not training time
eval_seconds = 0.0
start_iter, last_log_iter, t_start = iter_num, iter_num, time.perf_counter()
while iter_num < max_iters:
    lr = set_lr(optimizer, lr_at(iter_num, max_iters, learning_rate, min_lr, warmup_iters))
    t0 = time.perf_counter()
    step = next(loader)
    normaliser = step.num_examples if loss_weighting == "sequence" else step.num_target_tokens
    mbs = [mb.to(device) for mb in step.microbatches]
    meter.count(step.microbatches, data_time=time.perf_counter() - t0)
    unshared_window += step.num_tokens_unshared
    step_loss, step_loss_sum, step_jsd = (torch.zeros((), device=device, dtype=torch.float64)
                                          for _ in range(3))
    for i, mb in enumerate(mbs):
        with sync_gradients(model, enabled=i == len(mbs) - 1):
            loss, loss_sum, jsd_sum = microbatch_loss(mb, normaliser)
            loss.backward()
        # this rank's part of the step's loss
        step_loss += loss.detach() / world_size
        step_loss_sum += loss_sum
        step_jsd += jsd_sum
    grad_norm = clip_grad_norm(model, grad_clip)
    # finite on every rank? a stop signal?
    update, stopping = run.guard.check(model, step_loss, grad_norm, iter_num + 1)
    # a skipped step (NaN or infinite loss) counts in skipped_steps, not in the average
    if update:
        optimizer.step()
        loss_acc += step_loss_sum
        jsd_acc += step_jsd
        normaliser_window += normaliser
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1

    last = iter_num == max_iters
    # a stop logs its partial window: no step goes unlogged
    if iter_num % log_interval == 0 or last or stopping:
        elapsed, eval_seconds = timer.lap() - eval_seconds, 0.0
        # summed over ranks: normaliser_window is already global
        perf, (loss_total, jsd_total) = meter.read(elapsed, iter_num - last_log_iter,
                                                   [loss_acc.item(), jsd_acc.item()])
        eta = (time.perf_counter() - t_start) / (iter_num - start_iter) * (max_iters - iter_num)
        loss, jsd = (x / normaliser_window if normaliser_window else float("nan")
                     for x in (loss_total, jsd_total))
        # the mean JSD per trained token (per example's token share with loss_weighting='sequence')
        distill = dict(distill_loss=jsd) if teacher else {}
        metrics = dict(iter=iter_num, loss=loss, lr=lr, **distill,
                       grad_norm=grad_norm.item(), skipped_steps=run.guard.skipped_steps,
                       tokens_unshared=unshared_window / (iter_num - last_log_iter), **perf)
        shared = f" | tokens {perf['tokens']:,.0f} (unshared {metrics['tokens_unshared']:,.0f})" * (
            loader.prefix is not None)
        distill_line = f" | distill {jsd:.4f}" * bool(teacher)
        print0(f"iter {iter_num}/{max_iters} | loss {metrics['loss']:.4f}{distill_line} | "
               f"lr {lr:.2e} | "
               f"grad norm {metrics['grad_norm']:.2f} | {meter.line(metrics)}{shared} | "
               f"eta {format_eta(eta)}")
        logger.log(metrics)
        loss_acc.zero_()
        jsd_acc.zero_()
        last_log_iter, normaliser_window, unshared_window = iter_num, 0, 0
    if (eval_interval and iter_num % eval_interval == 0) or last:
        t_eval = time.perf_counter()
        save_checkpoint(run, origin, model, optimizer, iter_num, step.state, extra={},
                        evaluation=evaluate())
        eval_seconds += time.perf_counter() - t_eval
    # a stop on an evaluation step is saved above, with its evaluation
    elif stopping:
        save_checkpoint(run, origin, model, optimizer, iter_num, step.state, extra={})
    # on the last step the run ends as usual: export
    if stopping and not last:
        logger.finish()
        run.exit_stopped(iter_num)

logger.finish()
export_hf(run, model, raw_model, tok, start, lora_settings(config))
teardown_distributed()
