"""model.py against references: Hugging Face transformers logits, per-sequence runs, full-logits cross-entropy.

Tolerances: everything here runs in float32. Two float32 implementations of the same network differ only
by summation order, ~1e-6 relative per op, which stays far below 1e-4 absolute on logits of magnitude ~1-10
through a few layers; the issue fixes 1e-4 for the Hugging Face comparison and we use the same or tighter.
"""

import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import model as M
from model import ModelConfig, Transformer
from nanopack import hf
from nanopack import kernels
from nanopack.hf import from_pretrained, save_pretrained
from conftest import cuda, next_token_targets

transformers = pytest.importorskip("transformers")

LENS = [7, 30, 1, 19, 12]  # packed sequence lengths: includes a length-1 sequence


def packed_inputs(lens, vocab, device="cpu"):
    ids = torch.randint(0, vocab, (sum(lens),), device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    cu = F.pad(torch.tensor(lens, device=device).cumsum(0), (1, 0)).to(torch.int32)
    return ids, pos, cu, max(lens)


HF_COMMON = dict(vocab_size=203, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.2)  # large init: logits of magnitude ~10, so 1e-4 is a real test


def hf_model(kind, **extra):
    torch.manual_seed(1)
    if kind == "llama":  # GQA + Llama-3 rope scaling (original context 16 < our lengths, so scaling acts)
        cfg = transformers.LlamaConfig(**HF_COMMON, rope_theta=500.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16), **extra)
        m = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":  # q/k/v biases, tied embeddings
        cfg = transformers.Qwen2Config(**HF_COMMON, tie_word_embeddings=True, **extra)
        m = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for layer in m.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":  # a sliding window (8) shorter than the sequences, so the window acts
        cfg = transformers.MistralConfig(**HF_COMMON, sliding_window=8, **extra)
        m = transformers.MistralForCausalLM(cfg)
    elif kind in ("qwen3", "qwen3-untied"):  # q/k norms; GQA; head_dim 32, not hidden_size / heads = 16
        cfg = transformers.Qwen3Config(**HF_COMMON, head_dim=32, tie_word_embeddings=kind == "qwen3", **extra)
        m = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises norm weights to one; make the q/k norms' weights matter
            for layer in m.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    elif kind == "smollm3":  # NoPE: layer 1 of 2 skips RoPE; tied embeddings (SmolLM3's default)
        cfg = transformers.SmolLM3Config(**HF_COMMON, no_rope_layers=[1, 0], pad_token_id=None, bos_token_id=None,
                                         eos_token_id=None, **extra)  # its default ids lie past this vocab
        m = transformers.SmolLM3ForCausalLM(cfg)
    return m.float().eval()


def hf_logits(m, ids, lens):
    out, s = [], 0
    with torch.no_grad():
        for n in lens:  # each sequence alone, batch of one: the reference for the packed stream
            out.append(m(ids[None, s:s + n]).logits[0])
            s += n
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "qwen3-untied", "smollm3"])
def test_hf_logits_match_and_round_trip(kind, tmp_path):
    ref = hf_model(kind)
    ref.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(str(tmp_path / "hf")).eval()
    assert ours.config.arch == kind.removesuffix("-untied")
    assert (ours.lm_head is None) == ref.config.tie_word_embeddings
    ids, pos, cu, maxlen = packed_inputs(LENS, 203)
    expected = hf_logits(ref, ids, LENS)
    assert expected.abs().max() > 1.0  # the comparison has teeth
    with torch.no_grad():
        got = ours(ids, pos, cu, maxlen)
    assert got.shape == (sum(LENS), 203)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)

    # our save_pretrained -> transformers loads it with identical logits (sharded, to exercise the index)
    save_pretrained(ours, str(tmp_path / "ours"), max_shard_bytes=100_000)
    assert os.path.exists(tmp_path / "ours" / "model.safetensors.index.json")
    # our config.json carries no token ids yet, and SmolLM3Config's defaults (Llama-3's) lie past this vocab
    ids_kw = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None) if kind == "smollm3" else {}
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), **ids_kw).float().eval()
    assert type(back) is type(ref)
    torch.testing.assert_close(hf_logits(back, ids, LENS), expected, atol=1e-4, rtol=0)
    # ... and so do we, from our own sharded folder
    again = from_pretrained(str(tmp_path / "ours")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids, pos, cu, maxlen), got, atol=0, rtol=0)


def test_hf_loss_matches(tmp_path):
    """model(targets=...) sums the same token cross-entropy that Hugging Face averages over its shifted labels."""
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    ours = from_pretrained(str(tmp_path))
    ids = torch.randint(0, 203, (40,))
    labels = ids.clone()
    labels[:10] = -100  # a prompt
    with torch.no_grad():
        hf_loss = ref(ids[None], labels=labels[None]).loss
        loss_sum, n = ours(ids, targets=F.pad(labels[1:], (0, 1), value=-100))
    assert n.item() == 30  # labels 10..39, each predicted from the position before it
    torch.testing.assert_close(loss_sum / n, hf_loss, atol=1e-5, rtol=0)


def test_unsupported_hf_configs_name_the_key():
    base = json.loads(transformers.LlamaConfig(**HF_COMMON).to_json_string())
    yarn = dict(base, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_parameters.*yarn"):
        hf.config_from_hf(yarn)
    legacy = dict(base, rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0})
    legacy.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="rope_scaling.*dynamic"):
        hf.config_from_hf(legacy)
    qwen = dict(base, model_type="qwen2", use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf.config_from_hf(qwen)
    with pytest.raises(ValueError, match="model_type"):
        hf.config_from_hf(dict(base, model_type="gpt2"))
    # the legacy keys (rope_theta + rope_scaling with 'type') are read like the new ones
    old = dict(base, rope_theta=777.0, rope_scaling={"type": "linear", "factor": 2.0})
    old.pop("rope_parameters", None)
    cfg = hf.config_from_hf(old)
    assert cfg.rope_theta == 777.0 and cfg.rope_scaling == {"factor": 2.0, "rope_type": "linear"}


def test_qwen3_and_smollm3_configs():
    qwen3 = json.loads(transformers.Qwen3Config(**HF_COMMON).to_json_string())
    # Qwen3 configs carry sliding-window fields while it is off: accepted then, an error when on (as Qwen2)
    cfg = hf.config_from_hf(dict(qwen3, use_sliding_window=False, sliding_window=4096))
    assert cfg.arch == "qwen3" and cfg.qk_norm and not cfg.qkv_bias and cfg.sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported: per-layer sliding windows"):
        hf.config_from_hf(dict(qwen3, use_sliding_window=True, sliding_window=64))
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):  # Qwen3's would be on o_proj too
        hf.config_from_hf(dict(qwen3, attention_bias=True))
    smol = json.loads(transformers.SmolLM3Config(**{**HF_COMMON, "num_hidden_layers": 8}, pad_token_id=None,
                                                 bos_token_id=None, eos_token_id=None).to_json_string())
    assert hf.config_from_hf(smol).nope_layers == (3, 7)  # transformers' default: every 4th layer skips RoPE
    del smol["no_rope_layers"]
    assert hf.config_from_hf(dict(smol, no_rope_layer_interval=2)).nope_layers == (1, 3, 5, 7)  # as transformers does
    for bad in ([1, 1, 1], [1, 2, 1, 1, 1, 1, 1, 1], "11101110"):
        with pytest.raises(ValueError, match=re.escape(f"no_rope_layers={bad!r} is not supported: expected a list "
                                                       f"of 8 (num_hidden_layers) 0s and 1s")):
            hf.config_from_hf(dict(smol, no_rope_layers=bad))
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):  # SmolLM3: on NoPE layers
        hf.config_from_hf(dict(smol, use_sliding_window=True, sliding_window=16))
    with pytest.raises(AssertionError, match="qk_norm needs arch='qwen3'"):  # save_pretrained could not write it
        ModelConfig(qk_norm=True)


def test_linear_rope_scaling_matches_hf(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**HF_COMMON, rope_scaling={"rope_type": "linear", "factor": 4.0})
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    ref.save_pretrained(tmp_path)
    ours = from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 203, (50,))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids[None]).logits[0], atol=1e-4, rtol=0)


# -----------------------------------------------------------------------------
# a broken model folder: one ValueError / FileNotFoundError naming the file, the key or tensor, and the fix


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_model("llama").save_pretrained(path)
    return path


CONFIG_MISTAKES = {  # name -> (edit of a transformers-written config.json, what the message must say)
    "missing key": (lambda hf: hf.pop("num_hidden_layers"),
                    "required key 'num_hidden_layers' is missing — the file is incomplete"),
    "string number": (lambda hf: hf.update(num_hidden_layers="2"), "num_hidden_layers='2' must be a positive int"),
    "float for an int": (lambda hf: hf.update(hidden_size=64.0), "hidden_size=64.0 must be a positive int"),
    "string bool": (lambda hf: hf.update(tie_word_embeddings="false"),
                    "tie_word_embeddings='false' must be true or false"),
    "rope key missing": (lambda hf: hf["rope_parameters"].pop("low_freq_factor"),
                         "required key 'rope_parameters.low_freq_factor' is missing"),
    "head counts": (lambda hf: hf.update(num_key_value_heads=3), "n_head=4 must be a multiple of n_kv_head=3"),
}


@pytest.mark.parametrize("case", CONFIG_MISTAKES)
def test_bad_config_json_names_the_file_and_key(llama_dir, tmp_path, case):
    edit, message = CONFIG_MISTAKES[case]
    hf = json.loads((llama_dir / "config.json").read_text())
    edit(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'}: {message}")):
        from_pretrained(str(tmp_path))


def test_missing_or_unparsable_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'config.json'} not found")):
        from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{\n  "model_type": "llama",\n  "vocab_size": 203,,\n}')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'}: not valid JSON (") + r".*line 3 column 21"):  # the 2nd comma
        from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: holds a JSON list, not an object"):
        from_pretrained(str(tmp_path))


def test_truncated_safetensors_and_missing_shard_are_named(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "cut")
    file = tmp_path / "cut" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])  # an interrupted download
    with pytest.raises(ValueError, match=re.escape(f"{file}: incomplete or corrupt safetensors file (") +
                       r".* — re-download or re-export the model"):
        from_pretrained(str(tmp_path / "cut"))
    save_pretrained(tiny(), str(tmp_path / "sharded"), max_shard_bytes=20_000)
    shard = tmp_path / "sharded" / "model-00002-of-00007.safetensors"
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{shard} not found, but ") +
                       r".*model\.safetensors\.index\.json lists it"):
        from_pretrained(str(tmp_path / "sharded"))


def edited_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    """A copy of the folder src with its tensors and/or config.json changed in place."""
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        hf = json.loads((dst / "config.json").read_text())
        edit_config(hf)
        (dst / "config.json").write_text(json.dumps(hf))
    return str(dst)


def test_stray_tensors_are_an_error(llama_dir, tmp_path):
    d = 64  # hidden_size
    bias = edited_checkpoint(llama_dir, tmp_path / "bias", lambda t: t.update(
        {f"model.layers.{i}.self_attn.o_proj.bias": torch.zeros(d) for i in range(2)}))
    with pytest.raises(ValueError, match=re.escape(
            f"{bias}: 2 tensor(s) in the checkpoint are not used by this llama config.json, e.g. "
            f"['model.layers.0.self_attn.o_proj.bias', 'model.layers.1.self_attn.o_proj.bias'] — ")):
        from_pretrained(bias)
    extra = edited_checkpoint(llama_dir, tmp_path / "extra", lambda t: t.update(
        {f"model.layers.{i}.adapter.weight": torch.zeros(2) for i in range(5)}))
    with pytest.raises(ValueError, match=re.escape("5 tensor(s)") + r".*e\.g\. \['model\.layers\.0\.adapter\.weight', "
                       r"'model\.layers\.1\.adapter\.weight', 'model\.layers\.2\.adapter\.weight'\] — "):
        from_pretrained(extra)
    # the embedding has as many rows as vocab_size says, no more and no fewer (the padding is ours to add)
    rows = edited_checkpoint(llama_dir, tmp_path / "rows", edit_config=lambda hf: hf.update(vocab_size=250))
    with pytest.raises(ValueError, match=re.escape(
            f"{rows}: tensor 'model.embed_tokens.weight' has shape (203, 64), config.json implies (250, 64)")):
        from_pretrained(rows)
    # a separate head that is missing
    no_head = edited_checkpoint(llama_dir, tmp_path / "no_head", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=re.escape(
            f"{no_head}: tensor 'lm_head.weight' missing from the checkpoint (config.json says tie_word_embeddings=false)")):
        from_pretrained(no_head)


def test_harmless_extras_load(llama_dir, tmp_path):
    """Old transformers exports hold rotary inv_freq buffers, and tied models may hold a copy of the head."""
    ids = torch.randint(0, 203, (20,))
    with torch.no_grad():
        expected = from_pretrained(str(llama_dir))(ids)
    old = edited_checkpoint(llama_dir, tmp_path / "old", lambda t: t.update({
        "model.rotary_emb.inv_freq": torch.ones(8), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    with torch.no_grad():
        assert torch.equal(from_pretrained(old)(ids), expected)

    hf_model("qwen2").save_pretrained(tmp_path / "qwen2")  # tied: transformers writes no lm_head.weight
    with torch.no_grad():
        expected = from_pretrained(str(tmp_path / "qwen2"))(ids)
    copy = edited_checkpoint(tmp_path / "qwen2", tmp_path / "copy",
                             lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    with torch.no_grad():
        assert torch.equal(from_pretrained(copy)(ids), expected)
    differs = edited_checkpoint(tmp_path / "qwen2", tmp_path / "differs",
                                lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(ValueError, match=re.escape(
            f"{differs}: config.json says tie_word_embeddings=true, but the checkpoint's 'lm_head.weight' "
            f"differs from 'model.embed_tokens.weight'")):
        from_pretrained(differs)


def test_export_is_readable_by_others_and_replaces_an_older_export(tmp_path):
    old_umask = os.umask(0o022)
    try:
        first = tiny()
        save_pretrained(first, str(tmp_path), max_shard_bytes=20_000)  # 7 shards + index
        files = os.listdir(tmp_path)
        assert len(files) == 9 and all(os.stat(tmp_path / f).st_mode & 0o777 == 0o644 for f in files)
        os.umask(0o027)  # the mode follows the umask, also for files that already exist
        second = tiny()
        save_pretrained(second, str(tmp_path))
    finally:
        os.umask(old_umask)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no stale index or shards
    assert all(os.stat(tmp_path / f).st_mode & 0o777 == 0o640 for f in os.listdir(tmp_path))
    loaded = from_pretrained(str(tmp_path))
    for name, p in loaded.named_parameters():  # the second model's weights (the vocab padding is not saved)
        assert torch.equal(p[:100], second.get_parameter(name)[:100])


# -----------------------------------------------------------------------------
# packed == padded, isolation


def tiny(**kw):
    cfg = dict(vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64, max_seq_len=128)
    return Transformer(ModelConfig(**{**cfg, **kw}))


def check_packed_equals_alone(model, device, dtype, atol):
    model = model.to(device=device, dtype=dtype)
    ids, pos, cu, maxlen = packed_inputs(LENS, 100, device)
    logits = model(ids, pos, cu, maxlen)
    alone, s = [], 0
    for n in LENS:
        alone.append(model(ids[s:s + n]))  # plain (T,) call: one sequence
        s += n
    alone = torch.cat(alone)
    torch.testing.assert_close(logits, alone, atol=atol, rtol=0)
    # gradients of the same scalar through both paths
    g = torch.randn_like(logits)
    grads_packed = torch.autograd.grad((logits * g).sum(), list(model.parameters()))
    grads_alone = torch.autograd.grad((alone * g).sum(), list(model.parameters()))
    # bf16 (H200, 2026-11-28): the two paths sum a gradient in different orders, an ulp apart (2^-7 relative)
    rtol = 1e-3 if dtype == torch.float32 else 2 * 2 ** -7
    for a, b in zip(grads_packed, grads_alone):
        torch.testing.assert_close(a, b, atol=atol * 10, rtol=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, dict(qkv_bias=True, tie_embeddings=True), dict(sliding_window=5)])
def test_packed_equals_each_sequence_alone_cpu(kw):
    check_packed_equals_alone(tiny(**kw), "cpu", torch.float32, atol=1e-5)


@cuda
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn", "sdpa"])
def test_packed_equals_each_sequence_alone_cuda(backend, monkeypatch):
    if backend == "flash_attn" and M.flash_attn_varlen_func is None:
        pytest.skip("flash-attn not installed")
    if backend == "torch_varlen" and M.varlen_attn is None:
        pytest.skip("torch.nn.attention.varlen not available")
    monkeypatch.setitem(M._ATTN_BACKEND, "cuda", backend)
    # bf16: each path rounds differently inside the kernels; 2e-2 on logits of magnitude ~1
    check_packed_equals_alone(tiny(sliding_window=9), "cuda", torch.bfloat16, atol=2e-2)


@pytest.mark.slow
def test_changing_a_token_leaves_other_sequences_untouched():
    model = tiny()
    ids, pos, cu, maxlen = packed_inputs(LENS, 100)
    with torch.no_grad():
        before = model(ids, pos, cu, maxlen)
        for i in range(len(LENS)):
            changed = ids.clone()
            s, e = cu[i].item(), cu[i + 1].item()
            changed[s] = (changed[s] + 1) % 100
            after = model(changed, pos, cu, maxlen)
            outside = torch.ones(len(ids), dtype=torch.bool)
            outside[s:e] = False
            assert torch.equal(after[outside], before[outside])  # bit for bit: nothing leaks across
            assert not torch.allclose(after[s:e], before[s:e])  # and the change did reach its own sequence


def test_packed_loss_equals_the_sum_of_sequence_losses():
    """With every token trained, the packer's targets make the packed loss exactly the per-sequence losses:
    the last token of a sequence predicts nothing, so no loss crosses a boundary."""
    from packing import make_batch
    model = tiny()
    ids, pos, cu, maxlen = packed_inputs(LENS, 100)
    data = dict(ids=ids.numpy(), offsets=cu.long().numpy(), loss_mask=torch.ones_like(ids).numpy())
    mb = make_batch(data, list(range(len(LENS))))
    with torch.no_grad():
        loss_sum, n = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, targets=mb.targets)
        ref, count, s = 0.0, 0, 0
        for L in LENS:
            logits = model(ids[s:s + L])
            ref += F.cross_entropy(logits[:-1], ids[s + 1:s + L], reduction="sum")
            count += L - 1
            s += L
    assert n.item() == count
    torch.testing.assert_close(loss_sum, ref, atol=1e-4, rtol=1e-6)


# -----------------------------------------------------------------------------
# chunked LM-head loss and log-probs == full logits


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 8)  # many chunks, including wholly ignored stretches


def head_inputs(T=70, d=16, V=50, Vp=64):
    h = torch.randn(T, d, requires_grad=True)
    w = torch.randn(Vp, d) * 0.5
    w[V:] = 0.0
    w.requires_grad_(True)
    targets = torch.randint(0, V, (T,))
    targets[20:45] = -100  # more than one whole chunk of ignored positions
    targets[::7] = -100
    return h, w, targets, V


def test_chunked_cross_entropy_matches_full_logits(small_chunks):
    h, w, targets, V = head_inputs()
    weights = torch.rand(len(targets))
    for wts in (None, weights):
        loss, n = kernels.chunked_cross_entropy(h, w, targets, V, wts)
        gh, gw = torch.autograd.grad(loss * 1.7, [h, w])  # non-unit upstream gradient
        ce = F.cross_entropy(h @ w[:V].t(), targets, reduction="none", ignore_index=-100)
        ref = ce.sum() if wts is None else (ce * wts).sum()
        rh, rw = torch.autograd.grad(ref * 1.7, [h, w])
        assert n.item() == (targets != -100).sum().item()
        torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-6)
        torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
        assert gw[V:].abs().max() == 0  # the vocab padding rows never receive gradient


# RL scores replies at their sampling temperature
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_full_logits(small_chunks, temperature):
    h, w, targets, V = head_inputs()
    lp = kernels.chunked_logprobs(h, w, targets, V, temperature)
    logits = h @ w[:V].t() / temperature
    full = torch.log_softmax(logits, -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    ref = torch.where(targets == -100, 0.0, full)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-6)
    g = torch.randn_like(lp)
    torch.testing.assert_close(torch.autograd.grad((lp * g).sum(), [h, w]),
                               torch.autograd.grad((ref * g).sum(), [h, w]), atol=1e-5, rtol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_costs_no_head_matmul(small_chunks, monkeypatch):
    """LoRA freezes the head: the chunked loss and log-probs then skip its (V, d) gradient (a float32 V x d buffer, 2
    GiB for Llama-3's head, and one of the chunk's three / four matmuls); h's gradient is unchanged."""
    h, w, targets, V = head_inputs()
    w.requires_grad_(False)
    made = []
    chunk_grads = kernels._chunk_grads
    def spy(*args):  # one call: the chunk's logp is consumed in place
        out = chunk_grads(*args)
        made.append(out[1])
        return out
    monkeypatch.setattr(kernels, "_chunk_grads", spy)
    loss, _ = kernels.chunked_cross_entropy(h, w, targets, V)
    lp = kernels.chunked_logprobs(h, w, targets, V)
    g = torch.randn_like(lp)
    (gh_ce,), (gh_lp,) = torch.autograd.grad(loss, [h]), torch.autograd.grad((lp * g).sum(), [h])
    assert made and all(m is None for m in made)
    ce = F.cross_entropy(h @ w[:V].t(), targets, reduction="sum", ignore_index=-100)
    full = torch.log_softmax(h @ w[:V].t(), -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    ref = torch.where(targets == -100, 0.0, full)
    torch.testing.assert_close(gh_ce, torch.autograd.grad(ce, [h])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh_lp, torch.autograd.grad((ref * g).sum(), [h])[0], atol=1e-5, rtol=1e-5)


def test_all_ignored_targets_give_zero_loss_and_grads(small_chunks):
    h, w, targets, V = head_inputs()
    loss, n = kernels.chunked_cross_entropy(h, w, torch.full_like(targets, -100), V)
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert n.item() == 0 and loss.item() == 0.0 and gh.abs().max() == 0 and gw.abs().max() == 0


def test_vocab_padding_does_not_change_results(small_chunks):
    """The padded head rows are cut off before the softmax: even huge values there change nothing."""
    model = tiny(vocab_size=90)  # padded to 128
    assert model.config.padded_vocab_size == 128
    ids, pos, cu, maxlen = packed_inputs(LENS, 90)
    with torch.no_grad():
        before = model(ids, pos, cu, maxlen, targets=next_token_targets(ids, cu))[0]
        logits_before = model(ids, pos, cu, maxlen)
        model.head_weight()[90:] = 100.0
        after = model(ids, pos, cu, maxlen, targets=next_token_targets(ids, cu))[0]
        logits_after = model(ids, pos, cu, maxlen)
    assert logits_after.shape[-1] == 90
    assert torch.equal(before, after) and torch.equal(logits_before, logits_after)


def test_logprobs_are_scored_at_the_predicting_position():
    model = tiny()
    ids, pos, cu, maxlen = packed_inputs(LENS, 100)
    targets = next_token_targets(ids, cu)
    with torch.no_grad():
        lp = model(ids, pos, cu, maxlen, targets=targets, logprobs=True)
        full = torch.log_softmax(model(ids, pos, cu, maxlen), -1)
        last = model(ids, pos, cu, maxlen, logits_at=cu[1:].long() - 1)  # generation: each sequence's last row
    for t in range(len(ids)):
        expected = 0.0 if targets[t] == -100 else full[t, targets[t]].item()
        assert abs(lp[t].item() - expected) < 1e-5
    torch.testing.assert_close(torch.log_softmax(last, -1), full[cu[1:].long() - 1], atol=1e-6, rtol=0)


def test_autocast_bf16_head_is_close():
    """Under bf16 autocast the head runs in bf16 with float32 softmax: close to float32, not equal."""
    h, w, targets, V = head_inputs()
    ref, _ = kernels.chunked_cross_entropy(h, w, targets, V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = kernels.chunked_cross_entropy(h, w, targets, V)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=0)  # bf16 has 8 mantissa bits: ~0.4% per logit


# -----------------------------------------------------------------------------
# config, FLOPs, training from scratch


QWEN3_0_6B_CONFIG_JSON = {  # Qwen/Qwen3-0.6B's config.json as published
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_presets_have_the_published_shapes():
    with torch.device("meta"):
        sizes = {name: Transformer(M.config_from_preset(name)).num_params() for name in M.PRESETS}
    # parameter counts of the real checkpoints (with vocab padding to 64 added where it applies)
    assert 1.0e6 < sizes["toy"] < 3.0e6
    assert abs(sizes["smollm2-135m"] - 134.5e6) < 1e6
    assert abs(sizes["qwen2.5-0.5b"] - 494.0e6) < 1e6
    assert abs(sizes["llama-3.2-1b"] - 1235.8e6) < 1e6
    assert abs(sizes["llama-3.1-8b"] - 8030.3e6) < 1e6
    assert abs(sizes["llama-3.1-70b"] - 70553.7e6) < 1e6  # Llama-3.1-70B's safetensors index: 141,107,412,992 bytes
    # Qwen3 model cards: 0.6B (0.44B without the embedding), 1.7B (1.4B); exactly, from the published shapes:
    assert sizes["qwen3-0.6b"] == 596_049_920 and sizes["qwen3-1.7b"] == 1_720_574_976
    assert hf.config_from_hf(QWEN3_0_6B_CONFIG_JSON) == M.config_from_preset("qwen3-0.6b")
    for name in ("qwen3-0.6b", "qwen3-1.7b"):  # transformers' own Qwen3 counts the same from our config.json
        cfg = M.config_from_preset(name)
        with torch.device("meta"):
            ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf.config_to_hf(cfg, torch.bfloat16)))
        assert ref.num_parameters() == sizes[name]
    with pytest.raises(ValueError, match="unknown model preset"):
        M.config_from_preset("gpt-5")


def test_flops_per_token_uses_actual_lengths():
    model = tiny()
    cfg = model.config
    # trunk matmuls + the head over the real vocab (padded rows are computed but are not useful work)
    n_matmul = model.num_params() - 2 * model.embed_tokens.weight.numel() + cfg.d_model * cfg.vocab_size
    attn_unit = 6 * cfg.n_layer * cfg.n_head * cfg.head_dim
    lens = [10, 30]
    assert model.flops_per_token(lens) == pytest.approx(6 * n_matmul + attn_unit * (100 + 900) / 40)
    # padding both to 30 would claim more attention work than was done
    assert model.flops_per_token([30, 30]) > model.flops_per_token(lens)
    head = cfg.d_model * cfg.vocab_size
    assert model.flops_per_token(lens, head_tokens=20) == pytest.approx(
        model.flops_per_token(lens) - 6 * head * 0.5)


def test_too_long_sequence_is_a_clear_error():
    model = tiny(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(20, dtype=torch.long))


@pytest.mark.slow
def test_toy_preset_learns_from_scratch():
    torch.manual_seed(0)
    model = Transformer(M.config_from_preset("toy", n_layer=2))
    lens = [40, 64, 23, 80]
    ids = torch.cat([(torch.arange(n) * 3 + 7 * i) % 100 for i, n in enumerate(lens)])  # arithmetic runs
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss_sum, n = model(ids, pos, cu, max(lens), targets=next_token_targets(ids, cu))
        loss = loss_sum / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(6.24, abs=0.2)  # ~log(512): a sane init predicts near-uniform
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_gradients():
    model = tiny()
    ids, pos, cu, maxlen = packed_inputs(LENS, 100)
    grads = []
    for flag in (False, True):
        model.activation_checkpointing = flag
        loss, n = model(ids, pos, cu, maxlen, targets=next_token_targets(ids, cu))
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # same ops recomputed: rounding-level only
