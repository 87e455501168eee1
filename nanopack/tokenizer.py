"""
Tokenizers, tiktoken underneath. Three ways to get one, all offline:
  Tokenizer.byte_level()    256 byte tokens + 5 chat special tokens: the built-in data and the tests
  Tokenizer.from_dir(path)  a model folder: its Hugging Face tokenizer.json (byte-level BPE:
                            Qwen2/2.5/3, SmolLM2, Llama-3 exported) or else its Llama-3 tiktoken
                            tokenizer.model, and its own chat template
  get_tokenizer(spec)       "byte" or a model folder: what `data/prepare.py --tokenizer` takes

render(messages) -> (ids, loss_mask), the mask by chat_template.py's rule. A model's own template:
the rendered text cut at every added token, wherever it stands, and the pieces between encoded:
apply_chat_template's ids (so <think> and <tool_call> written in a message are their single ids).
configure_chat(escape_special_text=True): special-token text in messages that the template does not
parse stays plain text, so data cannot inject a turn boundary.
"""
import base64
import itertools
import json
import os
import re
import unicodedata

import regex  # tiktoken's own dependency; the same split regexes, for text with unspellable bytes
import tiktoken

from nanopack.bpe import bytes_to_unicode, split_regex
from nanopack.chat_template import (REASONING_FIELDS, ROLES, TEMPLATES, ChatTemplate,
                                    guess_template, map_values, read_chat_template, token_text)

BYTE_SPECIALS = ["<|bos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 256..260
# Llama-3's split regex (tiktoken's regex dialect, same as the Hugging Face tokenizers one)
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Llama-3.1's named special tokens; the ids of the ones the template uses are the same in Llama-3.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                   "<|python_tag|>"]
LLAMA3_NUM_SPECIALS = 256
# what a model may emit to end its output besides the end-of-turn token (a base model's end of text)
END_OF_TEXT = ["<|end_of_text|>", "<|eom_id|>", "<|endoftext|>"]


def reasoning_of(message):
    """A message's reasoning: its reasoning field, else what its content has before </think>
    (DeepSeek-R1's form)."""
    field = next((message[k] for k in REASONING_FIELDS if isinstance(message.get(k), str)), None)
    content = message.get("content")
    if field is None and isinstance(content, str) and "</think>" in content:
        return content.split("</think>")[0].replace("<think>", "")
    return field or ""


class Tokenizer:
    """encode/decode plain text, render chats. template: a TEMPLATES name or "model" (the folder's
    own); eos_id: the template's end-of-turn token; stop_ids: it and the model's end-of-text tokens;
    bos_id: None for Qwen's chatml."""

    def __init__(self, name, pat_str, mergeable_ranks, special_tokens, template, bos=None,
                 nfc=False,
                 unk=None, fuse_unk=False, chat_template=None):
        """chat_template: (jinja source, variables, where) of the folder's own template, for
        "model"."""
        try:
            self.enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                                         special_tokens=special_tokens)
        except ValueError as e:  # the regex did not compile in tiktoken's engine
            raise ValueError(f"{name}: split regex {pat_str!r} is not usable by tiktoken: "
                             f"{e}") from None
        self.name = name  # "byte" or the model folder: get_tokenizer(name, template) rebuilds it
        self.template = template
        self.special_tokens = dict(special_tokens)  # text -> id
        self.vocab_size = self.enc.n_vocab
        self.nfc = nfc  # Qwen2's tokenizer.json NFC-normalizes text before splitting
        # tokenizers finds added tokens in text leftmost-longest; so does this alternation, longest
        # first
        longest_first = sorted(special_tokens, key=len, reverse=True)
        # (?!): no match
        self._special_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        # runs of them: _missing_re
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        self._missing_re = None
        if missing:
            self._missing_re = re.compile(b"([%s]+)" % b"".join(b"\\x%02x" % b for b in missing))
        # tiktoken's split, for that text
        self._split_re = regex.compile(pat_str) if missing else None
        # what tokenizers emits for a byte it cannot spell
        self.unk_id, self.fuse_unk = unk, fuse_unk
        self._trusted_cache = {}
        self.chat_template_kwargs, self.escape_special_text = {}, False
        # trained assistant turns whose reasoning a rendering leaves out
        self.reasoning_unwritten = 0
        if template == "model":
            if chat_template is None:
                raise ValueError(f"{name}: template 'model' asks for the folder's own chat "
                                 "template, and it has none (no chat_template.jinja, no "
                                 "\"chat_template\" in tokenizer_config.json)")
            self.chat_template = ChatTemplate(*chat_template)
            self.template_id = self.chat_template.id
            self.eos_id = special_tokens[self.chat_template.end_of_turn(self._special_re)]
        elif template in TEMPLATES:
            self.template_id = template
            t = TEMPLATES[template]
            for s in (t["bos"], t["eot"]):
                if s is not None and s not in special_tokens:
                    raise ValueError(f"template {template!r} needs special token {s!r}, which "
                                     f"{name} lacks")
            self.eos_id = special_tokens[t["eot"]]
            bos = t["bos"] or bos
        else:
            raise ValueError(f"unknown chat template {template!r}; expected 'model' (the folder's "
                             f"own) or one of {list(TEMPLATES)}")
        self.stop_ids = [self.eos_id] + [special_tokens[s] for s in END_OF_TEXT
                                         if s in special_tokens
                                         and special_tokens[s] != self.eos_id]
        # what ends a reply
        self._stop_texts = {s for s, i in special_tokens.items() if i in self.stop_ids}
        self.bos_id = special_tokens.get(bos) if bos else None

    # plain text -----------------------------------------------------------------------------------
    def encode(self, text):
        """Plain text -> ids. Special-token text is encoded as ordinary text, never as a special."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        data = utf8(text)
        if self._missing_re is None or not self._missing_re.search(data):
            return self.enc.encode_ordinary(text)
        pieces = self._split_re.findall(data.decode())  # as tiktoken would cut the text
        return [t for piece in pieces for t in self._encode_piece(piece.encode())]

    def _encode_piece(self, piece):
        """A piece holding bytes the vocab lacks (SmolLM2 lacks 21), as tokenizers does it: the
        bytes dropped, the rest merged as one word; with an unk token, each byte (each run with
        fuse_unk) is unk, the parts between merged."""
        parts = self._missing_re.split(piece)  # kept, missing run, kept, ..., kept
        if self.unk_id is None:
            kept = b"".join(parts[0::2])
            return self.enc._encode_single_piece(kept) if kept else []  # BPE of one piece, no split
        ids = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += [self.unk_id] * (1 if self.fuse_unk else len(part))
            elif part:
                ids += self.enc._encode_single_piece(part)
        return ids

    def _spelled(self, text):
        """How many bytes the tokens of encode(text) spell (a dropped byte 0, an unk token 1)."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        data = utf8(text)
        if self._missing_re is None:
            return len(data)
        parts = self._missing_re.split(data)
        dropped = [0 if self.unk_id is None else 1 if self.fuse_unk else len(p)
                   for p in parts[1::2]]
        return sum(map(len, parts[0::2])) + sum(dropped)

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")

    def decode_reply(self, ids):
        """A generated reply as text, without the stop token that ended it."""
        return self.decode([t for t in ids if t not in self.stop_ids])

    # chats ----------------------------------------------------------------------------------------
    def configure_chat(self, chat_template_kwargs=None, escape_special_text=False):
        """Settings of every chat rendered, part of template_id (so of prepared data and caches):
        chat_template_kwargs as apply_chat_template(**kwargs) passes them; escape_special_text (see
        the module docstring)."""
        kwargs = dict(chat_template_kwargs or {})
        if self.template == "model":
            self.chat_template.check([], None, kwargs, None)
        elif kwargs or escape_special_text:
            raise ValueError(f"the built-in {self.template!r} chat format reads no "
                             "chat_template_kwargs and parses no special-token text; use a model "
                             "folder with its own chat template")
        self.chat_template_kwargs, self.escape_special_text = kwargs, escape_special_text
        self.template_id = self.template_id.split("+")[0] + "".join(
            ["+" + json.dumps(kwargs, sort_keys=True)] * bool(kwargs)
            + ["+escaped"] * escape_special_text)
        return self

    def render(self, messages, add_generation_prompt=False, trained_from=0, tools=None, **kwargs):
        """[{"role", "content", ...}, ...] -> (ids, loss_mask), assistant messages from index
        trained_from on trained (but those with OpenAI's "weight": 0); tools and kwargs (over
        chat_template_kwargs) reach the template as apply_chat_template passes them."""
        kwargs, (messages, trained) = {**self.chat_template_kwargs, **kwargs}, weighed(messages,
                                                                                       trained_from)
        if self.template == "model":
            return self._render_model(messages, add_generation_prompt, trained, tools, kwargs)
        extra = ([f"messages[{i}].{k}" for i, m in enumerate(messages) for k in m
                  if k not in ("role", "content")]
                 + [f"messages[{i}].role {m['role']!r}" for i, m in enumerate(messages)
                    if m["role"] not in ROLES[:3]]
                 + ["tools"] * bool(tools) + [f"chat_template_kwargs {k!r}" for k in kwargs])
        if extra:
            raise ValueError(f"{extra[0]}: the built-in {self.template!r} chat format renders only "
                             "the role and content of system, user and assistant messages; use a "
                             "model folder's chat template")
        t = TEMPLATES[self.template]
        ids = self._trusted(t["bos"] or "")[:]
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            header = self._trusted(t["header"].format(role=m["role"]))
            body = self.encode(m["content"]) + [self.eos_id]
            after = self._trusted(t["after"])
            trains = int(i in trained)
            ids += header + body + after
            mask += [0] * len(header) + [trains] * len(body) + [0] * len(after)
        if add_generation_prompt:
            header = self._trusted(t["header"].format(role="assistant"))
            ids, mask = ids + header, mask + [0] * len(header)
        return ids, mask

    def render_prompt(self, messages, **options):
        """The ids to feed for generation: the conversation so far + an open assistant turn."""
        return self.render(messages, add_generation_prompt=True, **options)[0]

    def render_pair(self, prompt, chosen, rejected, **options):
        """DPO: prompt (messages or a user string) + chosen/rejected (a string or a list of
        assistant messages) -> ((ids, mask) of chosen, (ids, mask) of rejected); only the responses
        are trained, the prompt is context."""
        def turns(x, role):
            return [dict(role=role, content=x)] if isinstance(x, str) else list(x)
        prompt, sides = turns(prompt, "user"), []
        for name, response in (("chosen", chosen), ("rejected", rejected)):
            sides.append(self.render(prompt + turns(response, "assistant"),
                                     trained_from=len(prompt), **options))
            if not any(sides[-1][1]):
                raise ValueError(f"the {name} reply has no trained token (its assistant turns have "
                                 "weight 0, or the template writes none of them), so the pair "
                                 "compares nothing")
        return tuple(sides)

    def render_turns(self, messages, tools=None, **kwargs):
        """reasoning_turns='each' -> [(ids, mask)]: an assistant turn the whole conversation renders
        otherwise (Qwen3 drops earlier reasoning) is its prefix, only it trained; the whole
        conversation trains the others (if any)."""
        if self.template != "model":
            return [self.render(messages, tools=tools, **kwargs)]
        kwargs, ct, (messages, trained) = {**self.chat_template_kwargs,
                                           **kwargs}, self.chat_template, weighed(messages)
        try:
            text = ct.render(messages, False, tools, kwargs)
            own = [i for i in trained
                   if not text.startswith(ct.render(messages[:i + 1], False, tools, kwargs))]
        except ValueError:
            # the fields' error first, as render's
            self._render_model(messages, False, trained, tools, kwargs)
            raise
        rest = [i for i in trained if i not in own]
        # checks the fields first
        whole = [self._render_model(messages, False, rest, tools, kwargs)]
        each = [self._render_model(messages[:i + 1], False, [i], tools, kwargs, check=False)
                for i in own]
        return each + whole * (len(rest) > 0)

    def _trusted(self, s):
        # built-in template strings (ours, not the user's) may contain special tokens
        if s not in self._trusted_cache:
            self._trusted_cache[s] = self.enc.encode(s, allowed_special="all") if s else []
        return self._trusted_cache[s]

    def _render_model(self, messages, add_generation_prompt, trained, tools, kwargs, check=True):
        """The text transformers renders, tokenized as transformers does; trained: message indices.
        escape_special_text: special-token text whose wrapping in private-use characters leaves the
        rendering unchanged is wrapped."""
        ct = self.chat_template
        seen = json.dumps([messages, tools], ensure_ascii=False, default=str) + ct.source
        used = set(re.findall("[\ue000-\uf8ff]", seen))
        # characters the data lacks
        free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
        if check:
            ct.check(messages, tools, kwargs, free)
        left, right, mark = itertools.islice(free, 3)
        args, blocks = (add_generation_prompt, tools, kwargs), []
        text = ct.render(messages, *args, blocks)
        plain = re.sub(r"\s+", "", text)  # templates strip and indent; the words stay
        self.reasoning_unwritten += sum(re.sub(r"\s+", "", r) not in plain for r in (
            reasoning_of(messages[i]) for i in trained if messages[i]["role"] == "assistant") if r)
        if self.escape_special_text:
            whole, escaped = re.compile(f"{left}({self._special_re.pattern}){right}"), []

            def wrap(path, s):
                return self._special_re.sub(lambda t: left + t[0] + right if t[0] in escaped
                                            else t[0], s) \
                    if isinstance(s, str) else s
            written = json.dumps(messages, ensure_ascii=False, default=str)
            for token in sorted(set(self._special_re.findall(written))):
                escaped.append(token)
                if whole.sub(lambda t: t[1], ct.render(map_values(messages, wrap), *args)) != text:
                    # the template parses it: it stays a special token, as in transformers
                    escaped.pop()
            messages, blocks = map_values(messages, wrap), []
            text = ct.render(messages, *args, blocks)
        ranges = ct.reply_spans(text, messages, trained, args, mark, self._special_re,
                                self._stop_texts)
        pieces = self._pieces(text, left, right)
        # the template's own {% generation %} blocks: those of the trained replies
        if ct.marks_replies:
            ranges = [(a, b) for a, b in blocks if any(a < e and s < b for s, e in ranges)]
        ids, mask = [], []
        for a, b, special in pieces:
            if special is not None:
                ids.append(special)
                mask.append(int(any(s <= a and b <= e for s, e in ranges)))
            elif a < b:
                piece_ids = self.encode(text[a:b])
                ids += piece_ids
                inside = [(s - a, e - a) for s, e in ranges if s < b and e > a]
                mask += self._overlaps(text[a:b], piece_ids, inside)
        return ids, mask

    def _pieces(self, text, left, right):
        """How transformers cuts a rendered chat before encoding each piece -> [(start, end, special
        id or None)]: at each special token, and around escaped special-token text (marked
        left...right), a piece of plain text."""
        pieces, pos = [], 0
        for m in itertools.chain(re.finditer(f"{left}({self._special_re.pattern}){right}", text),
                                 [None]):
            stop = m.start() if m else len(text)
            for t in self._special_re.finditer(text, pos, stop):
                pieces += [(pos, t.start(), None), (t.start(), t.end(), self.special_tokens[t[0]])]
                pos = t.end()
            pieces += [(pos, stop, None)] + ([(m.start(1), m.end(1), None)] if m else [])
            pos = m.end() if m else stop
        return pieces

    def _overlaps(self, seg, ids, ranges):
        """1 for each token of ids = encode(seg) that holds a character of one of ranges (char
        offsets)."""
        if not ranges or any(s <= 0 and len(seg) <= e for s, e in ranges):  # none, or all of it
            return [int(bool(ranges))] * len(ids)
        sizes = [1 if t == self.unk_id else len(b)
                 for t, b in zip(ids, self.enc.decode_tokens_bytes(ids))]
        ends = list(itertools.accumulate(sizes))
        at = [(self._spelled(seg[:max(s, 0)]), self._spelled(seg[:e])) for s, e in ranges]
        return [int(any(a < end and end - size < b for a, b in at))
                for size, end in zip(sizes, ends)]

    # constructors ---------------------------------------------------------------------------------
    @classmethod
    def byte_level(cls):
        ranks = {bytes([b]): b for b in range(256)}
        specials = {s: 256 + i for i, s in enumerate(BYTE_SPECIALS)}
        # with no merges the split regex only bounds the work per piece; any total pattern will do
        return cls("byte", r"\s+|\S+", ranks, specials, "simple")

    @classmethod
    def from_tiktoken_file(cls, path, template="llama3", chat_template=None):
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
                    raise ValueError(f"{path}:{lineno}: not a tiktoken rank line '<base64 token> "
                                     "<rank>' (SentencePiece tokenizer.model files, e.g. Llama-2 "
                                     "or Mistral, are not supported)") from None
        reserved = range(2, 2 + LLAMA3_NUM_SPECIALS - len(LLAMA3_SPECIALS))
        names = LLAMA3_SPECIALS + [f"<|reserved_special_token_{i}|>" for i in reserved]
        specials = {s: len(ranks) + i for i, s in enumerate(names)}
        return cls(os.path.dirname(os.path.abspath(path)), LLAMA3_PATTERN, ranks, specials,
                   template,
                   bos="<|begin_of_text|>", chat_template=chat_template)

    @classmethod
    def from_hf_json(cls, path, template=None, chat_template=None, bos=None):
        """A Hugging Face tokenizer.json holding a byte-level BPE, as tiktoken ranks. template None
        (or "model"): the folder's own chat_template (read_chat_template's tuple) if given, else a
        format guessed from added tokens."""
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        model = tj.get("model") or {}

        def unsupported(key, why):
            return ValueError(f"{path}: {key} {why}; nanopack reads only byte-level BPE tokenizers "
                              f"(GPT-2 / Llama-3 / Qwen2 / SmolLM2 style)")
        if model.get("type") != "BPE":
            raise unsupported("model.type", f"is {model.get('type')!r}, not byte-level BPE")
        for key in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
            if model.get(key):  # SentencePiece-style BPE, or random merges (dropout)
                raise unsupported(f"model.{key}", f"is {model[key]!r}: not a plain byte-level BPE")
        normalizer = (tj.get("normalizer") or {}).get("type")
        if normalizer not in (None, "NFC"):
            raise unsupported("normalizer", f"{normalizer!r} is not supported (only none or NFC)")
        pat_str = split_regex(tj.get("pre_tokenizer"), unsupported)
        added = {}
        for t in tj.get("added_tokens", []):
            flags = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)]
            if flags:  # these change how tokenizers cuts text around the token
                raise unsupported("added_tokens",
                                  f"entry {t['content']!r} sets {flags[0]}, not supported")
            added[t["content"]] = t["id"]

        # the vocab spells each token's bytes with GPT-2's printable byte-to-unicode alphabet
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        ranks = {}
        for token, rank in model["vocab"].items():
            if added.get(token) == rank:
                continue  # an added/special token, kept out of BPE merging
            if any(c not in byte_of for c in token):
                raise unsupported("model.vocab",
                                  f"entry {token!r} is not spelled in the GPT-2 byte alphabet")
            ranks[bytes(byte_of[c] for c in token)] = rank
        unk = model.get("unk_token")
        if unk is not None and unk not in model["vocab"] and any(bytes([b]) not in ranks
                                                                 for b in range(256)):
            raise unsupported("model.unk_token",
                              f"{unk!r} is not in the vocab, and missing bytes need it")

        # tiktoken applies, at each step, the merge whose *result* has the lowest id; Hugging Face
        # applies the merge listed first. They agree only if results never go down the merge list.
        prev = -1
        for i, merge in enumerate(model.get("merges", [])):
            a, b = merge.split(" ") if isinstance(merge, str) else merge
            rank = model["vocab"].get(a + b)
            if rank is None or rank < prev:
                raise ValueError(f"{path}: model.merges are not consistent with rank order (merge "
                                 f"#{i} {a!r} + {b!r} gives id {rank}, after a merge giving id "
                                 f"{prev}), so this BPE cannot be expressed as tiktoken ranks")
            prev = rank
        bpe_ids = set(ranks.values())
        specials = {s: i for s, i in added.items() if i not in bpe_ids}
        if template is None:
            template = "model" if chat_template else guess_template(specials, path)
        return cls(os.path.dirname(os.path.abspath(path)), pat_str, ranks, specials, template,
                   bos=bos,
                   nfc=normalizer == "NFC", unk=model["vocab"].get(unk) if unk is not None
                   else None,
                   fuse_unk=bool(model.get("fuse_unk")), chat_template=chat_template)

    @staticmethod
    def has_files(path):
        return any(os.path.exists(os.path.join(path, f))
                   for f in ("tokenizer.json", "tokenizer.model"))

    @classmethod
    def from_dir(cls, path, template=None):
        """A model folder's tokenizer.json, else its Llama-3 tokenizer.model; template None: its
        own, else guessed."""
        config_path = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        chat_template = read_chat_template(path, config)
        bos = token_text(config.get("bos_token"))

        json_path = os.path.join(path, "tokenizer.json")
        model_path = os.path.join(path, "tokenizer.model")
        if os.path.exists(json_path):
            return cls.from_hf_json(json_path, template, chat_template, bos)
        if os.path.exists(model_path):
            template = template or ("model" if chat_template else "llama3")
            return cls.from_tiktoken_file(model_path, template, chat_template)
        raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model in this folder")


def weighed(messages, trained_from=0):
    """OpenAI's fine-tuning "weight" on assistant messages (0: shown, not trained; 1: trained) ->
    (the messages without it, the indices of the assistant messages trained: from trained_from on,
    weight 0 left out)."""
    for i, m in enumerate(messages):
        weight = m.get("weight", 0)
        problem = (None if "weight" not in m else
                   f"is on a {m['role']!r} message: only assistant messages take a weight, the "
                   "others are never trained — drop it" if m["role"] != "assistant" else
                   f"is {weight!r}: OpenAI's weight is 0 (the reply is shown, not trained) or 1 "
                   "(trained) — fix the value" if type(weight) is not int or weight not in (0, 1)
                   else
                   "is 1, and the message is in the prompt here (DPO trains the chosen and "
                   "rejected replies only) — set it to 0 or drop it" if weight and i < trained_from
                   else None)
        if problem:
            raise ValueError(f"messages[{i}].weight {problem}")
    trained = [i for i, m in enumerate(messages)
               if m["role"] == "assistant" and m.get("weight", 1) and i >= trained_from]
    return [{k: v for k, v in m.items() if k != "weight"} for m in messages], trained


def get_tokenizer(spec, template=None, **chat):
    """'byte' -> the built-in byte-level tokenizer; anything else is a model folder. A tokenizer's
    .name is such a spec ("byte" or the folder's absolute path), so get_tokenizer(tok.name) rebuilds
    it. chat: configure_chat's."""
    tok = Tokenizer.byte_level() if spec == "byte" else Tokenizer.from_dir(spec, template)
    return tok.configure_chat(**chat) if chat else tok


def utf8(text):
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken's encode does
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
