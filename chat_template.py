"""
Chat templates: which text a conversation becomes, in the model's own format.

A folder's own template (chat_template.jinja, else tokenizer_config.json "chat_template") is compiled as transformers
compiles it: a sandboxed jinja2 environment with the same settings, filters and globals, and tokenizer_config.json's
special tokens (bos_token, eos_token, ...) as variables. A tokenizer without one (and the byte-level toy tokenizer)
uses a built-in format: "simple", "llama3" or "chatml" (TEMPLATES). Tokenizer.render (tokenizer.py) renders them.
"""
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
TEMPLATE_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")



def read_chat_template(folder, config):
    """The folder's own chat template as transformers picks it: chat_template.jinja, else
    tokenizer_config.json's "chat_template" (a string, or named templates of which "default" is used)
    -> (source, variables, where) or None. variables: the special tokens the template may use."""
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
                raise ValueError(f"{where}: named templates {sorted(map(str, named))} and none called "
                                 f"'default', so it is not clear which one to use")
            source = named["default"]
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{where}: a {type(source).__name__}, not a template string or a list of "
                             f"named templates")
    variables = {k: token_text(config[k]) for k in TEMPLATE_VARIABLES if config.get(k) is not None}
    return source, variables, where


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (TRL marks assistant text with it): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def compile_chat_template(source, where):
    """A chat template compiled the way transformers compiles it (chat_template_utils.py): a sandbox
    that cannot reach Python internals, trim_blocks + lstrip_blocks, {% break %}/{% continue %}, and
    the globals raise_exception / strftime_now and a tojson that does not escape HTML."""
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
    except jinja2.TemplateSyntaxError as e:  # also an unknown tag or filter: a feature we do not provide
        raise ValueError(f"{where}: line {e.lineno}: {' '.join(str(e.message).split())} (nanopack "
                         f"compiles templates as transformers does: jinja2 with loopcontrols, tojson, "
                         f"raise_exception, strftime_now)") from None


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
