"""Run by tests/test_context_parallel.py under torchrun (gloo on CPU), not collected by pytest itself:
    torchrun --nproc_per_node=W tests/context_check.py CP [CASE ...]
W / CP data-parallel groups of CP ranks each take one micro-batch (a different one per group) and compute it under
context parallelism; every rank also computes all the groups' micro-batches in one process, the reference. Checked per
case: the summed token loss, every per-sequence log-prob sum, and every parameter gradient of
    loss = token cross-entropy sum + f(per-sequence log-prob sums)        (f nonlinear: a DPO-like term)
or (RL cases) losses.policy_loss, the GRPO family's loss (a ratio per reply: its sums over the CP group),
with each rank's gradients summed over the world (what DDP / FSDP2 do, times world_size) against the sum of the
reference gradients. Tolerances (float32): the same terms summed in another order and attention over key prefixes
instead of whole sequences, so rounding only: loss and sums 1e-5 relative, each gradient 1e-5 of its largest entry;
a wrong position, key or target moves them by 1e-2 or more with random weights."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack import context  # noqa: E402
from nanopack import kernels  # noqa: E402
from losses import loss_weights, policy_loss  # noqa: E402
from model import Transformer, config_from_preset  # noqa: E402
from packing import group_data, make_batch, shared_prefixes  # noqa: E402

VOCAB = 300
SFT = {  # sequence lengths of one micro-batch, as the loader packs them (longest first)
    "shorter than a slice": [9, 7, 6, 5, 4, 3, 2, 1],
    "longer than a slice": [40, 25, 3],
    "lengths not divisible by 2cp": [13, 11, 7, 1],
    "one sequence fills the stream": [64],
    "one token": [1],
    "filler": [],
}
PAIRS = [(30, [5, 9]), (3, [12, 2]), (11, [1, 1])]  # groups of k sequences: (prompt, [reply lengths])
SHARED = {  # (groups, whether the prompt is laid out once: kv composed with the CP gather)
    "dpo pairs, prefix shared": (PAIRS, True),
    "dpo pairs, whole": (PAIRS, False),
    "k=3 replies, prefix shared": ([(21, [4, 17, 6]), (2, [9, 1, 3])], True),
}
RL = {  # the GRPO family on groups of replies: (their batch, (loss_aggregation, importance_sampling_level, clip_mode))
    "rl: token mean, a ratio per token": ("k=3 replies, prefix shared", ("token_mean", "token", "ppo")),
    "rl: reply mean, a ratio per reply": ("k=3 replies, prefix shared", ("reply_mean", "sequence", "ppo")),
    "rl: constant, cispo per reply": ("k=3 replies, prefix shared", ("constant", "sequence", "cispo")),
    "rl: reply mean, a ratio per reply, whole": ("dpo pairs, whole", ("reply_mean", "sequence", "ppo")),
}
MODELS = {"gqa": {}, "sliding window": dict(sliding_window=6), "mha+bias": dict(n_kv_head=4, qkv_bias=True),
          "activation checkpointing": {}}  # the gather runs again in backward


def sft_data(lengths, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, sum(lengths))
    mask = (rng.random(sum(lengths)) < 0.8).astype(np.uint8)  # some tokens untrained
    return dict(ids=ids, loss_mask=mask, offsets=np.r_[0, np.cumsum(lengths)].astype(np.int64))


def batch(case, seed):
    if case in RL:
        return batch(RL[case][0], seed)
    if case in SFT:
        return make_batch(sft_data(SFT[case], seed), list(range(len(SFT[case]))))
    rng = np.random.default_rng(seed)
    groups, shared = SHARED[case]
    k = len(groups[0][1])
    replies = [[rng.integers(0, VOCAB, n) for n in lens] for _, lens in groups]
    for group in replies:  # replies differ at their first token: the prompt is exactly the shared prefix
        for j, r in enumerate(group):
            r[0] = j
    data = group_data([rng.integers(0, VOCAB, P) for P, _ in groups], replies)
    prefix = shared_prefixes(data, k) if shared else None
    return make_batch(data, list(range(len(groups)))[::-1], group_size=k, prefix=prefix)


def objective(model, mb):
    """-> (token loss sum, per-sequence log-prob sums, the loss backpropagated)."""
    ce = model(**mb.inputs())[0]
    sums = mb.sequence_sums(model(**mb.inputs(), logprobs=True))
    return ce, sums, ce - F.logsigmoid(0.1 * (sums - sums.flip(0))).sum()


def policy_objective(model, mb, aggregation, level, clip_mode):
    """-> (the policy loss, per-sequence log-prob sums, the loss backpropagated): ratios away from 1 (the sampler's
    log-probs a function of each token, so alike on a slice), some clipped, a KL term."""
    logps = model(**mb.inputs(), logprobs=True)
    shift = 0.3 * torch.sin(1.7 * mb.targets.float() + mb.seq_ids.float())
    lengths = mb.sequence_sums(torch.ones_like(logps))  # each reply's trained tokens, over the CP group
    advantages = torch.linspace(-1.5, 1.5, mb.num_sequences)
    weights = loss_weights(lengths, aggregation, 7.0)
    loss, _ = policy_loss(logps, logps.detach() - shift, mb.seq_ids, advantages, weights, lengths, 0.2, 0.28,
                          clip_mode, mb.sequence_sums if level == "sequence" else None, logps.detach() + 0.5 * shift, 0.05)
    return loss.detach(), mb.sequence_sums(logps.detach()), loss


def grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size, cases = int(sys.argv[1]), sys.argv[2:]
    cp = context.setup(size, rank, world)
    kernels.LOSS_CHUNK = 5  # the LM head's chunk loop runs over several chunks
    for name in cases:
        run = (lambda model, mb: policy_objective(model, mb, *RL[name][1])) if name in RL else objective
        for model_name, overrides in MODELS.items():
            torch.manual_seed(0)
            model = Transformer(config_from_preset("tiny", vocab_size=VOCAB, **overrides))
            model.activation_checkpointing = model_name == "activation checkpointing"
            ref_grads, ref = {}, []
            for d in range(cp.data_size):  # every group's micro-batch in one process
                ce, sums, loss = run(model, batch(name, seed=d))
                loss.backward()
                ref.append((ce.detach(), sums.detach()))
                ref_grads = {n: ref_grads.get(n, 0) + g for n, g in grads(model).items()}
            local = cp.split(batch(name, seed=cp.data_rank))
            assert local.input_ids.numel() < max(2, local.num_tokens * size), "each rank computes a slice only"
            ce, sums, loss = run(model, local)
            loss.backward()
            ce = ce.detach()
            dist.all_reduce(ce, group=cp.group)
            got = grads(model)
            for g in got.values():
                dist.all_reduce(g)
            what = f"{name} / {model_name} / cp={size} of {world}"
            torch.testing.assert_close(ce, ref[cp.data_rank][0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(sums.detach(), ref[cp.data_rank][1], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{what}: {m}")
            for n, g in got.items():
                scale = ref_grads[n].abs().max() + 1e-12
                torch.testing.assert_close(g / scale, ref_grads[n] / scale, atol=1e-5, rtol=0,
                                           msg=lambda m: f"{what}: {n}: {m}")
            if rank == 0:
                print(f"ok {what}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
