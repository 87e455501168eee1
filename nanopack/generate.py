"""
Generation with a KV cache on the packed stream: a batch of prompts is read once, in one packed
prefill (however many replies each gets), then each new token is one decode step over the unfinished
replies (no padding anywhere).
"""
import numpy as np
import torch
import torch.nn.functional as F

from model import varlen_attention


class KVCache:
    """Per layer a buffer (B, Hkv, capacity, D), row b holding sequence b's keys (values) at their
    positions. Each forward calls begin() once, then each layer attend(): a prefill attends within
    the packed stream, as without a cache; a decode step (one new token per row) over the row's
    positions 0..position, all rows in one SDPA call."""

    def __init__(self, batch_size, capacity):
        self.batch_size, self.capacity = batch_size, capacity
        # per layer (B, Hkv, capacity, D), made at the first write, in k's dtype
        self.k, self.v = [], []

    def begin(self, position_ids, cu_seqlens, max_seqlen, sliding_window):
        T, B = position_ids.shape[0], cu_seqlens.shape[0] - 1
        assert B == self.batch_size, \
            f"a forward with a cache of {self.batch_size} sequences got {B}"
        self.layer = 0  # the next attend() is this layer's
        # a prefill of length-1 prompts is also one token per row: the same arithmetic
        self.decoding = T == B
        self.rows = torch.repeat_interleave(torch.arange(B, device=position_ids.device),
                                            cu_seqlens.diff(),
                                            output_size=T)  # (T,) each token's row
        self.pos, self.length = position_ids, max_seqlen
        if self.decoding:
            key_pos = torch.arange(max_seqlen, device=position_ids.device)
            # (B, L) causal; unwritten slots lie past each position
            sees = key_pos <= position_ids[:, None]
            if sliding_window is not None:
                sees &= key_pos > position_ids[:, None] - sliding_window
            self.mask = sees[:, None, None, :]  # (B, 1, 1, L): broadcast over heads and query rows

    # eager even when compiled: in-place writes to a Python object's buffers, and no layer index to
    # specialise on
    @torch.compiler.disable
    def attend(self, q, k, v, cu_seqlens, max_seqlen, sliding_window):
        if self.layer == len(self.k):
            shape = (self.batch_size, k.shape[1], self.capacity, k.shape[2])
            self.k.append(k.new_zeros(shape))
            self.v.append(v.new_zeros(shape))
        k_buf, v_buf = self.k[self.layer], self.v[self.layer]
        self.layer += 1
        k_buf[self.rows, :, self.pos] = k  # (T, Hkv, D) scattered to (row, :, position)
        v_buf[self.rows, :, self.pos] = v
        if not self.decoding:
            return varlen_attention(q, k, v, cu_seqlens, max_seqlen, sliding_window)
        B, H, D = q.shape
        k, v = k_buf[:, :, :self.length], v_buf[:, :, :self.length]  # (B, Hkv, L, D)
        # GQA without repeating K/V: the query heads that share a K/V head become its query rows
        q = q.view(B, k.shape[1], H // k.shape[1], D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).reshape(B, H, D)

    def keep(self, rows):
        """Keep these rows (finished sequences leave), in this order, as rows 0..len(rows)-1."""
        for buffers in (self.k, self.v):
            for layer, buf in enumerate(buffers):
                buffers[layer] = buf[torch.tensor(rows, dtype=torch.long, device=buf.device)]
        self.batch_size = len(rows)


def sample(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    """(B, V) float logits -> (B,) next ids: argmax at temperature 0, else a draw from
    softmax(logits / temperature) kept to the top_k tokens and to the nucleus (the fewest most
    likely tokens reaching top_p). generator: one for all rows, or a list, one per row (its tokens
    then the same whatever else is in the batch)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    # 1.0 skipped: a float cumsum may reach 1 before the last tokens
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # the tokens before it already reach top_p
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def packed(pieces, starts, device):
    """Token lists, each from position starts[i] on -> (ids, positions, cu_seqlens, each one's last
    index), made on the host (plan.py keeps them real under fake tensors)."""
    lens = [len(p) for p in pieces]
    cu = np.cumsum([0] + lens)
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    ids = np.fromiter((t for p in pieces for t in p), dtype=np.int64, count=cu[-1])
    return (torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device),
            torch.from_numpy(cu.astype(np.int32)).to(device),
            torch.from_numpy(cu[1:] - 1).to(device))


@torch.no_grad()
def generate(model, prompts, max_new_tokens, stop_ids=(), temperature=0.0, top_k=None,
             generator=None,
             sync_ranks=False, kv_cache=True, num_samples=1, top_p=None):
    """prompts: token-id lists -> the new tokens of num_samples replies to each, reply j to prompt i
    at i * num_samples + j, the stop token included; a reply also stops where prompt + reply fill
    max_seq_len. sync_ranks (FSDP: every forward is a collective): ranks step together until all are
    done, one with nothing left running a dummy forward. kv_cache=False re-reads every sequence
    whole for each token: the reference the cache is tested against."""
    device = next(model.parameters()).device
    longest, positions = max(map(len, prompts), default=0), model.config.max_seq_len
    if longest >= positions:
        raise ValueError(f"a prompt of {longest} tokens leaves no room for a reply: the model "
                         f"reads at most max_seq_len={positions} tokens")
    seqs = [list(p) for p in prompts for _ in range(num_samples)]
    new = [[] for _ in seqs]
    active = list(range(len(seqs)))
    stop_ids = set(stop_ids)
    cache = KVCache(len(prompts),
                    min(longest + max_new_tokens, positions)) if kv_cache and prompts else None
    for step in range(max_new_tokens):
        if sync_ranks:
            busy = torch.tensor(len(active), device=device)
            torch.distributed.all_reduce(busy, op=torch.distributed.ReduceOp.MAX)
            if busy.item() == 0:
                break
            if not active:
                model(torch.zeros(1, dtype=torch.long, device=device))
                continue
        elif not active:
            break
        # a prompt's replies are all active at step 0
        prefill_once = cache is not None and step == 0
        if cache is None or step == 0:  # whole sequences (with a cache: the prefill of the prompts)
            read = active[::num_samples] if prefill_once else active
            inputs = packed([seqs[i] for i in read], [0] * len(read), device)
        else:  # one decode step: each sequence's newest token, at its position
            inputs = packed([seqs[i][-1:] for i in active], [len(seqs[i]) - 1 for i in active],
                            device)
        max_len = max(len(seqs[i]) for i in active)  # cached tokens included
        # through forward, not the trunk directly, so that FSDP2's root hooks gather the embeddings
        # and head
        # (B, V): each one's last token
        logits = model(*inputs[:3], max_len, logits_at=inputs[3], cache=cache).float()
        # each prompt's last logits and cache row, once per reply
        if prefill_once and num_samples > 1:
            logits = logits.repeat_interleave(num_samples, 0)
            cache.keep([i for i in range(len(prompts)) for _ in range(num_samples)])
        # a generator per reply, following the active rows
        per_reply = isinstance(generator, (list, tuple))
        next_ids = sample(logits, temperature, top_k, top_p, [generator[i] for i in active]
                          if per_reply else generator)
        still, rows = [], []
        for row, (i, t) in enumerate(zip(active, next_ids.tolist())):
            seqs[i].append(t)
            new[i].append(t)
            if t not in stop_ids and len(seqs[i]) < positions:
                still.append(i)
                rows.append(row)
        if cache is not None and len(still) < len(active):
            cache.keep(rows)  # a finished sequence's row leaves the cache: decode steps skip it
        active = still
    return new
