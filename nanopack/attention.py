"""
Causal attention over packed sequences where no varlen kernel runs (the CPU; float32 anywhere): the
exact fallback behind model.varlen_attention. Short sequences of alike lengths are padded to one
shape and run in one SDPA call a shape, so a step of 256 short replies is a few calls, not 256 (a
Python loop per sequence was most of a small model's CPU step). A sequence whose queries are the
last of its keys (a reply after its shared prompt, a context-parallel slice) is aligned at the
bottom right.
"""
import numpy as np
import torch
import torch.nn.functional as F

# a group's mask (its queries x keys) at most this many entries
MASK_ENTRIES = 2**24
# a sequence of more (query, key) pairs runs alone, without a mask or a padded copy of its K/V: its
# call's work hides the call's overhead, which is what grouping saves
ALONE = 2**16


def bucket(n):
    """n rounded up to 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: at most 1.5x, and from n alone."""
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if n <= 3 * p // 4 else p


def alike_groups(q_lens, k_lens, most=MASK_ENTRIES):
    """Sequences grouped by their padded shape, (bucket(Lq), bucket(Lk)) -> [(indices, shape)], a
    group in the stream's order, its mask under `most` entries (a larger one split). A shape
    depends on its sequence alone, so a sequence's numbers do not depend on what else is in the
    batch (one rank or eight give the same). A sequence of no queries, or of over ALONE pairs,
    runs alone and unpadded (shape None)."""
    groups, shapes = [], {}
    for i, (n, m) in enumerate(zip(q_lens, k_lens)):
        if 0 < n and n * m <= ALONE:
            shapes.setdefault((bucket(n), bucket(m)), []).append(i)
        else:
            groups.append(([i], None))
    for (n, m), members in sorted(shapes.items()):
        per_call = max(most // (n * m), 1)
        groups += [(members[j:j + per_call], (n, m)) for j in range(0, len(members), per_call)]
    return groups


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


def layout(group, shape, starts, lens, k_starts, k_lens):
    """A group's rows padded to shape (Lq, Lk) (None: its own lengths), on the host: each row's
    query tokens (B, Lq), key tokens (B, Lk), each query's place among its keys (B, Lq) and whether
    it is real (B, Lq). A pad repeats its sequence's last query or key."""
    s, n, ks, m = (np.array([x[i] for i in group])[:, None] for x in (starts, lens, k_starts,
                                                                     k_lens))
    Lq, Lk = shape or (n.max(), m.max())
    i = np.arange(Lq)
    last = np.minimum(i, n - 1)
    return s + last, ks + np.minimum(np.arange(Lk), m - 1), m - n + last, i < n


def attend(q, k, v, place, window, alone):
    """q (B, H, Lq, D) over k/v (B, H, Lk, D), query i at place[b, i] among its keys. A sequence
    alone goes without a mask where none is needed (a mask takes CPU's O(Lq x Lk) math path)."""
    Lq, Lk = q.shape[2], k.shape[2]
    alone = alone and (window is None or Lk <= window)
    # 0 queries: SIGFPE
    if alone and 0 < Lq < Lk and q.device.type == "cpu":
        return BottomRight.apply(q, k, v)
    if alone and Lq == Lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # SDPA's is_causal aligns at the top left; queries are the last Lq of the Lk keys
    mask = causal_mask(torch.tensor(place.tolist(), device=q.device), Lk, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # (B, 1, Lq, Lk)


# a Python loop over a data-dependent number of groups: run eagerly, never traced
@torch.compiler.disable
def grouped_sdpa(q, k, v, cu_seqlens, sliding_window=None, cu_seqlens_k=None, kv_index=None):
    """Exact causal attention within each sequence: q (T, Hq, D), k/v (Tk, Hkv, D) (with kv_index:
    k[kv_index]) -> (T, Hq, D), one SDPA call per group of alike sequences (alike_groups), memory
    O(max L^2), not O(T^2)."""
    # lengths on the host from cu_seqlens as it is: an op on it first is data-dependent under fake
    # tensors (plan.py)
    starts = cu_seqlens.tolist()
    k_starts = starts if cu_seqlens_k is None else cu_seqlens_k.tolist()
    lens, k_lens = np.diff(starts).tolist(), np.diff(k_starts).tolist()
    groups = alike_groups(lens, k_lens)
    rows = [layout(g, shape, starts, lens, k_starts, k_lens) for g, shape in groups]
    # K/V repeated (SDPA's enable_gqa takes a slow math path on CPU) before kv_index repeats rows
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # each tensor in one gather, every group's rows padded to its shape (its backward fills one
    # tensor its source's size: a gather or slice a group would fill one each)
    q_at, k_at = ([r[i] for r in rows] for i in (0, 1))
    k_rows = host_index(k_at, q.device)
    k_rows = k_rows if kv_index is None else kv_index.index_select(0, k_rows)
    sizes = [a.size for a in k_at]
    gathered = zip(q.index_select(0, host_index(q_at, q.device)).split([a.size for a in q_at]),
                   k.index_select(0, k_rows).split(sizes), v.index_select(0, k_rows).split(sizes))
    outs, at, done = [], np.empty(q.shape[0], dtype=np.int64), 0
    for (qi, ki, vi), (q_at, k_at, place, real), (_, shape) in zip(gathered, rows, groups):
        qi, ki, vi = (t.unflatten(0, x.shape).transpose(1, 2) for t, x in ((qi, q_at), (ki, k_at),
                                                                           (vi, k_at)))
        y = attend(qi, ki, vi, place, sliding_window, alone=shape is None)
        outs.append(y.transpose(1, 2).flatten(0, 1))
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
