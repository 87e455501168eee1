"""
A record -> SFT messages, or a DPO pair (prompt, chosen, rejected) as message lists, each checked:
a record data/prepare.py cannot use is one DataError naming its line and what to do.
"""
import json
import re

from data.records import DataError
from nanopack.chat_template import REASONING_FIELDS
from nanopack.tokenizer import ROLES

# a DPO response: assistant turns and the tool results between
RESPONSE_ROLES = ("assistant", "tool", "ipython")
# HH-RLHF's turn markers; the one space after the colon goes
HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")


def check_messages(messages, field, where):
    """Validate a message list; return it as dicts with every field but those set to None (as
    apply_chat_template)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{field}' must be a non-empty list of {{\"role\", \"content\"}} "
                        f"messages, got {json.dumps(messages, default=str)[:60]} — fix the line's "
                        "format")
    out = []
    for i, m in enumerate(messages):
        at = f"{field}[{i}]"
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: {at} has no 'role' — give every message a role, one of "
                            f"{', '.join(ROLES)}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {at}.role is {m['role']!r}, an unknown role — use one of "
                            f"{', '.join(ROLES)} (rename it, or drop the message)")
        m = {k: v for k, v in m.items() if v is not None}
        calls, reasoning = m.get("tool_calls"), "".join(str(m[k]) for k in REASONING_FIELDS
                                                        if k in m)
        if not isinstance(m.get("content", "" if calls else None), str):
            got = "missing" if "content" not in m else f"a {type(m['content']).__name__}"
            raise DataError(f"{where}: {at}.content is {got}, not a string — content must be plain "
                            "text (flatten multi-part content into one string)")
        for j, call in enumerate(calls if isinstance(calls, list) else [] if calls is None
                                 else [calls]):
            # transformers takes both forms
            fn = call.get("function", call) if isinstance(call, dict) else {}
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments"), (dict, str))):
                raise DataError(f"{where}: {at}.tool_calls[{j}] is "
                                f"{json.dumps(call, default=str)[:60]}, not a tool call "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"arguments\": {{...}} or a JSON string}}}} — fix the line's "
                                "format")
        if m["role"] == "assistant" and not (m.get("content", "").strip() or calls
                                             or reasoning.strip()):
            raise DataError(f"{where}: {at} is an empty assistant turn — write the reply or drop "
                            "the line")
        out.append(m)
    return out


def template_inputs(record, where, more_tools=None):
    """A record's "tools" (and more_tools: JSON schemas) and "chat_template_kwargs" -> keyword
    arguments for Tokenizer.render."""
    tools, kwargs = record.get("tools"), record.get("chat_template_kwargs") or {}
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' is {json.dumps(tools, default=str)[:60]}, not a list of "
                        "JSON schemas — fix the line's format")
    if not isinstance(kwargs, dict) or {"messages", "tools", "add_generation_prompt",
                                        "trained_from"} & set(kwargs):
        raise DataError(f"{where}: 'chat_template_kwargs' is "
                        f"{json.dumps(kwargs, default=str)[:60]}, not an object of template "
                        f"variables like {{\"enable_thinking\": false}} — fix the line's format")
    tools = (tools or []) + (more_tools or [])
    return dict(kwargs, tools=tools) if tools else dict(kwargs)


def as_messages(x, field, role, where):
    """A string (one message of `role`) or a message list -> a checked message list."""
    return check_messages([dict(role=role, content=x)] if isinstance(x, str) else x, field, where)


def split_transcript(text, field, where):
    """An HH-RLHF transcript "\\n\\nHuman: q\\n\\nAssistant: a ..." -> its user/assistant
    messages."""
    # [text before the first marker, marker 1, turn 1, marker 2, turn 2, ...]
    parts = HH_TURN.split(text)
    markers = parts[1::2]
    due = next((i for i, m in enumerate(markers) if m != ("Human", "Assistant")[i % 2]), None)
    problem = ("has no '\\n\\nHuman:' / '\\n\\nAssistant:' turns" if not markers else
               f"has text before its first turn: {parts[0][:40]!r}" if parts[0].strip() else
               f"turn {due + 1} is {markers[due]}'s, where turns alternate Human, Assistant"
               if due is not None else
               "ends with a Human turn, not the Assistant's reply" if markers[-1] == "Human"
               else None)
    if problem:
        raise DataError(f"{where}: '{field}' {problem} — with no 'prompt', chosen and rejected "
                        "strings must be HH-RLHF transcripts '\\n\\nHuman: ...\\n\\nAssistant: "
                        "...'; fix the line or add a prompt")
    return [dict(role="user" if m == "Human" else "assistant", content=c)
            for m, c in zip(markers, parts[2::2])]


def parse(record, where, kind=None):
    """A record -> ("sft", messages) or ("dpo", (prompt, chosen, rejected) message lists). kind:
    what the caller trains, whose fields it reads where a record has both
    (ultrafeedback_binarized)."""
    dpo_keys = [k for k in ("chosen", "rejected") if k in record]
    if "messages" in record and dpo_keys and kind != "sft":  # train_sft.py reads 'messages' alone
        if record["messages"] != record.get("chosen") and kind != "dpo":
            raise DataError(f"{where}: the line has both 'messages' (SFT) and "
                            f"{' and '.join(map(repr, dpo_keys))} (DPO), and 'messages' is not the "
                            "chosen conversation — keep one kind per line, or choose which to read "
                            "with --kind=sft or --kind=dpo")
        record = {k: v for k, v in record.items() if k != "messages"}
    if "messages" in record:
        messages = check_messages(record["messages"], "messages", where)
        if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
            weighted = " with a weight other than 0" * any(m["role"] == "assistant"
                                                           for m in messages)
            raise DataError(f"{where}: no assistant turn in 'messages'{weighted} — nothing would "
                            "be trained; add the assistant reply or drop the line")
        return "sft", messages
    if "chosen" in record and "rejected" in record:
        if "prompt" not in record and isinstance(record["chosen"],
                                                 str) and isinstance(record["rejected"], str):
            # HH-RLHF
            record = {k: split_transcript(record[k], k, where) for k in ("chosen", "rejected")}
        chosen = as_messages(record["chosen"], "chosen", "assistant", where)
        rejected = as_messages(record["rejected"], "rejected", "assistant", where)
        if chosen == rejected:
            raise DataError(f"{where}: chosen and rejected are identical — a preference pair needs "
                            "two different responses; drop the line")
        if "prompt" in record and all(m["role"] in RESPONSE_ROLES for m in chosen + rejected):
            prompt = as_messages(record["prompt"], "prompt", "user", where)
        else:  # whole conversations: the prompt is the longest common prefix
            n = 0
            while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        for field, tail in (("chosen", chosen), ("rejected", rejected)):
            if not tail:
                raise DataError(f"{where}: '{field}' has no response after the prompt it shares "
                                "with the other side — each side needs its own assistant reply")
            roles = (({m["role"] for m in tail} - set(RESPONSE_ROLES))
                     or {tail[0]["role"]} - {"assistant"})
            if roles:
                raise DataError(f"{where}: chosen and rejected differ in a {roles.pop()} turn, not "
                                "only in assistant turns — both must share the same prompt "
                                "messages, then differ in the assistant's reply")
        # the replies answer nothing the model would be shown
        if not any(m["role"] == "user" for m in prompt):
            named = [k for k, v in record.items() if k not in ("prompt", "chosen", "rejected")
                     and isinstance(v, str)]
            rename = ""
            if len(named) == 1 and "prompt" not in record:
                rename = f" (rename {named[0]!r} to 'prompt'?)"
            raise DataError(f"{where}: the pair has no user turn, so no prompt (the line's keys: "
                            f"{', '.join(map(repr, sorted(record)))}) — put the user's turn in "
                            f"'prompt'{rename}")
        return "dpo", (prompt, chosen, rejected)
    raise DataError(f"{where}: expected 'messages' (SFT) or 'chosen' and 'rejected' (DPO), got "
                    f"keys {sorted(record)} — see the formats at the top of data/prepare.py")
