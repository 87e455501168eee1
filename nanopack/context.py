"""
Context parallelism (CP) on the packed stream, so that one sequence may be longer than one GPU's
micro-batch (Llama 3, arXiv 2407.21783 §3.3.2). The `size` ranks of a CP group (consecutive ranks:
one node's fast links) take the same micro-batch and each computes a slice: every sequence is cut
into 2*size chunks dealt head-tail (rank r takes chunks r and 2*size-1-r), which gives each rank the
same causal attention work. A slice is a batch of query pieces over a longer key stream
(packing.py's kv), each attending to its sequence's keys up to its own end, read from K/V
all-gathered over the group in every layer. All else is per token; per-sequence sums are all-reduced
over the group. Gradients: DDP / FSDP2 average over all ranks, so the scripts multiply every rank's
loss by world_size, as without CP, and the group's shares add up.
"""
import datetime
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from packing import IGNORE_INDEX

# the new names of torch 2.13, the old ones before (deprecated there, with a warning)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Gather(torch.autograd.Function):
    """(T, ...) rows on each rank -> (size * T, ...), rank after rank; backward: a reduce-scatter
    of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, size = group, dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        ALL_GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        REDUCE_SCATTER(out, grad.contiguous(), group=ctx.group)
        return out, None


class Sum(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank computes the same loss from the
    sums, and the ranks' gradients add up to its gradient once (Megatron's
    reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ranges(starts, ends):
    """The concatenation of arange(s, e) for each pair, without a Python loop."""
    lens = ends - starts
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(lens.sum())


@dataclass
class ContextParallel:
    """This rank's place in the device mesh: world = data_size x size; size 1: no CP."""
    size: int = 1        # ranks sharing each micro-batch
    rank: int = 0        # this rank's place among them: which slice it computes
    data_rank: int = 0   # the data-parallel rank of its group (the loader's rank)
    data_size: int = 1   # data-parallel groups (the loader's world size)
    group: object = None  # the CP ranks' process group

    @torch.compiler.disable  # a collective in an autograd Function: run eagerly
    def gather(self, x):
        return Gather.apply(x, self.group)

    def sum(self, x):
        return Sum.apply(x, self.group)

    def broadcast(self, obj):
        """-> obj (any picklable object) as the group's first rank holds it."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def split(self, mb):
        """This rank's slice of a host micro-batch: its chunks of every sequence, padded at the end
        (a query segment of its own) to the longest slice: the ranks' totals differ by one at
        most."""
        if self.size == 1:
            return mb
        C, r = self.size, self.rank
        cu = mb.cu_seqlens.numpy().astype(np.int64)
        # (S,) query segments: sequences, or a filler's dummy token
        q_lens, T = np.diff(cu), int(cu[-1])
        kv_index, cu_k = ((np.arange(T), cu) if mb.kv is None
                          else (mb.kv[0].numpy(), mb.kv[1].numpy().astype(np.int64)))
        # rows per rank per sequence: equal shares, remainders dealt round the ranks in turn
        rem = q_lens % (2 * C)
        # (S,) the rank that takes this sequence's first remainder row
        turn = (np.cumsum(rem) - rem) % C
        n = (((q_lens - rem) // C + rem // C)[:, None]
             + ((np.arange(C) - turn[:, None]) % C < (rem % C)[:, None]))
        # (S, 2C) chunk lengths: rank r's are r, 2C-1-r
        sizes = np.concatenate([n // 2, (n - n // 2)[:, ::-1]], 1)
        ends = np.cumsum(sizes, 1)
        # (T,)
        owner = np.repeat(np.tile(np.r_[np.arange(C), np.arange(C)[::-1]], len(q_lens)),
                          sizes.ravel())
        T_local = max(1, int(np.bincount(owner, minlength=C).max()))
        # row of the whole stream -> its row in the gathered (size * T_local) stream
        where = np.empty(T, np.int64)
        for s in range(C):
            mine = np.flatnonzero(owner == s)
            where[mine] = s * T_local + np.arange(len(mine))
        # ascending: sequence by sequence, head chunk then tail chunk
        rows = np.flatnonzero(owner == r)
        pad = T_local - len(rows)
        # this rank's pieces (sequence, end, length), each reading its sequence's keys up to its end
        # (a shared prompt's keys start P rows before the queries: kv's bottom-right alignment)
        b, length = ends[:, [r, 2 * C - 1 - r]].ravel(), sizes[:, [r, 2 * C - 1 - r]].ravel()
        seq = np.repeat(np.arange(len(q_lens)), 2)[length > 0]
        b, length = b[length > 0], length[length > 0]
        k_end = cu_k[seq] + (np.diff(cu_k) - q_lens)[seq] + b
        keys = np.r_[where[kv_index[ranges(cu_k[seq], k_end)]],
                     r * T_local + len(rows) + np.arange(pad)]
        k_lens = np.r_[k_end - cu_k[seq], [pad] * (pad > 0)].astype(np.int64)
        q_lens_local = np.r_[length, [pad] * (pad > 0)].astype(np.int64)
        long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        cum = lambda a: torch.from_numpy(np.r_[0, np.cumsum(a)].astype(np.int32))
        # SFT: a target slot per row; the padding's are IGNORE, in the filler slot N
        if mb.target_rows is None:
            tgt = dict(targets=long(np.r_[mb.targets.numpy()[rows], np.full(pad, IGNORE_INDEX)]),
                       target_rows=None,
                       seq_ids=long(np.r_[mb.seq_ids.numpy()[rows],
                                          np.full(pad, mb.num_sequences)]))
        # target triples: those whose row is this rank's
        else:
            tr = mb.target_rows.numpy()
            mine = owner[tr] == r
            tgt = dict(targets=long(mb.targets.numpy()[mine]),
                       target_rows=long(where[tr[mine]] - r * T_local),
                       seq_ids=long(mb.seq_ids.numpy()[mine]))
        # a filler's dummy token is no real token
        real = int((rows < mb.num_tokens).sum())
        zeros = np.zeros(pad, np.int64)
        return replace(mb, **tgt, input_ids=long(np.r_[mb.input_ids.numpy()[rows], zeros]),
                       position_ids=long(np.r_[mb.position_ids.numpy()[rows], zeros]),
                       cu_seqlens=cum(q_lens_local), max_seqlen=int(q_lens_local.max()),
                       kv=(long(keys), cum(k_lens), int(k_lens.max())), context=self,
                       num_tokens=real,
                       num_target_tokens=int((tgt["targets"] != IGNORE_INDEX).sum()),
                       num_padding=T_local - real)


def setup(context_parallel, rank, world_size, timeout_s=300):
    """-> this rank's ContextParallel; every rank creates every group (the process group API needs
    it)."""
    if context_parallel == 1:
        return ContextParallel(data_rank=rank, data_size=world_size)
    # ranks [d * size, (d + 1) * size) for each d; past timeout_s a collective fails, not hangs
    group, _ = dist.new_subgroups(context_parallel, timeout=datetime.timedelta(seconds=timeout_s))
    return ContextParallel(context_parallel, rank % context_parallel, rank // context_parallel,
                           world_size // context_parallel, group)
