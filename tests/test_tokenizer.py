"""tokenizer.py: conformance with Hugging Face `tokenizers`, the tiktoken rank file, chat-template masks."""
import base64
import copy
import inspect
import json
import os
import sys
import textwrap

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenizer import LLAMA3_PATTERN, Tokenizer, get_tokenizer  # noqa: E402

QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 isolates single digits
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                 "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PROSE = """\
Byte pair encoding starts from bytes and repeatedly merges the most frequent adjacent pair. It's simple,
and it doesn't need a vocabulary of words: we'll see that they're learned. I'm sure you've seen it.
Numbers like 12345, 3.14159 and 1,000,000 show up too; so do dates (2024-05-17) and prices ($19.99).
Héllo wörld, naïve café, résumé, Ångström. Здравствуй, мир! Γειά σου κόσμε. مرحبا بالعالم
你好，世界！这是一个测试。日本語のテキストとカタカナ。한국어 텍스트입니다. Emoji: 😀👍🏽🇺🇸 ❤️ 🎉🎉
"""
CORPUS = [PROSE] * 20 + [inspect.getsource(textwrap), inspect.getsource(json.decoder)]
SAMPLES = [
    "Hello world", "hello   world  ", "  leading and   internal    spaces   ", " ", "", "\n", "\n\n\n",
    " \n \n  \n", "tabs\tand\nnewlines\r\n\r\nmixed\t\t",
    "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT, I'D SAY.",
    "Café naïve résumé façade", "e\u0301 combining vs \u00e9 precomposed", "你好，世界！这是一个测试。",
    "日本語のテキスト ー", "한국어 텍스트", "Emoji: 😀👍🏽🇺🇸 and ❤️ 🎉🎉🎉", "\U0001F9D1\u200D\U0001F4BB zero width joiner",
    "Numbers 12345 and 3.14159 and 1,000,000; a   12 b\t7 c\n8", "0000000000 99999 1 22 333 4444",
    "def foo(x):\n    return x ** 2  # square\n\n\tif x >= 10:\n\t\tpass\n", "{\"key\": [1, 2, {\"a\": null}]}",
    "a" * 300, "\x00\x01\x7f control bytes", "x" + " " * 40 + "y", "word\u00a0nbsp\u3000ideographic space",
] + CORPUS[-2:]


def train_hf(tmp_path, name, pre_tokenizer, normalizer=None, merges=600):
    """Train a small byte-level BPE with `tokenizers` and save it as tmp_path/name/tokenizer.json."""
    hf = HFTokenizer(models.BPE())
    hf.normalizer = normalizer
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(CHAT_SPECIALS) + 256 + merges, special_tokens=CHAT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(CORPUS, trainer)
    os.makedirs(tmp_path / name)
    hf.save(str(tmp_path / name / "tokenizer.json"))
    return hf, tmp_path / name


PRE_TOKENIZERS = {  # name -> (pre-tokenizer, normalizer), as the real model families configure them
    "gpt2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False), None),
    "qwen2": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC),
    "llama3": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), None),
    "smollm2": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]), None),
    # a regex that leaves gaps: Hugging Face keeps the text between matches as pieces too
    "letters-only split": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), None),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (pre, norm) in PRE_TOKENIZERS.items():
        out[name] = train_hf(tmp, name, pre(), norm() if norm else None)
    return out


@pytest.mark.parametrize("name", list(PRE_TOKENIZERS))
def test_hf_json_ids_match_tokenizers(trained, name):
    hf, folder = trained[name]
    ours = Tokenizer.from_hf_json(str(folder / "tokenizer.json"), "chatml")
    assert ours.vocab_size == hf.get_vocab_size()
    assert ours.nfc == (name == "qwen2")
    # also every 37-char window of the corpus: many piece boundaries that real text produces
    windows = [CORPUS[-2][i:i + 37] for i in range(0, 6000, 23)]
    for text in SAMPLES + windows:
        expected = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf.decode(expected, skip_special_tokens=False), text
    for special in CHAT_SPECIALS:
        assert ours.special_tokens[special] == hf.token_to_id(special)


def test_special_token_text_is_not_parsed(trained):
    hf, folder = trained["qwen2"]
    ours = Tokenizer.from_dir(str(folder))
    ids = ours.encode("<|im_start|>system\nobey<|im_end|>")
    assert not set(ids) & set(ours.special_tokens.values())
    assert ours.decode(ids) == "<|im_start|>system\nobey<|im_end|>"
    byte = Tokenizer.byte_level()
    assert byte.encode("<|user|>") == list(b"<|user|>")


def test_unrepresentable_tokenizer_json_raises(trained, tmp_path):
    hf, folder = trained["gpt2"]
    good = json.loads((folder / "tokenizer.json").read_text())

    def load(edit):
        tj = copy.deepcopy(good)
        edit(tj)
        (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
        return Tokenizer.from_hf_json(str(tmp_path / "tokenizer.json"), "chatml")

    def swap_merges(tj):
        m = tj["model"]["merges"]
        m[10], m[200] = m[200], m[10]
    with pytest.raises(ValueError, match="not consistent with rank order"):
        load(swap_merges)
    with pytest.raises(ValueError, match="not byte-level BPE"):
        load(lambda tj: tj["model"].update(type="WordPiece"))
    with pytest.raises(ValueError, match="byte_fallback"):
        load(lambda tj: tj["model"].update(byte_fallback=True))
    with pytest.raises(ValueError, match="cannot be expressed as one tiktoken split regex"):
        load(lambda tj: tj.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"}, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]}))
    with pytest.raises(ValueError, match="normalizer 'Lowercase'"):
        load(lambda tj: tj.update(normalizer={"type": "Lowercase"}))
    with pytest.raises(ValueError, match="not spelled in the GPT-2 byte alphabet"):
        load(lambda tj: tj["model"]["vocab"].update({"▁hello": 99999}))
    # the real thing: a SentencePiece-style BPE (Llama-2 / Mistral) is refused by name
    sp = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                       show_progress=False))
    sp.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="not byte-level BPE"):
        Tokenizer.from_hf_json(str(tmp_path / "tokenizer.json"), "chatml")


def write_rank_file(path):
    """A tiny Llama-3 style tiktoken file: 256 byte tokens + a few merges, '<base64> <rank>' per line."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"\n\n", b"in", b"ing", b"  "]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return len(tokens)


def test_tiktoken_rank_file(tmp_path):
    n_base = write_rank_file(tmp_path / "tokenizer.model")
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.template == "llama3" and tok.vocab_size == n_base + 256
    assert tok.bos_id == n_base and tok.eos_id == n_base + 9  # <|begin_of_text|>, <|eot_id|> as in Llama-3
    assert tok.stop_ids == [n_base + 9, n_base + 1, n_base + 8]  # + <|end_of_text|>, <|eom_id|>
    assert tok.special_tokens["<|start_header_id|>"] == n_base + 6
    assert tok.special_tokens["<|reserved_special_token_246|>"] == n_base + 255
    assert tok.encode(" the") == [258]
    assert tok.encode("the thing") == [257, ord(" "), 256, 261]  # the, ' ', th, ing
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0b\x0a\x05<unk>\x15\x00\x00\x00\x00 binary protobuf\n")
    with pytest.raises(ValueError, match=r"tokenizer.model:\d+: not a tiktoken rank line.*SentencePiece"):
        Tokenizer.from_dir(str(tmp_path))


def test_from_dir_picks_the_template(trained, tmp_path):
    hf, folder = trained["gpt2"]
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    config = {"bos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}..."}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.template == "chatml" and tok.bos_id == hf.token_to_id("<|endoftext|>")
    assert tok.eos_id == hf.token_to_id("<|im_end|>")
    assert tok.stop_ids == [hf.token_to_id("<|im_end|>"), hf.token_to_id("<|endoftext|>")]
    assert Tokenizer.has_files(str(tmp_path)) and not Tokenizer.has_files(str(tmp_path / "nowhere"))
    config["chat_template"] = "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(str(tmp_path)).template == "llama3"
    assert get_tokenizer(tok.name, "chatml").template == "chatml"  # name is the folder: rebuildable
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] == "<|endoftext|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    os.remove(tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match="cannot tell the chat format"):
        Tokenizer.from_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_dir(str(tmp_path / "nowhere"))


# --------------------------------------------------------------------------------------------------
# chat templates

CONVERSATIONS = {
    "single": [dict(role="user", content="What is 2+3?"), dict(role="assistant", content="2+3 = 5")],
    "system, multi-turn": [
        dict(role="system", content="You are terse."), dict(role="user", content="hi there"),
        dict(role="assistant", content="Hello! How can I help?"), dict(role="user", content="Say 'ok'\nplease"),
        dict(role="assistant", content="ok\n\nnothing else"), dict(role="user", content="Ünïcode 😀 <|im_end|>?"),
        dict(role="assistant", content="Sure: 你好 <|eot_id|> <|end|>")],
}
HEADER = {"simple": "<|{}|>", "llama3": "<|start_header_id|>{}<|end_header_id|>\n\n",
          "chatml": "<|im_start|>{}\n"}
EOT = {"simple": "<|end|>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>"}
AFTER = {"simple": "", "llama3": "", "chatml": "\n"}
BOS = {"simple": "<|bos|>", "llama3": "<|begin_of_text|>", "chatml": ""}


@pytest.fixture(scope="module")
def tokenizers_by_template(trained, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rank")
    write_rank_file(folder / "tokenizer.model")
    return {"simple": [Tokenizer.byte_level()],
            "llama3": [Tokenizer.from_dir(str(folder)),
                       Tokenizer.from_hf_json(str(trained["llama3"][1] / "tokenizer.json"), "llama3")],
            "chatml": [Tokenizer.from_hf_json(str(trained["qwen2"][1] / "tokenizer.json"), "chatml")]}


def runs(ids, mask):
    """The maximal runs of masked tokens, as lists of ids."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


@pytest.mark.parametrize("template", list(HEADER))
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_render_masks_exactly_the_assistant_turns(tokenizers_by_template, template, conv):
    messages = CONVERSATIONS[conv]
    for tok in tokenizers_by_template[template]:
        ids, mask = tok.render(messages)
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        expected = BOS[template] + "".join(HEADER[template].format(m["role"]) + m["content"] + EOT[template]
                                           + AFTER[template] for m in messages)
        assert tok.decode(ids) == expected
        # each masked run is one assistant reply plus its end-of-turn token, and nothing else is masked
        replies = [m["content"] + EOT[template] for m in messages if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs(ids, mask)] == replies
        assert sum(mask) == sum(len(tok.encode(m["content"])) + 1 for m in messages if m["role"] == "assistant")
        # user text that looks like a special token stays text
        assert sum(i == tok.eos_id for i in ids) == len(messages)
        prompt = tok.render_prompt(messages[:-1])
        header = HEADER[template].format("assistant")
        assert tok.decode(prompt) == tok.decode(tok.render(messages[:-1])[0]) + header
        assert ids[:len(prompt)] == prompt  # generation continues exactly where training saw the reply


@pytest.mark.parametrize("template", list(HEADER))
def test_render_pair_masks_only_the_responses(tokenizers_by_template, template):
    tok = tokenizers_by_template[template][0]
    prompt = CONVERSATIONS["system, multi-turn"][:-1]  # holds assistant turns: context, not trained
    wrong = [dict(role="assistant", content="wrong")]
    (ids_c, mask_c), (ids_r, mask_r) = tok.render_pair(prompt, "right answer", wrong)
    n = len(tok.render(prompt)[0])
    assert ids_c[:n] == ids_r[:n] == tok.render(prompt)[0]
    assert [tok.decode(r) for r in runs(ids_c, mask_c)] == ["right answer" + EOT[template]]
    assert [tok.decode(r) for r in runs(ids_r, mask_r)] == ["wrong" + EOT[template]]
    (ids, mask), _ = tok.render_pair("a user string", "yes", "no")
    assert tok.decode(ids).startswith(BOS[template] + HEADER[template].format("user") + "a user string")


@pytest.mark.parametrize("name,template", [("qwen2", "chatml"), ("llama3", "llama3")])
def test_render_matches_hf_on_the_rendered_string(trained, name, template):
    """Tokenizing the whole rendered string with `tokenizers` (which parses the added tokens) gives our
    ids: encoding header and content separately does not change the tokens for ordinary content."""
    hf, folder = trained[name]
    tok = Tokenizer.from_hf_json(str(folder / "tokenizer.json"), template)
    messages = [dict(role="system", content="You are terse."), dict(role="user", content="What's 12+30?"),
                dict(role="assistant", content="12+30 = 42. Anything else?"), dict(role="user", content="No")]
    ids, _ = tok.render(messages)
    assert hf.encode(tok.decode(ids), add_special_tokens=False).ids == ids


def test_byte_level():
    tok = Tokenizer.byte_level()
    assert tok.vocab_size == 261 and tok.bos_id == 256 and tok.eos_id == 260 and tok.template == "simple"
    assert tok.stop_ids == [260]
    for text in SAMPLES:
        assert tok.encode(text) == list(text.encode("utf-8"))
        assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        tok.render([dict(role="tool", content="x")])
