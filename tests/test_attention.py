"""The CPU attention fallback (nanopack/attention.py): sequences of alike lengths padded into one SDPA call a group,
forward and every gradient, against softmax over a mask written from positions, per sequence, in float64 (the same
sums up to rounding: 1e-12). A pad that leaked (a key not masked, a query's output not dropped, rows put back in the
wrong order) moves an output by ~1e-1 with these random inputs."""
import numpy as np
import pytest
import torch

from nanopack import attention as A

alike = A.alike_groups  # before a test replaces it with a spy


def reference(q, k, v, q_lens, k_lens, window):
    """Each sequence alone: its queries are the last of its keys (bottom right), explicit softmax."""
    outs, qs, ks = [], 0, 0
    rows = q.shape[1] // k.shape[1]
    for n, m in zip(q_lens, k_lens):
        qi, ki, vi = q[qs:qs + n], k[ks:ks + m].repeat_interleave(rows, 1), v[ks:ks + m].repeat_interleave(rows, 1)
        pos, key = torch.arange(m - n, m)[:, None], torch.arange(m)[None, :]
        sees = (key <= pos) & (key > pos - (window or m + 1))
        scores = torch.einsum("qhd,khd->hqk", qi, ki) / q.shape[-1] ** 0.5
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~sees, -torch.inf).softmax(-1), vi))
        qs, ks = qs + n, ks + m
    return torch.cat(outs)


CASES = {  # (query lengths, key lengths or None: the same), window
    "packed SFT rows, alike and not": ([3, 5, 4, 4, 60, 1, 7, 6], None, None),
    "replies after their prompts": ([4, 2, 9, 1, 3, 3, 30], [24, 22, 29, 11, 13, 13, 31], None),
    "a window into the prompt": ([4, 3, 3, 9, 1, 6], [24, 22, 20, 29, 11, 7], 5),
    "a sequence of no queries": ([3, 0, 3, 2], [8, 4, 7, 2], None),
    "a long one alone": ([300, 3, 3], [300, 5, 6], None),
    # already in the stream's order, the pads at the end: they must still be dropped (a DPO pair alone did this)
    "in order with pads last": ([3, 5, 5], [3, 5, 6], None),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_attention_equals_each_sequence_alone(monkeypatch, case, kv_heads):
    q_lens, k_lens, window = CASES[case]
    k_lens = k_lens or q_lens
    torch.manual_seed(len(q_lens))
    H, D = 4, 8
    q = torch.randn(sum(q_lens), H, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(k_lens), kv_heads, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum([0] + x), dtype=torch.int32) for x in (q_lens, k_lens))
    seen = []
    monkeypatch.setattr(A, "alike_groups", lambda *a: seen.extend(groups := alike(*a)) or groups)
    out = A.grouped_sdpa(q, k, v, cu_q, window, None if k_lens is q_lens else cu_k)
    assert max(len(g) for g, _ in seen) > 1 and sorted(s for g, _ in seen for s in g) == list(range(len(q_lens)))
    expected = reference(q, k, v, q_lens, k_lens, window)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)



def test_groups_pad_each_sequence_to_a_shape_of_its_own():
    """Every sequence in exactly one group; a sequence's padded shape is its lengths' buckets (at most 1.5x each, from
    its own lengths), a group's mask stays under the bound; one of over ALONE pairs, and one of no queries, alone."""
    rng = np.random.default_rng(0)
    q_lens = rng.integers(1, 40, 300).tolist() + [0, 300]
    k_lens = [n + int(rng.integers(0, 30)) for n in q_lens]
    groups = alike(q_lens, k_lens, most=4000)
    assert sorted(s for g, _ in groups for s in g) == list(range(len(q_lens)))
    for g, shape in groups:
        if shape is None:
            assert g in ([300], [301])
            continue
        assert len(g) == 1 or len(g) * shape[0] * shape[1] <= 4000
        for s in g:
            assert shape == (A.bucket(q_lens[s]), A.bucket(k_lens[s]))
            assert q_lens[s] <= shape[0] <= 1.5 * q_lens[s] and k_lens[s] <= shape[1] <= 1.5 * k_lens[s]
    assert ([300], None) in groups and ([301], None) in groups and max(len(g) for g, _ in groups) > 5
    assert [A.bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]


def test_a_sequences_numbers_do_not_depend_on_the_batch():
    """A sequence's outputs and gradients are the same bit for bit whatever else is in the batch (its padded shape is
    its own): what lets one rank and eight, or a resumed run, sample and train alike."""
    torch.manual_seed(0)
    q_lens, k_lens = [5, 9, 3, 5, 17, 2], [30, 9, 20, 12, 40, 2]
    H, D = 4, 8

    q = torch.randn(sum(q_lens), H, D)
    k, v = torch.randn(sum(k_lens), 2, D), torch.randn(sum(k_lens), 2, D)

    def run(keep):
        starts, k_starts = np.cumsum([0] + q_lens), np.cumsum([0] + k_lens)
        pick = lambda t, st, i: t[st[i]:st[i + 1]]  # noqa: E731
        qs, ks, vs = (torch.cat([pick(t, st, i) for i in keep]).requires_grad_()
                      for t, st in ((q, starts), (k, k_starts), (v, k_starts)))
        cu_q, cu_k = (torch.tensor(np.cumsum([0] + [x[i] for i in keep]), dtype=torch.int32) for x in (q_lens, k_lens))
        out = A.grouped_sdpa(qs, ks, vs, cu_q, None, cu_k)
        out.square().sum().backward()
        first = slice(0, q_lens[keep[0]])  # the first kept sequence's rows
        return out[first], qs.grad[first], ks.grad[:k_lens[keep[0]]]

    for a, b in zip(run([3, 0, 1, 2, 4, 5]), run([3])):
        assert torch.equal(a, b)


def test_keys_read_through_kv_index():
    """Replies reading their shared prompt's rows through kv_index (model.py's key stream): the same outputs and
    gradients as on k[kv_index] gathered first, and the prompt rows' gradients sum every reply's."""
    torch.manual_seed(0)
    P, R = 6, [2, 3, 1]  # a prompt of 6, three replies
    H, D = 4, 8
    q = torch.randn(P + sum(R), H, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(P + sum(R), 2, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    rest = np.cumsum([P] + R)
    kv_index = torch.tensor(list(range(P)) + [i for a, b in zip(rest[:-1], rest[1:]) for i in [*range(P), *range(a, b)]])
    q_lens, k_lens = [P] + R, [P] + [P + r for r in R]
    cu_q, cu_k = (torch.tensor(np.cumsum([0] + x), dtype=torch.int32) for x in (q_lens, k_lens))
    out = A.grouped_sdpa(q, k, v, cu_q, None, cu_k, kv_index)
    expected = reference(q, k[kv_index], v[kv_index], q_lens, k_lens, None)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
