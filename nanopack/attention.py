"""
Causal attention over packed sequences where no varlen kernel runs (the CPU; float32 anywhere): the
exact fallback behind model.varlen_attention. Sequences of alike lengths are padded into one SDPA
call a group, so a step of 256 short replies is a few calls, not 256 (a Python loop per sequence
was most of a small model's CPU step). A sequence whose queries are the last of its keys (a reply
after its shared prompt, a context-parallel slice) is aligned at the bottom right.
"""
import numpy as np
import torch
import torch.nn.functional as F

# a group's mask (its queries x keys) at most this many entries
MASK_ENTRIES = 2**24
# a sequence of more (query, key) pairs runs alone, without a mask or a padded copy of its K/V: its
# call's work hides the call's overhead, which is what grouping saves
ALONE = 2**16


def alike_groups(q_lens, k_lens, most=MASK_ENTRIES):
    """Sequence indices in groups of alike sizes, smallest first: padding a group to its longest
    queries and keys at most doubles its (query, key) pairs, and its mask stays under `most`
    entries. A sequence of no queries, or of over ALONE pairs, is a group of its own."""
    short = [0 < n and n * m <= ALONE for n, m in zip(q_lens, k_lens)]
    order = sorted((i for i, s in enumerate(short) if s), key=lambda i: (q_lens[i] * k_lens[i],
                                                                         q_lens[i]))
    groups, group, pairs, lq, lk = [[i] for i, s in enumerate(short) if not s], [], 0, 0, 0
    for i in order:
        wq, wk = max(lq, q_lens[i]), max(lk, k_lens[i])
        padded = (len(group) + 1) * wq * wk
        if group and (padded > 2 * (pairs + q_lens[i] * k_lens[i]) or padded > most):
            groups.append(group)
            group, pairs, wq, wk = [], 0, q_lens[i], k_lens[i]
        group.append(i)
        pairs, lq, lk = pairs + q_lens[i] * k_lens[i], wq, wk
    return groups + [group] * bool(group)


def causal_mask(q_pos, k_len, window):
    """(..., Lq, Lk): key j seen by the query at place q_pos among its keys (within the window)."""
    j = torch.arange(k_len, device=q_pos.device)
    seen = j <= q_pos[..., None]
    return seen if window is None else seen & (j > q_pos[..., None] - window)


class BottomRight(torch.autograd.Function):
    """CPU attention of the last Lq of Lk queries, exact in O(Lq x Lk): the keys before them
    unmasked, their own causal, two flash calls merged by log-sum-exp; each part's backward with the
    merged output and log-sum-exp is the whole softmax's gradient for that part's keys (as ring
    attention's)."""

    @staticmethod
    def forward(ctx, q, k, v):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        h = k.shape[2] - q.shape[2]
        (oa, la), (ob, lb) = (flash(q, k[:, :, :h], v[:, :, :h], 0.0, False),
                              flash(q, k[:, :, h:], v[:, :, h:], 0.0, True))
        lse = torch.logaddexp(la, lb)  # float32 for half precision, as the kernel's
        o = sum(x.to(lse.dtype) * (l - lse).exp()[..., None]
                for x, l in ((oa, la), (ob, lb))).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        h = k.shape[2] - q.shape[2]
        dqa, dka, dva = back(do, q, k[:, :, :h], v[:, :, :h], o, lse, 0.0, False)
        dqb, dkb, dvb = back(do, q, k[:, :, h:], v[:, :, h:], o, lse, 0.0, True)
        return dqa + dqb, torch.cat([dka, dkb], 2), torch.cat([dva, dvb], 2)


def layout(group, starts, lens, k_starts, k_lens):
    """A group's padded rows, on the host: each row's query tokens (B, Lq), key tokens (B, Lk), each
    query's place among its keys (B, Lq) and whether it is real (B, Lq). A pad repeats its
    sequence's last query or key."""
    s, n, ks, m = (np.array([x[i] for i in group])[:, None] for x in (starts, lens, k_starts,
                                                                     k_lens))
    i = np.arange(n.max())
    last = np.minimum(i, n - 1)
    return s + last, ks + np.minimum(np.arange(m.max()), m - 1), m - n + last, i < n


def attend(q, k, v, place, window):
    """q (B, H, Lq, D) over k/v (B, H, Lk, D), query i at place[b, i] among its keys. One sequence
    goes without a mask where none is needed (a mask takes CPU's O(Lq x Lk) math path)."""
    (B, _, Lq, _), Lk = q.shape, k.shape[2]
    # 0 queries: SIGFPE
    one = B == 1 and (window is None or Lk <= window)
    if one and 0 < Lq < Lk and q.device.type == "cpu":
        return BottomRight.apply(q, k, v)
    if one and Lq == Lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # SDPA's is_causal aligns at the top left; queries are the last Lq of the Lk keys
    mask = causal_mask(torch.tensor(place.tolist(), device=q.device), Lk, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # (B, 1, Lq, Lk)


# a Python loop over a data-dependent number of groups: run eagerly, never traced
@torch.compiler.disable
def sdpa_per_sequence(q, k, v, cu_seqlens, sliding_window=None, cu_seqlens_k=None, kv_index=None):
    """Exact causal attention within each sequence: q (T, Hq, D), k/v (Tk, Hkv, D) (with kv_index:
    k[kv_index]) -> (T, Hq, D), one SDPA call per group of alike sequences (alike_groups), memory
    O(max L^2), not O(T^2)."""
    # lengths on the host from cu_seqlens as it is: an op on it first is data-dependent under fake
    # tensors (plan.py)
    starts = cu_seqlens.tolist()
    k_starts = starts if cu_seqlens_k is None else cu_seqlens_k.tolist()
    lens, k_lens = np.diff(starts).tolist(), np.diff(k_starts).tolist()
    groups = alike_groups(lens, k_lens)
    rows = [layout(g, starts, lens, k_starts, k_lens) for g in groups]
    # K/V repeated (SDPA's enable_gqa takes a slow math path on CPU) before kv_index repeats rows
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # each tensor in one gather, every group's rows padded (its backward fills one tensor its
    # source's size: a gather or slice a group would fill one each)
    q_at, k_at = ([r[i] for r in rows] for i in (0, 1))
    k_rows = host_index(k_at, q.device)
    k_rows = k_rows if kv_index is None else kv_index.index_select(0, k_rows)
    sizes = [a.size for a in k_at]
    groups = zip(q.index_select(0, host_index(q_at, q.device)).split([a.size for a in q_at]),
                 k.index_select(0, k_rows).split(sizes), v.index_select(0, k_rows).split(sizes))
    outs, at, done = [], np.empty(q.shape[0], dtype=np.int64), 0
    for (qi, ki, vi), (q_at, k_at, place, real) in zip(groups, rows):
        qi, ki, vi = (t.unflatten(0, x.shape).transpose(1, 2) for t, x in ((qi, q_at), (ki, k_at),
                                                                           (vi, k_at)))
        outs.append(attend(qi, ki, vi, place, sliding_window).transpose(1, 2).flatten(0, 1))
        # where each token's output is (a pad's is dropped)
        at[q_at[real]] = done + np.flatnonzero(real)
        done += q_at.size
    out = torch.cat(outs)
    # rows back in the stream's order (a sequence of no queries has none), the pads dropped
    in_order = done == len(at) and (at == np.arange(len(at))).all()
    return out if in_order else out.index_select(0, torch.tensor(at.tolist(), device=q.device))


def host_index(arrays, device):
    """Host index arrays, flattened and joined, as one index tensor."""
    return torch.tensor(np.concatenate([a.ravel() for a in arrays]).tolist(), dtype=torch.long,
                        device=device)
