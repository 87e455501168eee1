import pytest
import torch
import torch.nn.functional as F

from nanopack.generate import KVCache, generate
from model import ModelConfig, Transformer


def test_batched_greedy_generation_equals_one_prompt_at_a_time():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64,
                                    max_seq_len=64)).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    got = generate(model, prompts, max_new_tokens=6)
    for prompt, out in zip(prompts, got):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):  # the reference: full forward of this prompt alone, argmax of the last logits
                seq.append(int(model(torch.tensor(seq))[-1].argmax()))
        assert out == seq[len(prompt):]
    # a stop token ends that sequence only, and is returned
    stop = got[1][2]
    stopped = generate(model, prompts, max_new_tokens=6, stop_ids=[stop])
    assert stopped[1] == got[1][:got[1].index(stop) + 1]


def test_sampling_is_seeded_and_respects_top_k():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, ffn_hidden=32, max_seq_len=64))
    runs = [generate(model, [[1, 2]], 8, temperature=1.0, top_k=5, seed=3)
            for _ in range(2)]
    assert runs[0] == runs[1]
    with torch.no_grad():
        top5 = set(model(torch.tensor([1, 2]))[-1].topk(5).indices.tolist())
    assert runs[0][0][0] in top5


def test_a_checkpoint_brings_its_own_tokenizer(tmp_path):
    """sample.py --model=out/x/ckpt.pt talks with the tokenizer the run trained with (it used to fall back to the
    byte tokenizer)."""
    from dataclasses import asdict
    from test_tokenizer import PRE_TOKENIZERS, train_hf

    from sample import load_model
    pre, _ = PRE_TOKENIZERS["gpt2"]
    _, folder = train_hf(tmp_path, "tok", pre(), merges=100)
    import torch.distributed.checkpoint as dcp
    model = Transformer(ModelConfig(vocab_size=400, n_layer=1, n_head=2, d_model=16, ffn_hidden=32, max_seq_len=64))
    dcp.save(dict(model=model.state_dict()), checkpoint_id=str(tmp_path / "ckpt-000007-0"), no_dist=True)  # as save_checkpoint
    torch.save(dict(weights="ckpt-000007-0", model_config=asdict(model.config), tokenizer=str(folder)),
               tmp_path / "ckpt.pt")
    loaded, tok = load_model(str(tmp_path / "ckpt.pt"), "cpu")
    assert tok.name == str(folder) and tok.vocab_size > 256  # the trained BPE, not the 261-token byte tokenizer
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


# -----------------------------------------------------------------------------
# the KV cache: exactly what generation without it does


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18]]  # lengths 3, 9, 1, 5
CACHE_CONFIGS = {  # each on top of GQA (4 query heads, 2 K/V heads)
    "gqa": {},
    "sliding window": dict(sliding_window=4),  # shorter than the sequences: the decode mask must cut it
    "qkv bias": dict(qkv_bias=True),
    "qwen3 q/k norm": dict(arch="qwen3", qk_norm=True, head_dim=16),  # head_dim != d_model / n_head
    "smollm3 nope": dict(arch="smollm3", nope_layers=(1,)),
}


def random_model(**kw):
    """All weights random (biases and norm weights too, or they would change nothing) and large enough that
    logits span several units: choices are then decided by clear margins, not by the last bits of a float."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64, max_seq_len=64)
    model = Transformer(ModelConfig(**{**cfg, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    return model


@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_kv_cache_generates_exactly_what_no_cache_does(config):
    model = random_model(**CACHE_CONFIGS[config])
    for sampling in (dict(), dict(temperature=0.8, top_k=20)):
        def run(**kw):
            return generate(model, PROMPTS, 10, seed=3, **sampling, **kw)

        ref = run(kv_cache=False)
        stop_ids = [t for t in ref[1][2:] if t not in ref[0]][:1]  # ends sequence 1 early, never sequence 0
        ref = run(kv_cache=False, stop_ids=stop_ids)
        assert len(ref[1]) < 10 and len(ref[0]) == 10  # rows leave the cache while others go on
        assert run(stop_ids=stop_ids) == ref  # token for token, the sampled ones with the same noise


@pytest.mark.parametrize("config", CACHE_CONFIGS)
def test_cached_logits_equal_the_full_forward(config):
    """Each decode step's logits == the full forward's last-position logits. float32: the two differ only in
    summation order (one query row against a padded, masked key buffer vs causal attention over the whole
    sequence; matmuls of other shapes), and the prefill is the same computation (equal bits). Measured: at
    most 8e-6 on logits of magnitude ~5 (a few ulps, grown through the large random weights); 3e-5 leaves
    room for other CPUs' kernels, while a wrong position, mask or row is off by ~0.1 or more."""
    model = random_model(**CACHE_CONFIGS[config])
    seqs = [list(p) for p in PROMPTS]
    cache = KVCache(len(seqs), 32)

    def pack(parts, positions):
        lens = [len(p) for p in parts]
        cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
        return torch.tensor([t for p in parts for t in p]), torch.cat(positions), cu

    with torch.no_grad():
        ids, pos, cu = pack(seqs, [torch.arange(len(s)) for s in seqs])
        cached = model(ids, pos, cu, max(map(len, seqs)), logits_at=cu[1:].long() - 1, cache=cache)  # prefill
        for step in range(12):
            ids, pos, cu = pack(seqs, [torch.arange(len(s)) for s in seqs])
            full = model(ids, pos, cu, max(map(len, seqs)), logits_at=cu[1:].long() - 1)
            torch.testing.assert_close(cached, full, atol=0 if step == 0 else 3e-5, rtol=0)
            for s, t in zip(seqs, full.argmax(-1).tolist()):
                s.append(t)
            if step == 4:  # a sequence finishes: the others read their own slots, 0, 2 and 3
                cache.rows = torch.tensor([0, 2, 3])
                del seqs[1]
            ids, pos, cu = pack([s[-1:] for s in seqs], [torch.tensor([len(s) - 1]) for s in seqs])
            cached = model(ids, pos, cu, max(map(len, seqs)), logits_at=cu[1:].long() - 1, cache=cache)


def test_sync_ranks_steps_with_the_other_ranks(monkeypatch):
    """Under FSDP every forward is a collective: a rank whose sequences are done keeps stepping (one-token
    dummy forwards) until every rank is; all through the model's forward, where FSDP2's hooks run."""
    model = random_model()
    prompts = [[1, 2, 3], [4, 5]]
    ref = generate(model, prompts, 10)
    stop_ids = [ref[0][1], ref[1][2]]  # this rank is done after 3 steps at the latest
    done_here = generate(model, prompts, 10, stop_ids=stop_ids)
    assert max(map(len, done_here)) <= 3
    other_rank_busy = iter([1] * 7 + [0] * 10)  # another rank still generating for 7 steps

    def all_reduce(busy, op):
        busy.fill_(max(busy.item(), next(other_rank_busy)))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append((len(args[0]), kwargs.get("cache"))),
                                    with_kwargs=True)
    assert generate(model, prompts, 10, stop_ids=stop_ids, sync_ranks=True) == done_here
    assert len(calls) == 7  # one forward per step of the slowest rank
    n_real = max(map(len, done_here))
    assert all(n == 1 and cache is None for n, cache in calls[n_real:])  # the dummy forwards
    assert all(cache is not None for _, cache in calls[:n_real])


def test_system_prompt_for_a_template_without_a_system_role(tmp_path, monkeypatch):
    """sample.py --system with Gemma's template (it raises "System role not supported"): one line that says the
    template has no system role, not a traceback. The script runs as __main__, in this process (its imports loaded)."""
    import json
    import os
    import runpy

    import transformers

    from conftest import ROOT, as_args
    from test_tokenizer import PRE_TOKENIZERS, chat_folder, real_template, train_hf
    pre, norm = PRE_TOKENIZERS["qwen2"]
    trained = {"qwen2": train_hf(tmp_path, "qwen2", pre(), norm(), merges=100)}
    folder = chat_folder(trained, tmp_path / "gemma", real_template("gemma2"), "qwen2", dict(
        bos_token="<bos>", eos_token="<eos>"), ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"])
    vocab = json.loads((folder / "tokenizer.json").read_text())
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=max(t["id"] for t in vocab["added_tokens"]) + 1, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    script = os.path.join(ROOT, "sample.py")
    monkeypatch.setattr("sys.argv", [script, *as_args(model=folder, system="Be brief.", prompt="hi")])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(script, run_name="__main__")
    assert e.value.code == (f'sample.py: the chat template has no system role ({folder}/tokenizer_config.json '
                            f'"chat_template": the template cannot render this conversation: System role not '
                            f'supported); drop --system, or put it in the prompt')
