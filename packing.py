"""
Lengths in, packed micro-batches out.

Examples are never padded to a common length: a micro-batch is the concatenation of whole
examples, at most `microbatch_tokens` long, with cu_seqlens marking the boundaries so that
attention never crosses them. Nothing is cut and nothing is dropped.

Data layout (see data/prepare.py): a dict with
    ids        (M,) uint16/uint32  all examples' tokens concatenated
    offsets    (N+1,) int64        example i is ids[offsets[i]:offsets[i+1]]
    loss_mask  (M,) uint8          1 on the tokens the model must learn to produce
For DPO, example 2*p is the chosen and 2*p+1 the rejected sequence of pair p.

The label shift happens here, once: a batch carries `targets`, where targets[t] is the token position
t must predict (the next token, if that one is trained and in the same sequence, else IGNORE_INDEX).
The model scores hidden state t against targets[t] and knows nothing about shifting or boundaries.
"""
import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass, replace

import numpy as np
import torch

IGNORE_INDEX = -100  # target value that contributes no loss (Hugging Face convention)
PAD_SEGMENT = 128  # a padding tail is cut into segments this long: never past max_seq_len, attention O(128 * n_pad)


def pack(lengths, token_budget):
    """Best-fit-decreasing: put each item, longest first, into the open bin whose free space is
    the smallest that still fits it. Returns bins of item indices (bins in the order they were
    opened, items in a bin longest first); every index appears exactly once, no bin holds more
    than token_budget. Deterministic: ties keep input order."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((lengths <= 0) | (lengths > token_budget))
    if bad.size:
        i, n = int(bad[0]), int(lengths[bad[0]])
        if n <= 0:
            raise ValueError(f"pack: item {i} has length {n}; every item needs at least one token")
        raise ValueError(f"pack: item {i} has length {n}, over the token budget {token_budget}; "
                         f"raise the budget to at least {n} or re-prepare the data with a max length")
    order = np.argsort(-lengths, kind="stable")
    min_length = int(lengths.min()) if lengths.size else 1
    bins = []     # bins[b] = item indices in bin b
    spaces = []   # sorted distinct free-space values that some open bin has: bisect finds best fit
    bins_with = {}  # free space -> stack of bin ids with exactly that much room
    # Free space is an integer <= token_budget, so the sorted list has at most token_budget entries
    # and its bisect/insort run in C: ~0.5-1 s per 1M items, where a pure-Python Fenwick tree over
    # free-space values took ~3 s.
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        k = bisect_left(spaces, n)
        if k == len(spaces):  # no open bin has room: open a new one
            b, space = len(bins), token_budget - n
            bins.append([i])
        else:
            space = spaces[k]
            stack = bins_with[space]
            b = stack.pop()
            if not stack:
                del spaces[k], bins_with[space]
            bins[b].append(i)
            space -= n
        if space >= min_length:  # a bin with less room than the shortest item is closed for good
            if space in bins_with:
                bins_with[space].append(b)
            else:
                bins_with[space] = [b]
                insort(spaces, space)
    return bins


@dataclass
class PackedBatch:
    """One packed micro-batch: N whole sequences back to back, then optionally a padding tail.
    The padding tail (when pad_to asks for one) is a run of dummy segments of at most PAD_SEGMENT tokens
    (their own cu_seqlens entries, position ids 0.. each, so attention over them costs O(PAD_SEGMENT) per
    token and no position passes the model's range), targets -100 and seq_id == num_sequences, so a
    per-sequence sum over num_sequences + 1 slots puts them in the last slot, which is dropped."""
    input_ids: torch.Tensor        # (T,) long
    targets: torch.Tensor          # (T,) long, the next token where it is trained, else IGNORE_INDEX
    position_ids: torch.Tensor     # (T,) long, restarting at 0 for every sequence
    seq_ids: torch.Tensor          # (T,) long, sequence index 0..N-1 in this micro-batch; tail: N
    cu_seqlens: torch.Tensor       # (N+1,) int32, + one entry per padding segment; [0]=0, [-1]=T
    max_seqlen: int                # longest segment, padding segments included (the kernel sees it)
    example_indices: torch.Tensor  # (N,) long, index of each sequence in the data
    pair_indices: torch.Tensor     # (P,) long, DPO: seqs 2j, 2j+1 = chosen, rejected of pair j
    num_sequences: int             # N, real sequences (0 for a filler micro-batch)
    num_pairs: int                 # P = N // 2 for DPO, 0 for SFT
    num_tokens: int                # real tokens (T - num_padding)
    num_target_tokens: int         # targets != IGNORE_INDEX
    num_padding: int               # positions in the padding tail

    def to(self, device, non_blocking=True):
        moved = {k: v.to(device, non_blocking=non_blocking)
                 for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return replace(self, **moved)

    def sequence_sums(self, values):
        """values (T,) per token -> (N,) per-sequence sums: one index_add_, no host sync."""
        sums = values.new_zeros(self.num_sequences + 1)  # + 1: the padding tail's slot
        return sums.index_add_(0, self.seq_ids, values)[:self.num_sequences]

    def pair_sums(self, values):
        """DPO: values (T,) per token -> (chosen (P,), rejected (P,)) per-sequence sums."""
        sums = self.sequence_sums(values)[:2 * self.num_pairs].view(self.num_pairs, 2)
        return sums[:, 0], sums[:, 1]


def make_batch(data, indices, pad_to=None, dpo=False):
    """Concatenate examples `indices` (pair indices if dpo) into one PackedBatch; pad_to pads T
    to that fixed length with a dummy tail segment (static shapes for torch.compile)."""
    ids, offsets, loss_mask = data["ids"], data["offsets"], data["loss_mask"]
    pair_indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    # DPO: chosen and rejected adjacent, so sequence 2j / 2j+1 of the batch are pair j's.
    examples = np.stack([2 * pair_indices, 2 * pair_indices + 1], 1).reshape(-1) if dpo else pair_indices
    starts, ends = offsets[examples], offsets[examples + 1]
    seqlens = (ends - starts).astype(np.int64)  # (N,)
    n_seq, n_tok = len(examples), int(seqlens.sum())
    if pad_to is not None and n_tok > pad_to:
        raise ValueError(f"make_batch: {n_tok} tokens do not fit pad_to={pad_to}")
    if n_seq:
        input_ids = np.concatenate([ids[s:e] for s, e in zip(starts, ends)]).astype(np.int64)
        trained = np.concatenate([loss_mask[s:e] for s, e in zip(starts, ends)]) != 0
    else:  # a filler micro-batch (see PackedLoader): no real tokens
        input_ids, trained = np.zeros(0, np.int64), np.zeros(0, bool)
    cu = np.zeros(n_seq + 1, dtype=np.int64)
    np.cumsum(seqlens, out=cu[1:])
    # Position t predicts token t+1. A sequence's first token has nothing before it in its own sequence,
    # so it is never a target: no loss ever reaches across a packed boundary, whatever the mask says.
    trained[cu[:-1][seqlens > 0]] = False
    targets = np.full(n_tok, IGNORE_INDEX, dtype=np.int64)
    targets[:-1] = np.where(trained[1:], input_ids[1:], IGNORE_INDEX)
    position_ids = np.arange(n_tok) - np.repeat(cu[:-1], seqlens)
    seq_ids = np.repeat(np.arange(n_seq), seqlens)
    n_pad = 0 if pad_to is None else pad_to - n_tok
    if n_seq == 0 and n_pad == 0:
        n_pad = 1  # a zero-length micro-batch would trip the attention kernels; one dummy token
    if n_pad:  # the tail is segments of its own, so attention never mixes it with real tokens
        tail_cu = np.append(np.arange(0, n_pad, PAD_SEGMENT), n_pad)  # (S+1,) segment starts, then the end
        input_ids = np.concatenate([input_ids, np.zeros(n_pad, np.int64)])
        targets = np.concatenate([targets, np.full(n_pad, IGNORE_INDEX)])
        position_ids = np.concatenate([position_ids, np.arange(n_pad) % PAD_SEGMENT])
        seq_ids = np.concatenate([seq_ids, np.full(n_pad, n_seq)])
        cu = np.concatenate([cu, n_tok + tail_cu[1:]])
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return PackedBatch(
        input_ids=as_long(input_ids), targets=as_long(targets), position_ids=as_long(position_ids),
        seq_ids=as_long(seq_ids), cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(np.diff(cu).max()), example_indices=as_long(examples),
        pair_indices=as_long(pair_indices if dpo else np.zeros(0)), num_sequences=n_seq,
        num_pairs=len(pair_indices) if dpo else 0, num_tokens=n_tok,
        num_target_tokens=int((targets != IGNORE_INDEX).sum()), num_padding=n_pad)


@dataclass
class Step:
    """What one optimizer step consumes. Counts are GLOBAL (all ranks): every rank knows the
    global order, so the loss can be normalised exactly without communication."""
    microbatches: list        # this rank's PackedBatch list; the same length on every rank
    num_examples: int         # sequences in the step (DPO: 2 * num_pairs)
    num_pairs: int            # DPO pairs in the step (0 for SFT)
    num_tokens: int           # real tokens in the step
    num_target_tokens: int    # tokens with a label in the step
    rank_tokens: list         # real tokens given to each rank
    epoch: int
    step: int                 # index of this step within its epoch
    state: dict               # loader state that resumes right after this step


class PackedLoader:
    """Yields one Step per optimizer step, forever (epochs roll over; len() = steps per epoch).

    Step k of epoch e holds the units (examples; DPO: pairs) perm[k*B:(k+1)*B] of a permutation
    seeded by (seed, e): the data of a step depends only on seed, epoch and batch_size, never on
    world_size or microbatch_tokens, so 1 GPU and 8 GPUs train on the same data and a run can
    resume on a different number of GPUs. The last partial step of an epoch is a smaller step
    (dropped only with drop_last). Each rank takes a near-equal share of the step's tokens and
    packs it with best-fit-decreasing into micro-batches of <= microbatch_tokens.

    Every rank gets the same number of micro-batches: ranks with fewer (or no examples, when
    batch_size < world_size) get filler micro-batches with no real tokens and all targets -100,
    because DDP and FSDP collectives hang unless every rank runs as many forward/backward passes.
    The training script runs every micro-batch, syncs gradients on the last one only, and
    divides each micro-batch's summed loss by the step's global count (num_target_tokens for SFT,
    num_pairs for DPO), times world_size if the gradient reduction averages over ranks.
    A filler's loss must still touch the parameters (a sum over zero targets, not a skipped call).

    Resuming: state_dict() is the state after the last step returned. A script that fetches the
    next step before the current one is trained should checkpoint step.state instead.
    """

    def __init__(self, data, batch_size, microbatch_tokens, rank=0, world_size=1, seed=0,
                 dpo=False, pad_to=None, drop_last=False):
        assert 0 <= rank < world_size and batch_size >= 1
        if pad_to is not None and pad_to < microbatch_tokens:
            raise ValueError(f"pad_to={pad_to} is shorter than microbatch_tokens={microbatch_tokens}")
        self.data, self.batch_size, self.microbatch_tokens = data, batch_size, microbatch_tokens
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.dpo, self.pad_to, self.drop_last = dpo, pad_to, drop_last
        offsets = np.asarray(data["offsets"], dtype=np.int64)
        seqlens = np.diff(offsets)  # (N,)
        if (seqlens <= 0).any():
            i = int(np.flatnonzero(seqlens <= 0)[0])
            raise ValueError(f"example {i} has {int(seqlens[i])} tokens; re-prepare the data")
        if dpo and len(seqlens) % 2:
            raise ValueError(f"DPO data needs an even number of sequences, got {len(seqlens)}")
        # Targets per example (first token excluded, as in make_batch): the step's global count.
        mask = data["loss_mask"][:offsets[-1]]
        targets = np.add.reduceat(mask, offsets[:-1], dtype=np.int64) - mask[offsets[:-1]]
        width = 2 if dpo else 1  # a unit is one example, or one (chosen, rejected) pair
        self.lengths = seqlens.reshape(-1, width).sum(1)        # (U,) tokens per unit
        self.targets = targets.reshape(-1, width).sum(1)        # (U,) target tokens per unit
        too_long = np.flatnonzero(self.lengths > microbatch_tokens)
        if too_long.size:
            u, what = int(too_long[0]), "pair" if dpo else "example"
            raise ValueError(
                f"{what} {u} has {int(self.lengths[u])} tokens, over microbatch_tokens="
                f"{microbatch_tokens} ({too_long.size} such); raise microbatch_tokens to at least "
                f"{int(self.lengths.max())} or re-prepare the data with a smaller max length")
        n = len(self.lengths)
        self.steps_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{n} examples make no full step of batch_size={batch_size}")
        self.epoch, self.step = 0, 0
        self._perm_epoch, self._perm = None, None

    def __len__(self):
        return self.steps_per_epoch

    def __iter__(self):
        return self

    def step_units(self, epoch, step):
        """Unit indices (examples; DPO: pairs) of global step `step` of `epoch`, all ranks."""
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(len(self.lengths))
            self._perm_epoch = epoch
        return self._perm[step * self.batch_size:(step + 1) * self.batch_size]

    def split(self, units):
        """Longest first to the rank with the fewest tokens so far (ties: lowest rank); the same
        on every rank since it only reads the global step. Returns a list of units per rank."""
        lengths = self.lengths[units]
        heap = [(0, r) for r in range(self.world_size)]
        shares = [[] for _ in range(self.world_size)]
        for k in np.argsort(-lengths, kind="stable").tolist():
            tokens, r = heapq.heappop(heap)
            shares[r].append(int(units[k]))
            heapq.heappush(heap, (tokens + int(lengths[k]), r))
        return shares

    def __next__(self):
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        epoch, step = self.epoch, self.step
        units = self.step_units(epoch, step)
        shares = self.split(units)
        # Every rank packs every share (a few ms) to learn how many micro-batches the busiest rank has.
        bins = [[[share[i] for i in b] for b in pack(self.lengths[share], self.microbatch_tokens)]
                if share else [] for share in shares]
        n_micro = max(len(b) for b in bins)
        own = bins[self.rank] + [[]] * (n_micro - len(bins[self.rank]))  # [] = filler
        micro = [make_batch(self.data, b, self.pad_to, self.dpo) for b in own]
        self.step += 1
        return Step(microbatches=micro, num_examples=len(units) * (2 if self.dpo else 1),
                    num_pairs=len(units) if self.dpo else 0, num_tokens=int(self.lengths[units].sum()),
                    num_target_tokens=int(self.targets[units].sum()),
                    rank_tokens=[int(self.lengths[sh].sum()) for sh in shares],
                    epoch=epoch, step=step, state=self.state_dict())

    def state_dict(self):
        return dict(epoch=self.epoch, step=self.step, seed=self.seed, batch_size=self.batch_size,
                    num_units=len(self.lengths), dpo=self.dpo, drop_last=self.drop_last)

    def load_state_dict(self, state):
        # world_size and microbatch_tokens may change on resume; what fixes the order may not.
        for key in ("seed", "batch_size", "num_units", "dpo", "drop_last"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has "
                                 f"{self.state_dict()[key]}; resume with the same data and {key}")
        self.epoch, self.step = state["epoch"], state["step"]
