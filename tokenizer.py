"""
Tokenizers (tiktoken underneath) and the chat templates that decide which tokens are trained.

Three ways to get a Tokenizer, all offline:
  Tokenizer.byte_level()    256 byte tokens + 5 chat special tokens: the built-in data and the tests
  Tokenizer.from_dir(path)  a model folder: its Hugging Face tokenizer.json (byte-level BPE: Qwen2.5,
                            SmolLM2, Llama-3 exported) or else its Llama-3 tiktoken file tokenizer.model
  get_tokenizer(spec)       "byte" or a model folder: what `data/prepare.py --tokenizer` takes

render(messages) -> (ids, loss_mask): loss_mask is 1 exactly on the tokens the model must learn to
produce, i.e. every assistant message's content and its end-of-turn token. The bos token, role
headers, system/user turns and the separator after an end-of-turn are 0.

Special tokens are never parsed out of user text: encode("<|im_start|>") gives the plain-text tokens
of those 12 characters, so data cannot inject a turn boundary. Only the templates emit specials.
"""
import base64
import json
import os
import unicodedata

import tiktoken

# bos: prepended once per conversation (None: nothing). header: opens a turn, {role} filled in.
# eot: the end-of-turn special token, trained on assistant turns. after: text following eot, untrained.
TEMPLATES = {
    "simple": dict(bos="<|bos|>", header="<|{role}|>", eot="<|end|>", after=""),
    "llama3": dict(bos="<|begin_of_text|>", header="<|start_header_id|>{role}<|end_header_id|>\n\n",
                   eot="<|eot_id|>", after=""),
    "chatml": dict(bos=None, header="<|im_start|>{role}\n", eot="<|im_end|>", after="\n"),
}
ROLES = ("system", "user", "assistant")
BYTE_SPECIALS = ["<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 256..260

# split regexes (tiktoken's regex dialect, same as the Hugging Face tokenizers one for these)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Llama-3.1's named special tokens; the ids of the ones the template uses are the same in Llama-3.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_NUM_SPECIALS = 256
# what a model may emit to end its output besides the end-of-turn token (a base model's end of text)
END_OF_TEXT = ["<|end_of_text|>", "<|eom_id|>", "<|endoftext|>"]


class Tokenizer:
    """encode/decode plain text, render chats. Attributes: name ("byte" or the model folder),
    template ("simple" | "llama3" | "chatml"), vocab_size, special_tokens {text: id}, eos_id (the
    template's end-of-turn token), stop_ids (eos_id + the model's end-of-text tokens: generation
    stops at any of them), bos_id (None for Qwen-style chatml)."""

    def __init__(self, name, pat_str, mergeable_ranks, special_tokens, template, bos=None, nfc=False):
        if template not in TEMPLATES:
            raise ValueError(f"unknown chat template {template!r}; expected one of {list(TEMPLATES)}")
        t = TEMPLATES[template]
        for s in (t["bos"], t["eot"]):
            if s is not None and s not in special_tokens:
                raise ValueError(f"template {template!r} needs special token {s!r}, which {name} lacks")
        try:
            self.enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                                         special_tokens=special_tokens)
        except ValueError as e:  # the regex did not compile in tiktoken's engine
            raise ValueError(f"{name}: split regex {pat_str!r} is not usable by tiktoken: {e}") from None
        self.name = name  # "byte" or the model folder: get_tokenizer(name, template) rebuilds it
        self.template = template
        self.special_tokens = dict(special_tokens)  # text -> id
        self.vocab_size = self.enc.n_vocab
        self.nfc = nfc  # Qwen2's tokenizer.json NFC-normalizes text before splitting
        self.eos_id = special_tokens[t["eot"]]
        self.stop_ids = [self.eos_id] + [special_tokens[s] for s in END_OF_TEXT if s in special_tokens]
        bos = t["bos"] or bos
        self.bos_id = special_tokens.get(bos) if bos else None
        self._trusted_cache = {}

    def encode(self, text):
        """Plain text -> ids. Special-token text is encoded as ordinary text, never as a special."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")

    def _trusted(self, s):
        # template strings (ours, not the user's) may contain special tokens
        if s not in self._trusted_cache:
            self._trusted_cache[s] = self.enc.encode(s, allowed_special="all") if s else []
        return self._trusted_cache[s]

    def render(self, messages):
        """[{"role", "content"}, ...] -> (ids, loss_mask), two lists of equal length."""
        t = TEMPLATES[self.template]
        ids = self._trusted(t["bos"] or "")[:]
        mask = [0] * len(ids)
        for m in messages:
            if m["role"] not in ROLES:
                raise ValueError(f"unknown role {m['role']!r}; expected one of {ROLES}")
            header = self._trusted(t["header"].format(role=m["role"]))
            body = self.encode(m["content"]) + [self.eos_id]
            after = self._trusted(t["after"])
            trained = int(m["role"] == "assistant")
            ids += header + body + after
            mask += [0] * len(header) + [trained] * len(body) + [0] * len(after)
        return ids, mask

    def render_prompt(self, messages):
        """The ids to feed for generation: the conversation so far + an open assistant header."""
        header = TEMPLATES[self.template]["header"].format(role="assistant")
        return self.render(messages)[0] + self._trusted(header)

    def render_pair(self, prompt, chosen, rejected):
        """DPO: prompt (messages or a user string) + chosen/rejected (a string or a list of assistant
        messages) -> ((ids_chosen, mask_chosen), (ids_rejected, mask_rejected)). The masks cover the
        responses only: assistant turns inside the prompt are context here, not trained."""
        def turns(x, role):
            return [dict(role=role, content=x)] if isinstance(x, str) else list(x)
        prompt = turns(prompt, "user")
        n = len(self.render(prompt)[0])  # a rendering is per-message, so the prompt is a prefix

        def side(response):
            ids, mask = self.render(prompt + turns(response, "assistant"))
            return ids, [0] * n + mask[n:]
        return side(chosen), side(rejected)

    # ----------------------------------------------------------------------------------------------
    # constructors

    @classmethod
    def byte_level(cls):
        ranks = {bytes([b]): b for b in range(256)}
        specials = {s: 256 + i for i, s in enumerate(BYTE_SPECIALS)}
        # with no merges the split regex only bounds the work per piece; any total pattern will do
        return cls("byte", r"\s+|\S+", ranks, specials, "simple")

    @classmethod
    def from_tiktoken_file(cls, path, template="llama3"):
        """A Llama-3 style tokenizer.model: one '<base64 token> <rank>' line per token."""
        ranks = {}
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError:  # also binascii.Error
                    raise ValueError(f"{path}:{lineno}: not a tiktoken rank line '<base64 token> <rank>' "
                                     f"(SentencePiece tokenizer.model files, e.g. Llama-2 or Mistral, are "
                                     f"not supported)") from None
        names = LLAMA3_SPECIALS + [f"<|reserved_special_token_{i}|>"
                                   for i in range(2, 2 + LLAMA3_NUM_SPECIALS - len(LLAMA3_SPECIALS))]
        specials = {s: len(ranks) + i for i, s in enumerate(names)}
        return cls(os.path.dirname(os.path.abspath(path)), LLAMA3_PATTERN, ranks, specials, template)

    @classmethod
    def from_hf_json(cls, path, template=None, chat_template="", bos=None):
        """A Hugging Face tokenizer.json holding a byte-level BPE, converted to tiktoken ranks. Without
        a template, it is guessed from chat_template (the model's Jinja text) or the added tokens."""
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        model = tj.get("model") or {}

        def unsupported(why):
            return ValueError(f"{path}: {why}. nanopack reads only byte-level BPE tokenizers "
                              f"(GPT-2 / Llama-3 / Qwen2 / SmolLM2 style)")
        if model.get("type") != "BPE":
            raise unsupported(f"the model is {model.get('type')!r}, not byte-level BPE")
        if any(model.get(k) for k in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix")):
            raise unsupported("this BPE uses byte_fallback or subword prefixes/suffixes (SentencePiece "
                              "style), not byte-level BPE")
        normalizer = (tj.get("normalizer") or {}).get("type")
        if normalizer not in (None, "NFC"):
            raise unsupported(f"normalizer {normalizer!r} is not supported (only none or NFC)")
        pat_str = split_regex(tj.get("pre_tokenizer"), unsupported)

        # the vocab spells each token's bytes with GPT-2's printable byte-to-unicode alphabet
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        added = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
        ranks = {}
        for token, rank in model["vocab"].items():
            if added.get(token) == rank:
                continue  # an added/special token, kept out of BPE merging
            if any(c not in byte_of for c in token):
                raise unsupported(f"vocab entry {token!r} is not spelled in the GPT-2 byte alphabet")
            ranks[bytes(byte_of[c] for c in token)] = rank
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise unsupported(f"{len(missing)} of the 256 single bytes are missing from the vocab")

        # tiktoken applies, at each step, the merge whose *result* has the lowest id; Hugging Face
        # applies the merge listed first. They agree only if results never go down the merge list.
        prev = -1
        for i, merge in enumerate(model.get("merges", [])):
            a, b = merge.split(" ") if isinstance(merge, str) else merge
            rank = model["vocab"].get(a + b)
            if rank is None or rank < prev:
                raise ValueError(f"{path}: merges are not consistent with rank order (merge #{i} "
                                 f"{a!r} + {b!r} gives id {rank}, after a merge giving id {prev}), so "
                                 f"this BPE cannot be expressed as tiktoken ranks")
            prev = rank
        bpe_ids = set(ranks.values())
        specials = {s: i for s, i in added.items() if i not in bpe_ids}
        template = template or guess_template(chat_template, specials, path)
        return cls(os.path.dirname(os.path.abspath(path)), pat_str, ranks, specials, template, bos=bos,
                   nfc=normalizer == "NFC")

    @staticmethod
    def has_files(path):
        return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model"))

    @classmethod
    def from_dir(cls, path, template=None):
        """A model folder. Prefers tokenizer.json; falls back to a Llama-3 tiktoken tokenizer.model.
        The template is read from tokenizer_config.json / chat_template.jinja unless given."""
        config = {}
        if os.path.exists(os.path.join(path, "tokenizer_config.json")):
            with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        chat_template = config.get("chat_template") or ""
        if isinstance(chat_template, list):  # named templates: [{"name", "template"}, ...]
            chat_template = " ".join(t.get("template", "") for t in chat_template)
        if os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
                chat_template += f.read()
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos

        json_path, model_path = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer.model")
        if os.path.exists(json_path):
            return cls.from_hf_json(json_path, template, chat_template, bos)
        if os.path.exists(model_path):
            return cls.from_tiktoken_file(model_path, template or "llama3")
        raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model in this folder")


def get_tokenizer(spec, template=None):
    """'byte' -> the built-in byte-level tokenizer; anything else is a model folder. A tokenizer's
    .name is such a spec ("byte" or the folder's absolute path), so get_tokenizer(tok.name) rebuilds it."""
    return Tokenizer.byte_level() if spec == "byte" else Tokenizer.from_dir(spec, template)


def guess_template(chat_template, special_tokens, where):
    for text in (chat_template, " ".join(special_tokens)):  # the model's own template wins
        if "<|start_header_id|>" in text:
            return "llama3"
        if "<|im_start|>" in text:
            return "chatml"
    raise ValueError(f"{where}: cannot tell the chat format (no Llama-3 header or <|im_start|> token); "
                     f"pass template= one of {list(TEMPLATES)}")


def split_regex(pre, unsupported):
    """A tokenizer.json pre_tokenizer -> one tiktoken split regex, or raise if there is none."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    kinds = [s.get("type") for s in steps]
    byte_level = steps[-1] if kinds[-1:] == ["ByteLevel"] else None
    if byte_level is None or byte_level.get("add_prefix_space"):
        raise unsupported(f"pre-tokenizer {kinds} does not end in ByteLevel without add_prefix_space")
    use_regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"] and use_regex:  # GPT-2
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not use_regex:  # Llama-3, Qwen2
        split = steps[0]
        pat = split.get("pattern", {}).get("Regex")
        if pat is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise unsupported(f"Split pre-tokenizer {split} is not an isolated, non-inverted regex")
        # Hugging Face keeps the text between matches as its own pieces; tiktoken would drop it,
        # so the second alternative matches such a stretch (a no-op for patterns that cover all text)
        return f"{pat}|(?:(?!(?:{pat}))[\\s\\S])+"
    if kinds == ["Digits", "ByteLevel"] and use_regex:  # SmolLM2, StarCoder
        # Digits first cuts the text around digits, then GPT-2's regex runs on each stretch. As one
        # regex: digits stand alone, and whitespace just before a digit ends its stretch, so it is
        # matched whole (the stretch-end (?!\S) lookahead would otherwise keep its last space back).
        digits = r"\p{N}" if steps[0].get("individual_digits") else r"\p{N}+"
        return GPT2_PATTERN.replace(r" ?\p{N}+", digits).replace(r"\s+(?!\S)", r"\s+(?=\p{N})|\s+(?!\S)")
    raise unsupported(f"pre-tokenizer {kinds} cannot be expressed as one tiktoken split regex")


def bytes_to_unicode():
    """GPT-2's map from each byte to a printable character (how byte-level BPE vocabs are spelled)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:  # control bytes and space move to 256.. so every token prints
            chars[b] = chr(256 + n)
            n += 1
    return chars
