"""A conversation's turn examples (reasoning_turns='each': Qwen3 drops earlier turns' reasoning, so each such turn is
an example of its own) travel as one unit, laid out as a tree: the history each shares with the one before it is
computed once (packing.shared_prefixes, make_batch with prefix=). Against the expanded layout (every example whole)
and each example alone: per-example loss sums, the summed loss and every gradient; cut into pieces by a small budget
(several micro-batches); and train_sft.py's steps with prefix_sharing on and off.

Tolerances: float32. The tree computes the same terms, but a branch's attention runs as an (R x S+R) block and a shared
row's gradient arrives as summed contributions, so only rounding differs: 1e-4 absolute on per-example sums of up to
~-2000 (~1e-7 relative), gradients 1e-5 of their largest entry; a wrong key, position or target row moves a sum by
~1e-2 at least with random weights."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanopack import kernels
import model as M
from conftest import ROOT
from data.dataset import check_fits, turn_examples_note
from data.prepare import load, prepare
from packing import layout, make_batch, rank_bins, shared_prefixes, target_counts, unit_lengths, unit_offsets
from test_cuda_paths import KINDS, expected_calls, stand_in, use_stand_in
from test_groups import alone_logps
from test_reasoning_tools import WEATHER, A, T, U, call
from test_tokenizer import PRE_TOKENIZERS, chat_folder, real_template, train_hf
from nanopack.tokenizer import Tokenizer

WORDS = "add the numbers then check the sum again carefully because tools may fail and weather changes fast".split()


def text(rng, n):
    return " ".join(rng.choice(WORDS, n))


def trace(turns, rng):
    """An agent trace of `turns` assistant turns, each with reasoning: odd ones call a tool and read its result, even
    ones answer and are asked again (the last answers)."""
    messages = [U(text(rng, 6))]
    for t in range(turns):
        if t % 2 == 0 and t < turns - 1:
            city = str(rng.choice(["Paris", "Rome", "Oslo"]))
            messages += [A("", reasoning_content=text(rng, int(rng.integers(5, 30))),
                           tool_calls=[call("get_weather", {"city": city})]),
                         T(json.dumps({"temp": int(rng.integers(30))}))]
        else:
            messages += [A(text(rng, int(rng.integers(2, 8))), reasoning_content=text(rng, int(rng.integers(5, 30))))]
            messages += [U(text(rng, 5))] if t < turns - 1 else []
    return dict(messages=messages, tools=[WEATHER])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trees")
    pre, norm = PRE_TOKENIZERS["qwen2"]
    trained = {"qwen2": train_hf(tmp, "qwen2", pre(), norm() if norm else None)}
    folder = chat_folder(trained, tmp / "qwen3", real_template("qwen3"), "qwen2",
                         dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                         ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return str(folder), Tokenizer.from_dir(str(folder))


def traces_file(path, turns, seed=0):
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps(trace(n, rng)) + "\n" for n in turns))
    return str(path)


@pytest.fixture(scope="module")
def trees(qwen3, tmp_path_factory):
    """2-, 5- and 12-turn traces prepared with reasoning_turns='each' -> (data with its units, tokenizer)."""
    tmp = tmp_path_factory.mktemp("prepared")
    _, tok = qwen3
    prepare(traces_file(tmp / "traces.jsonl", [2, 5, 12]), str(tmp / "data"), tok, val_fraction=0,
            reasoning_turns="each", verbose=False)
    return load(str(tmp / "data"), "train")[0], tok


def batch_sums(net, data, budget, prefix):
    """(N,) per-example sums over the micro-batches of a budget (pieces: layout), in data order."""
    cut, prefix, lengths, _ = layout(data, budget, 1, prefix is not None)
    sums, seen = torch.zeros(len(data["offsets"]) - 1), []
    bounds = unit_offsets(cut)
    for units in rank_bins(np.arange(len(lengths)), lengths, budget):
        mb = make_batch(cut, units, 1, prefix)
        examples = np.concatenate([np.arange(bounds[u], bounds[u + 1]) for u in units])
        sums = sums.index_put((torch.from_numpy(examples),), mb.sequence_sums(net(**mb.inputs(), logprobs=True)),
                              accumulate=True)
        seen += examples.tolist()
    assert sorted(seen) == list(range(len(sums)))  # every example once
    return sums


def loss_and_grads(net, sums, weights):
    net.zero_grad()
    (-(weights * sums).sum()).backward()
    return sums.detach(), {k: p.grad.clone() for k, p in net.named_parameters()}


def assert_close(a, b):
    (sa, ga), (sb, gb) = a, b
    torch.testing.assert_close(sa, sb, atol=1e-4, rtol=1e-6)
    for k in ga:
        scale = ga[k].abs().max() + 1e-12
        torch.testing.assert_close(ga[k] / scale, gb[k] / scale, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def test_turn_examples_are_one_unit_sharing_their_history(trees):
    """Units are the conversations; each example shares with the one before it exactly the tokens they have in common
    (counted here one by one), and the tree computes each shared token once."""
    data, _ = trees
    bounds = unit_offsets(data)
    assert len(bounds) == 4 and np.diff(bounds)[1:].min() >= 4  # three conversations, two of them in several examples
    prefix = shared_prefixes(data)
    offsets, ids = data["offsets"], data["ids"]
    for u in range(3):
        for i in range(bounds[u], bounds[u + 1]):
            n = 0
            if i > bounds[u]:
                a, b = ids[offsets[i - 1]:offsets[i]], ids[offsets[i]:offsets[i + 1]]
                while n < min(len(b) - 1, len(a)) and a[n] == b[n]:
                    n += 1
            assert prefix[i] == n
    whole, tree = unit_lengths(data), unit_lengths(data, 1, prefix)
    assert tree[2] < whole[2] / 3  # the 12-turn trace: its history computed once
    mb = make_batch(data, [2, 0, 1], 1, prefix)
    assert mb.num_tokens == tree.sum() and mb.num_target_tokens == int(target_counts(data).sum())


@pytest.mark.parametrize("model_kw", [dict(), dict(sliding_window=16)], ids=["gqa", "window"])
def test_tree_equals_expanded_and_alone(monkeypatch, trees, model_kw):
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 64)  # the LM head's chunk loop runs over several chunks
    data, tok = trees
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=tok.vocab_size, max_seq_len=8192, **model_kw))
    weights = torch.rand(len(data["offsets"]) - 1)  # a per-example weight: a swapped example would show
    alone = loss_and_grads(net, alone_logps(net, data), weights)
    big, longest = int(unit_lengths(data).sum()), int(np.diff(data["offsets"]).max())
    assert len(layout(data, longest + 100, 1, True)[2]) > 4  # the small budget cuts the conversations into pieces
    for name, prefix, budget in (("tree", True, big), ("expanded", None, big), ("pieces", True, longest + 100)):
        got = loss_and_grads(net, batch_sums(net, data, budget, prefix), weights)
        assert_close(got, alone)


def test_the_cross_entropy_path_and_sequence_weighting(trees):
    """train_sft.py's loss (summed cross-entropy, loss_weighting='sequence' weights) is the same on the tree."""
    data, tok = trees
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=tok.vocab_size, max_seq_len=8192))
    out = {}
    for name, prefix in (("tree", shared_prefixes(data)), ("expanded", None)):
        mb = make_batch(data, [0, 1, 2], 1, prefix)
        per_seq = mb.sequence_sums((mb.targets != -100).float()).clamp(min=1.0)
        weights = 1.0 / torch.cat([per_seq, per_seq.new_ones(1)])[mb.seq_ids]
        out[name] = [net(**mb.inputs())[0].detach(), net(**mb.inputs(), loss_weights=weights)[0].detach()]
    torch.testing.assert_close(out["tree"], out["expanded"], atol=1e-3, rtol=1e-6)


def test_qk_norm_under_bf16_autocast(monkeypatch, trees):
    """Qwen3's q and k norms (float32 weights) under bf16 autocast: attention gets q, k and v in bfloat16, as SDPA's
    autocast casts them (so the CUDA dispatch picks a flash kernel, and CPU's BottomRight, raw flash ops, takes the
    tree); its sums are the expanded layout's up to bf16 rounding (exactness: the float32 tests above)."""
    data, tok = trees
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=tok.vocab_size, max_seq_len=8192, arch="qwen3",
                                             qk_norm=True))
    seen, attention = set(), M.varlen_attention
    monkeypatch.setattr(M, "varlen_attention", lambda q, k, v, *a, **kw: seen.add((q.dtype, k.dtype, v.dtype)) or
                        attention(q, k, v, *a, **kw))
    sums = {}
    for name, prefix in (("tree", shared_prefixes(data)), ("expanded", None)):
        mb = make_batch(data, [1], 1, prefix)  # the 5-turn trace
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sums[name] = mb.sequence_sums(net(**mb.inputs(), logprobs=True)).float()
        sums[name].sum().backward()
    assert seen == {(torch.bfloat16,) * 3}
    # bf16 keeps ~3 significant digits: sums of a few hundred log-probs agree to ~1%, a dropped turn moves them 10%+
    torch.testing.assert_close(sums["tree"], sums["expanded"], rtol=1e-2, atol=0)


def test_an_example_over_the_budget_is_named_as_in_the_data(trees):
    """A turn example longer than a micro-batch stops the run naming it (its index, its conversation) and its length,
    not the piece the layout cut its conversation into."""
    data, tok = trees
    lengths = np.diff(data["offsets"])
    longest, budget = int(lengths.argmax()), int(lengths.max()) - 1
    assert layout(data, budget, 1, True)[2].argmax() != longest  # pieces of several examples come before it
    conversation = int(np.searchsorted(data["units"], longest, "right")) - 1
    model_config = SimpleNamespace(vocab_size=tok.vocab_size, max_seq_len=1 << 16)
    for prefix_sharing in (True, False):
        with pytest.raises(SystemExit, match=rf"example \({longest}, a turn of conversation {conversation}\) has "
                                             rf"{lengths.max()} tokens, more than microbatch_tokens={budget};"):
            check_fits(model_config, tok, "out/data", dict(train=data), budget, 1, prefix_sharing)


def test_a_note_where_the_token_files_lack_travelling_turn_examples(qwen3, tmp_path):
    """Token files of 'each' without <split>_units.npy (an earlier version) get a note whatever the run says; files
    prepared without turn examples, under a run that asks for them, get a note that the setting is ignored."""
    _, tok = qwen3
    records = traces_file(tmp_path / "traces.jsonl", [3])
    for turns in ("each", "conversation"):
        prepare(records, str(tmp_path / turns), tok, val_fraction=0, reasoning_turns=turns, verbose=False)
    each, conversation = (load(str(tmp_path / turns), "train")[0] for turns in ("each", "conversation"))
    assert "units" in each and "units" not in conversation
    older = {k: v for k, v in each.items() if k != "units"}
    for asked in ("each", "conversation"):
        assert turn_examples_note(str(tmp_path / "each"), each, asked) == ""
        assert "prepared before turn examples travelled together" in turn_examples_note(
            str(tmp_path / "each"), older, asked)
    assert turn_examples_note(str(tmp_path / "conversation"), conversation, "conversation") == ""
    assert "reasoning_turns='each' is ignored" in turn_examples_note(str(tmp_path / "conversation"), conversation,
                                                                     "each")


def sft(tmp_path, name, data, *extra, nproc=1):
    out = str(tmp_path / name)
    args = [f"--out_dir={out}", f"--data={data}", "--reasoning_turns=each", "--init_from=scratch", "--preset=tiny",
            "--batch_size=2", "--max_iters=3", "--eval_interval=0", "--log_interval=1", "--learning_rate=1e-2",
            "--warmup_iters=0",
            "--microbatch_tokens=1500", "--val_fraction=0", "--compile=False", "--device=cpu", *extra]
    cmd = [sys.executable, "train_sft.py", *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "train_sft.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return p.stdout, [r for r in rows if "loss" in r and "lr" in r], out


@pytest.mark.slow
def test_train_sft_steps_are_the_same_with_sharing_on_and_off_and_on_two_processes(qwen3, tmp_path):
    """Six traces, 2 a step: the same losses laid out as trees or expanded, on one process, DDP x2, FSDP2 x2 and cp=2
    (each step's loss a function of all its updates so far: a wrong layout shows by step 2)."""
    folder, _ = qwen3
    data = traces_file(tmp_path / "traces.jsonl", [2, 5, 12, 3, 7, 4], seed=1)
    tok = f"--tokenizer={folder}"
    out, on, _ = sft(tmp_path, "on", data, tok)
    assert "prefix sharing:" in out and "(unshared" in out, out
    print(out)
    _, off, _ = sft(tmp_path, "off", data, tok, "--prefix_sharing=False")
    _, ddp, _ = sft(tmp_path, "ddp", data, tok, nproc=2)
    _, fsdp, _ = sft(tmp_path, "fsdp", data, tok, "--parallel=fsdp", nproc=2)
    _, cp, _ = sft(tmp_path, "cp", data, tok, "--context_parallel=2", "--microbatch_tokens=750", nproc=2)  # 2 x 750
    for run in (off, ddp, fsdp, cp):
        assert [round(r["loss"], 4) for r in run] == pytest.approx([round(r["loss"], 4) for r in on], abs=2e-4)
    assert all(r["tokens"] < r["tokens_unshared"] for r in on) and all(r["tokens"] == r["tokens_unshared"] for r in off)


@pytest.mark.parametrize("kind", KINDS)
def test_the_cuda_kernels_get_the_tree(monkeypatch, trees, kind):
    """flash-attn and torch's varlen_attn (recording stand-ins that check every argument and return the exact
    reference): a tree's key stream (cu_seqlens_k, max_seqlen_k) gives the SDPA path's sums bit for bit, and its
    gradients up to the order they are summed in."""
    data, tok = trees
    torch.manual_seed(0)
    model = M.Transformer(M.config_from_preset("tiny", vocab_size=tok.vocab_size, max_seq_len=8192)).to(torch.bfloat16)
    mb = make_batch(data, [1, 2], 1, shared_prefixes(data))
    runs = []
    for backend in (kind, "sdpa"):
        calls = []
        if backend == "sdpa":
            monkeypatch.setattr(M, "attention_backend", lambda device, dtype: "sdpa")
        else:
            use_stand_in(monkeypatch, kind, stand_in(kind, model.config, calls, shared=True))
        model.zero_grad()
        sums = mb.sequence_sums(model(**mb.inputs(), logprobs=True))
        (sums * torch.arange(1, len(sums) + 1)).sum().backward()
        assert calls == (expected_calls(kind, model.config) if backend == kind else [])
        runs.append((sums.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b)
    # the SDPA path reads k[kv_index] in its own gather, a kernel's K/V were gathered before it: a trunk row's
    # gradient sums its branches' in another order, so up to bf16 rounding (a wrong key stream moves it by ~100%)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-2 * x.abs().max().item())
