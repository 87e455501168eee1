"""
Chat templates: the text a conversation becomes, and which of it is trained.

A folder's own template (chat_template.jinja, else tokenizer_config.json "chat_template") is compiled and rendered as
transformers does: a sandboxed jinja2 environment with its settings, filters and globals, and tokenizer_config.json's
special tokens as variables. Without one (and for the byte-level tokenizer) a built-in format is used (TEMPLATES).

Trained (loss mask 1): an assistant message's content as the template writes it, and the special token right after it
with only whitespace between (the end of the turn); all else is 0 (bos, headers, default system prompts, system and
user turns, Qwen3's empty <think></think> block). Tokenizer.render turns text and reply spans into ids and mask.
"""
import hashlib
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# bos: prepended once per conversation (None: nothing). header: opens a turn, {role} filled in.
# eot: the end-of-turn special token, trained on assistant turns. after: text following eot, untrained.
TEMPLATES = {
    "simple": dict(bos="<|bos|>", header="<|{role}|>", eot="<|end|>", after=""),
    "llama3": dict(bos="<|begin_of_text|>", header="<|start_header_id|>{role}<|end_header_id|>\n\n",
                   eot="<|eot_id|>", after=""),
    "chatml": dict(bos=None, header="<|im_start|>{role}\n", eot="<|im_end|>", after="\n"),
}
ROLES = ("system", "user", "assistant")
# the variables transformers passes every chat template (its special_tokens_map)
TEMPLATE_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_chat_template(folder, config):
    """The folder's own chat template as transformers picks it: chat_template.jinja, else tokenizer_config.json's
    "chat_template" (a string, or named ones: "default") -> (source, the special tokens it may use, where) or None."""
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
                raise ValueError(f"{where}: named templates {sorted(map(str, named))} and none called 'default', "
                                 f"so it is not clear which one to use")
            source = named["default"]
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{where}: a {type(source).__name__}, not a template string or a list of named templates")
    variables = {k: token_text(config[k]) for k in TEMPLATE_VARIABLES if config.get(k) is not None}
    return source, variables, where


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (TRL marks assistant text with it): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def compile_chat_template(source, where):
    """A template compiled as transformers does (chat_template_utils.py): a sandbox that cannot reach Python internals,
    trim_blocks + lstrip_blocks, {% break %}/{% continue %}, raise_exception, strftime_now, tojson not escaping HTML."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:  # also an unknown tag or filter: a feature we do not provide
        raise ValueError(f"{where}: line {e.lineno}: {' '.join(str(e.message).split())} (nanopack compiles "
                         f"templates as transformers does: jinja2 with loopcontrols, tojson, raise_exception, "
                         f"strftime_now)") from None


class ChatTemplate:
    """A folder's own template, (source, variables, where) as read_chat_template gives them: compiled, rendered
    with the arguments transformers gives it, and searched for the replies it writes."""

    def __init__(self, source, variables, where):
        self.source, self.variables, self.where = source, variables, where
        self.jinja = compile_chat_template(source, where)
        # caches of tokenized data and reference log-probs are keyed by the template's text, not its name
        digest = hashlib.sha256(json.dumps([source, variables], sort_keys=True, default=str).encode()).hexdigest()
        self.id = f"model-{digest[:12]}"

    def render(self, messages, add_generation_prompt=False):
        try:
            return self.jinja.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.variables)
        except jinja2.TemplateError as e:  # raise_exception(...) in the template, an undefined name, ...
            raise ValueError(f"{self.where}: the template cannot render this conversation: "
                             f"{' '.join(str(e).split())}") from None

    def reply_spans(self, text, messages, add_generation_prompt, trained_from, mark):
        """(start, end) in text (messages rendered) of each assistant reply from message trained_from on: where
        a rendering with its content replaced by mark, a character text lacks, differs from text."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < trained_from:
                continue
            other = self.render(messages[:i] + [dict(m, content=mark)] + messages[i + 1:], add_generation_prompt)
            if mark not in other:
                continue  # the template does not write this reply
            start = common_prefix_len(text, other)
            end = max(start, len(text) - common_prefix_len(text[::-1], other[::-1]))
            if spans and start < spans[-1][1]:
                raise ValueError(f"{self.where}: the template does not write the replies once each and in order, "
                                 f"so the trained tokens cannot be told apart")
            spans.append((start, end))
        return spans

    def end_of_turn(self, special_re):
        """The special token (special_re matches them) the template writes right after an assistant reply."""
        mark = "\ue000"
        text = self.render([dict(role="user", content="Hi"), dict(role="assistant", content=mark)])
        eot = special_re.search(text, text.find(mark) + 1) if mark in text else None
        if eot is None:
            raise ValueError(f"{self.where}: the template writes no special token after an assistant reply, so "
                             f"nanopack cannot tell where a turn ends")
        return eot.group()


def guess_template(special_tokens, where):
    """The built-in format whose special tokens a tokenizer without a chat template has."""
    if "<|start_header_id|>" in special_tokens:
        return "llama3"
    if "<|im_start|>" in special_tokens:
        return "chatml"
    raise ValueError(f"{where}: no chat template in the folder and cannot tell the chat format (no Llama-3 "
                     f"header or <|im_start|> token); pass template= one of {list(TEMPLATES)}")


def token_text(token):
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def common_prefix_len(a, b):
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # halving, so that the comparing runs in C
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo
