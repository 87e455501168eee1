"""
Chat templates: the text a conversation becomes, and which of it is trained.

A folder's own template (chat_template.jinja, else tokenizer_config.json "chat_template") is
compiled and rendered as transformers does, messages, tools and chat_template_kwargs passed as
apply_chat_template passes them. Without one (and for the byte-level tokenizer) a built-in format is
used (TEMPLATES). Trained (loss mask 1): each assistant turn as the template writes it, from where
its prompt ends (the conversation before it, then the generation header) through the stop token that
ends it, reasoning and tool calls included. All else is 0: bos, headers, default system prompts,
system, user and tool turns. A template with {% generation %} blocks says itself what is trained.
"""
import hashlib
import itertools
import json
import os
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# bos: prepended once per conversation (None: nothing). header: opens a turn, {role} filled in.
# eot: the end-of-turn special token, trained on assistant turns. after: text following eot,
# untrained.
TEMPLATES = {
    "simple": dict(bos="<|bos|>", header="<|{role}|>", eot="<|end|>", after=""),
    "llama3": dict(bos="<|begin_of_text|>", header="<|start_header_id|>{role}<|end_header_id|>\n\n",
                   eot="<|eot_id|>", after=""),
    "chatml": dict(bos=None, header="<|im_start|>{role}\n", eot="<|im_end|>", after="\n"),
}
ROLES = ("system", "user", "assistant", "tool", "ipython")  # built-in formats: the first three
# the names transformers passes reasoning under
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# noncharacters (Unicode keeps them for internal use) around a generation block
GENERATION = ("\ufdd0", "\ufdd1")
# fields a template may leave out: names and ids, not text to train on
UNCHECKED = re.compile(r"^\[\d+\]\.(role|name|tool_call_id|id)$|\.tool_calls\[\d+\]\.(id|type)$")
# the variables transformers passes every chat template (its special_tokens_map)
TEMPLATE_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


def read_chat_template(folder, config):
    """The folder's own chat template as transformers picks it -> (source, special-token variables,
    where) or None."""
    where = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(where):
        with open(where, encoding="utf-8") as f:
            source = f.read()
    else:
        where = os.path.join(folder, "tokenizer_config.json") + ' "chat_template"'
        source = config.get("chat_template") or None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(f"{where}: named templates {sorted(map(str, named))} and none "
                                 "called 'default', so it is not clear which one to use")
            source = named["default"]
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{where}: a {type(source).__name__}, not a template string or a list "
                             "of named templates")
    variables = {k: token_text(config[k]) for k in TEMPLATE_VARIABLES if config.get(k) is not None}
    return source, variables, where


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (TRL's mark on assistant text): its body between
    GENERATION marks."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        opening, closing = (jinja2.nodes.Output([jinja2.nodes.TemplateData(mark)])
                            for mark in GENERATION)
        return [opening, *body, closing]


def compile_chat_template(source, where):
    """A template compiled as transformers' chat_template_utils.py does: a sandbox with its settings
    and helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        # also an unknown tag or filter: a feature we do not provide
        raise ValueError(f"{where}: line {e.lineno}: {' '.join(str(e.message).split())} (nanopack "
                         "compiles templates as transformers does: jinja2 with loopcontrols, "
                         "tojson, raise_exception, strftime_now)") from None


class ChatTemplate:
    """A folder's own template (read_chat_template's tuple): compiled, rendered, searched for the
    replies it writes."""

    def __init__(self, source, variables, where):
        self.source, self.variables, self.where = source, variables, where
        self.jinja = compile_chat_template(source, where)
        # its variables
        self.reads = jinja2.meta.find_undeclared_variables(self.jinja.environment.parse(source))
        # as transformers tells
        self.marks_replies = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
        self.headers, self.eot = {}, None  # generation_header's, by kwargs; end_of_turn's
        # caches of tokenized data and reference log-probs are keyed by the template's text, not its
        # name
        key = json.dumps([source, variables], sort_keys=True, default=str)
        digest = hashlib.sha256(key.encode()).hexdigest()
        self.id = f"model-{digest[:12]}"

    def render(self, messages, add_generation_prompt=False, tools=None, kwargs=None, blocks=None,
               read=None):
        """The text apply_chat_template renders; blocks: a list to append each generation block's
        (start, end) to; read: a set to add the path of each message field the template reads to
        ("[1].weight")."""
        messages = [aliased(m) for m in messages]
        messages = messages if read is None else [ReadLog.of(m, read, f"[{i}]")
                                                  for i, m in enumerate(messages)]
        try:
            text = self.jinja.render(messages=messages, tools=tools, documents=None, **{
                **self.variables, **(kwargs or {}), "add_generation_prompt": add_generation_prompt})
        except (jinja2.TemplateError, TypeError) as e:
            # raise_exception(...), an undefined name, a dict + a string
            raise ValueError(f"{self.where}: the template cannot render this conversation: "
                             f"{' '.join(str(e).split())}") from None
        parts = re.split(f"[{''.join(GENERATION)}]", text)  # outside a block, inside, outside, ...
        ends = list(itertools.accumulate(map(len, parts)))
        if blocks is not None:
            blocks += [(ends[i - 1], ends[i]) for i in range(1, len(parts), 2)]
        return "".join(parts)

    def check(self, messages, tools, kwargs, free):
        """Refuse a variable the template never reads, or a message field it does not use: a string
        replaced by a character the data lacks (from `free`) must appear in the rendering, an
        assistant turn's in the conversation up to it (Qwen3 leaves earlier turns' reasoning out of
        the history); a number or bool (OpenAI's weight: 0) must be read, if only as a condition. An
        empty string, list or dict holds nothing to lose."""
        unread = [name for name in [*kwargs, *["tools"] * bool(tools)] if name not in self.reads]
        if unread:
            raise ValueError(f"{self.where}: the template reads no variable {unread[0]!r} (it "
                             f"reads {', '.join(sorted(self.reads))}); drop it from tools / "
                             "chat_template_kwargs")
        marks, values = {}, {}

        def marked_value(path, x):
            if isinstance(x, str) and x and not UNCHECKED.search(path):
                return marks.setdefault(path, next(free))
            if not isinstance(x, str):
                values[path] = x
            return x
        marked = map_values(messages, marked_value)
        if not marks and not values:  # configure_chat's check of the variables alone
            return
        read = set() if values else None  # logging the keys read costs a tenth of a rendering

        def uses(path, text):
            return marks[path] in text if path in marks else was_read(path, read)
        text = self.render_probe(marked, messages, "messages", (False, tools, kwargs), read=read)
        for path in [*marks, *values]:
            i = int(path[1:path.index("]")])
            if uses(path, text):
                continue
            if messages[i]["role"] == "assistant" and uses(path, self.render_probe(
                    marked[:i + 1], messages[:i + 1], "messages", (False, tools, kwargs),
                    read=read)):
                continue
            what = "is not in what the template writes" if path in marks else \
                f"is {values[path]!r}, and the template never reads it"
            raise ValueError(f"messages{path}, in a {messages[i]['role']!r} message, {what} "
                             f"({self.where}), so it would be dropped: remove it, or use a "
                             "template that renders it")

    def reply_spans(self, text, messages, trained, args, mark, specials, stops):
        """(start, end) in text of each trained assistant reply: from where its prompt ends
        (reply_start) through the first stop token (a special token in `stops`) after its last
        value, if that comes before the next message's; where its values stand: where a rendering
        with them replaced by mark differs (their fields kept, so that the template takes the same
        branches)."""
        regions = {}

        # (start, end) of message i's values in text, or None: the template writes none of them
        def region(i):
            if i not in regions and i < len(messages):
                texts_marked = map_values(messages[i], lambda path, x: mark if isinstance(x, str)
                                          and x and not
                                          # names and ids kept
                                          UNCHECKED.search(f"[0]{path}") else x)
                other = self.render_probe(messages[:i] + [texts_marked] + messages[i + 1:],
                                          messages, f"messages[{i}]",
                                          args)
                start = common_prefix_len(text, other)
                end = len(text) - common_prefix_len(text[::-1], other[::-1])
                regions[i] = (start, max(start, end)) if mark in other else None
            return regions.get(i)
        spans = []
        for i in trained:
            if messages[i]["role"] != "assistant" or region(i) is None:
                continue
            s, e = region(i)
            lo = spans[-1][1] if spans else 0
            # a header matched in part (DeepSeek-R1's <think>), a probe that changed the closing
            # token too (Llama-3.1's <|eom_id|> vs <|eot_id|>): a start or end inside a special
            # token moves to its start
            start = token_start(text, self.reply_start(text, messages[:i], s, args, lo), specials,
                                lo)
            e = token_start(text, e, specials, s)
            stop = next((t for t in specials.finditer(text, e) if t[0] in stops), None)
            if stop is not None and text[e:stop.start()].strip() \
                    and (region(i + 1) or [len(text)])[0] < stop.end():
                # no stop token before the next message: the reply ends with its last value
                stop = None
            end = e if stop is None else stop.end()
            if spans and start < spans[-1][1]:
                raise ValueError(f"{self.where}: the template does not write the replies once each "
                                 "and in order, so the trained tokens cannot be told apart")
            spans.append((start, end))
        return spans

    def render_probe(self, probe, messages, what, args, read=None):
        """The rendering of probe, messages with the text of `what` replaced by marks; if the
        template refuses it but not messages, an error that says so (the data is not at fault)."""
        try:
            return self.render(probe, *args, read=read)
        except ValueError as e:
            self.render(messages, *args)  # the conversation's own error first
            raise ValueError(f"{self.where}: the template refuses nanopack's probe of the "
                             f"conversation (the text of {what} replaced by marks, to see where "
                             "the template writes it) though it renders the conversation itself: "
                             f"{str(e).split(': ', 1)[-1]} — please report it") from None

    def reply_start(self, text, before, s, args, lo):
        """Where the reply after the messages `before` starts in text (s: its first value; lo: no
        earlier): after the generation header of the chat_template_kwargs, or the template's default
        one where the reply does not follow that (Qwen3's enable_thinking=False on a turn with
        reasoning), the later one found in its turn; with neither, after the rendering of `before`
        (a prefix of text, else where its longest tail in text[lo:s] ends) and as much of a header
        as the text has there (DeepSeek-R1's <｜Assistant｜> of <｜Assistant｜><think>\n)."""
        headers = [h for h in {self.generation_header(args[2]), self.generation_header({})} if h]
        ends = [text.rfind(h, lo, s) + len(h) for h in headers if text.rfind(h, lo, s) >= 0]
        ends = [end for end in ends if self.eot not in text[end:s]]
        if ends:
            return max(ends)
        try:
            prior = self.render(before, False, *args[1:])
        except ValueError:  # a template that will not render the conversation before the reply
            return s
        at = len(prior) if text.startswith(prior) else tail_end(text, prior, lo, s)
        if at is None:
            return s
        return min(s, at + max(common_prefix_len(text[at:at + len(h)], h) for h in [*headers, ""]))

    def generation_header(self, kwargs):
        """What add_generation_prompt adds after a user turn ('' if it adds nothing at the end)."""
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in self.headers:
            try:
                bare, prompted = (self.render([dict(role="user", content="Hi")], gen, None, kwargs)
                                  for gen in (0, 1))
            except ValueError:  # a template that wants more than a user turn
                bare = prompted = ""
            self.headers[key] = prompted[len(bare):] if prompted.startswith(bare) else ""
        return self.headers[key]

    def end_of_turn(self, special_re):
        """The special token (special_re matches them) the template writes right after an assistant
        reply."""
        mark = "\ue000"
        text = self.render([dict(role="user", content="Hi"), dict(role="assistant", content=mark)])
        eot = special_re.search(text, text.find(mark) + 1) if mark in text else None
        if eot is None:
            raise ValueError(f"{self.where}: the template writes no special token after an "
                             "assistant reply, so nanopack cannot tell where a turn ends")
        self.eot = eot.group()
        return self.eot


def aliased(message):
    """A message as transformers gives it to a template: None values dropped, its reasoning under
    each name."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message,
                                              "reasoning_content": reasoning}


class ReadLog(dict):
    """A message, or a dict in one, that adds "path.key" to a set for each of its keys a template
    reads."""

    @classmethod
    def of(cls, x, read, path):
        """x with each dict in it a ReadLog."""
        if isinstance(x, dict):
            log = cls({k: cls.of(v, read, f"{path}.{k}") for k, v in x.items()})
            # a template cannot see these: the sandbox hides _names
            log._read, log._path = read, path
            return log
        return [cls.of(v, read, f"{path}[{i}]")
                for i, v in enumerate(x)] if isinstance(x, (list, tuple)) else x

    def _log(self, keys):
        self._read.update(f"{self._path}.{k}" for k in keys)

    def __getitem__(self, key):
        self._log([key])
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._log([key])
        return super().get(key, default)

    def __contains__(self, key):
        self._log([key])
        return super().__contains__(key)

    def items(self):  # also tojson's (json.dumps calls a dict subclass's items())
        self._log(self.keys())
        return super().items()

    def values(self):
        self._log(self.keys())
        return super().values()

    def __iter__(self):
        self._log(super().keys())
        return super().__iter__()

    def __repr__(self):  # |string
        self._log(self.keys())
        return super().__repr__()


def was_read(path, read):
    """Whether the field at path ("[1].tool_calls[0].function.arguments.n"), or a dict holding it,
    is in `read`; a reasoning field under any of the names transformers passes it under."""
    parts = re.findall(r"\[\d+\]|\.[^.[]+", path)  # "[1]", ".tool_calls", "[0]", ".function", ...
    heads = ["".join(parts[:n]) for n in range(2, len(parts) + 1)]
    if parts[1][1:] in REASONING_FIELDS:
        heads += [f"{parts[0]}.{name}" for name in REASONING_FIELDS]
    return any(head in read for head in heads)


def map_values(x, fn, path=""):
    """x (messages: lists and dicts) with each other value v replaced by fn(path to it, v), e.g.
    "[2].content"."""
    if isinstance(x, dict):
        return {k: map_values(v, fn, f"{path}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [map_values(v, fn, f"{path}[{i}]") for i, v in enumerate(x)]
    return fn(path, x)


def guess_template(special_tokens, where):
    """The built-in format whose special tokens a tokenizer without a chat template has."""
    if "<|start_header_id|>" in special_tokens:
        return "llama3"
    if "<|im_start|>" in special_tokens:
        return "chatml"
    raise ValueError(f"{where}: no chat template in the folder and cannot tell the chat format (no "
                     "Llama-3 header or <|im_start|> token); pass template= one of "
                     f"{list(TEMPLATES)}")


def token_text(token):
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def token_start(text, at, specials, lo):
    """at, or the start of the special token (specials matches them, from lo on) that it falls
    inside."""
    token = next((t for t in specials.finditer(text, lo) if t.end() > at), None)
    return token.start() if token is not None and token.start() < at else at


def tail_end(text, prior, lo, hi):
    """Where, in text[lo:hi], the rightmost occurrence of the longest tail of prior found there ends
    (None: none)."""
    at, shortest, longest = None, 1, min(len(prior), hi - lo)
    while shortest <= longest:  # a tail found means every shorter one is found too: halving
        k = (shortest + longest) // 2
        found = text.rfind(prior[-k:], lo, hi)
        at, shortest, longest = (found + k, k + 1, longest) if found >= 0 else (at, shortest, k - 1)
    return at


def common_prefix_len(a, b):
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # halving, so that the comparing runs in C
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo
