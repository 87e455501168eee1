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
    "a window into the prompt": ([4, 2, 9, 1, 3, 6], [24, 22, 29, 11, 13, 7], 5),
    "a sequence of no queries": ([3, 0, 3, 2], [8, 4, 3, 2], None),
    "a long one alone": ([300, 3, 4], [300, 3, 6], None),
    # already in the stream's order, the pads at the end: they must still be dropped (a DPO pair alone did this)
    "in order with pads last": ([3, 2], [3, 5], None),
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
    out = A.sdpa_per_sequence(q, k, v, cu_q, window, None if k_lens is q_lens else cu_k)
    assert sorted(len(g) for g in seen)[-1] > 1 and sorted(s for g in seen for s in g) == list(range(len(q_lens)))
    expected = reference(q, k, v, q_lens, k_lens, window)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)



def test_groups_pad_at_most_double_and_bound_the_mask():
    """Every sequence in exactly one group; a group of several pads its (query, key) pairs at most 2x and its mask
    stays under the bound; the 60-token row among short ones runs alone, and so does one of over ALONE pairs."""
    rng = np.random.default_rng(0)
    q_lens = rng.integers(1, 40, 300).tolist() + [60, 0, 300]
    k_lens = [n + int(rng.integers(0, 30)) for n in q_lens]
    groups = alike(q_lens, k_lens, most=4000)
    assert sorted(s for g in groups for s in g) == list(range(len(q_lens)))
    for g in groups:
        padded = len(g) * max(q_lens[s] for s in g) * max(k_lens[s] for s in g)
        if len(g) > 1:
            assert padded <= 2 * sum(q_lens[s] * k_lens[s] for s in g) and padded <= 4000
    assert [300] in groups and [301] in groups and [302] in groups  # the long rows alone; no queries on its own
    assert max(len(g) for g in groups) > 5  # short rows do share calls


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
    out = A.sdpa_per_sequence(q, k, v, cu_q, None, cu_k, kv_index)
    expected = reference(q, k[kv_index], v[kv_index], q_lens, k_lens, None)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
