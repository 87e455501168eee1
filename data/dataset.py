"""
The data a run trains on, set up the same way by every script: records (data/prepare.py) or the
built-in task (data/arithmetic.py) tokenized once into out_dir/data by rank 0, or a folder
data/prepare.py wrote; its kind checked before anything is tokenized, its lengths against the model
and the micro-batch; RL's prompt records.
"""
import os

import numpy as np
import torch.distributed as dist

from data.arithmetic import env_prompts, prepare_builtin, rl_prompts
from data.prepare import as_messages, load, peek_kind, prepare, read_meta, template_inputs
from data.records import BadRecords, DataError, data_files, parse_fields, read_records
from packing import layout
from nanopack.parallel import fail, is_master, print0

NEEDS = dict(sft="messages", dpo="chosen/rejected pairs", rl="prompt records")
NOT_PROMPTS = dict(sft="'messages' ending with the assistant's reply",
                   dpo="'chosen' and 'rejected'")
# what datasets call a prompt (GSM8K: question)
PROMPT_NAMES = ("question", "problem", "query", "instruction", "input")


def prepared(data):
    return data != "builtin" and os.path.isfile(os.path.join(data, "meta.json"))


def check_kind(data, data_split, val_data, val_split, kind, fields=None):
    """The data's kind (a first record, or meta.json) is the script's, and its splits exist: checked
    before anything is tokenized; a mistake is a SystemExit line. fields: the key `fields`, renames
    applied to every record."""
    try:
        renames = parse_fields(fields)
        if val_split and not val_data:
            raise SystemExit(f"config error: val_split={val_split!r}; it picks a split of a "
                             f"val_data folder, and val_data is not set")
        if data == "builtin" or prepared(data):
            # RL's val_data holds prompt records
            if data_split or (val_data and kind != "rl"):
                key, value = ("data_split", data_split) if data_split else ("val_data", val_data)
                raise SystemExit(f"config error: {key}={value!r}; it picks raw records; this data "
                                 f"is 'builtin' or already prepared")
            found, where = kind if data == "builtin" else read_meta(data).get("kind"), data
        else:
            found, where = peek_prompts(data, data_split, fields=renames) if kind == "rl" else \
                peek_kind(data, data_split, kind, renames)
        # RL's val_data holds prompt records too
        if val_data and kind == found == "rl":
            found, where = peek_prompts(val_data, val_split, "val_split", renames)
        elif val_data:
            data_files(val_data, val_split, "val_split")
    except (ValueError, OSError) as e:
        raise SystemExit(f"data error: {e}") from None
    if found != kind:
        raise SystemExit(f"data error: {where} is {str(found).upper()} data but train_{kind}.py "
                         f"trains {kind.upper()} ({NEEDS[kind]}); use train_{found}.py for it")


def prepare_data(c, out_dir, tok, kind, max_seq_len, builtin_sizes=None):
    """-> the folder of token files for c["data"]: a prepared folder as it is, else out_dir/data
    written by rank 0. max_len is capped at the model's positions, so a sequence too long for them
    follows `overlong`, its line named."""
    if prepared(c["data"]):
        return c["data"]
    data_dir = os.path.join(out_dir, "data")
    if is_master():
        try:
            if c["data"] == "builtin":
                prepare_builtin(data_dir, tokenizer=tok, kind=kind, **(builtin_sizes or {}))
            else:
                prepare(c["data"], data_dir, tokenizer=tok,
                        max_len=min(c["max_len"], max_seq_len), overlong=c["overlong"],
                        val_fraction=c["val_fraction"], seed=c["seed"],
                        data_split=c["data_split"], val_input=c["val_data"],
                        val_split=c["val_split"],
                        reasoning_turns=c.get("reasoning_turns", "conversation"),
                        bad_records=c.get("bad_records", "error"), kind=kind,
                        fields=c.get("fields"))
        # a bad line (file:line, value, what to do), a missing file
        except (ValueError, OSError) as e:
            capped = c["max_len"] > max_seq_len and "max_len" in str(e)
            cap = (f" (max_len is capped at the model's max_seq_len={max_seq_len}: it "
                   f"has no positions beyond)")
            raise SystemExit(f"data error: {e}" + cap * capped) from None
    if dist.is_initialized():
        dist.barrier()
    return data_dir


def load_data(data_dir, tok):
    """-> (train, val) token data of a prepared folder, tokenized with the run's tokenizer."""
    train, meta = load(data_dir, "train")
    if (meta.get("tokenizer"), meta.get("template")) != (tok.name, tok.template_id):
        raise SystemExit(f"{data_dir} was prepared with tokenizer {meta.get('tokenizer')!r}, "
                         f"template {meta.get('template')!r}; this run uses {tok.name!r}, "
                         f"{tok.template_id!r} (a chat template and its chat_template_kwargs); "
                         f"prepare it again with the run's")
    return train, load(data_dir, "val")[0]


def turn_examples_note(data_dir, train, reasoning_turns):
    """-> a note where the token files lack the turn examples the run asks for (reasoning_turns: the
    run's), or where they hold them but not travelling together (an earlier version); else ''."""
    prepared_with = (read_meta(data_dir).get("reasoning_turns", "conversation") if data_dir
                     else reasoning_turns)
    # token files of an earlier version
    if prepared_with == "each" and "units" not in train:
        return (f"note: {data_dir} was prepared before turn examples travelled together: each is "
                f"packed on its own; re-prepare it (a new out_dir, or delete {data_dir}) to "
                f"compute a conversation's history once")
    # a prepared folder, or a resumed run's data
    if reasoning_turns == "each" and prepared_with != "each":
        return (f"note: reasoning_turns='each' is ignored: {data_dir} was prepared with "
                f"reasoning_turns={prepared_with!r} (its meta.json), so it holds no turn examples; "
                f"it applies where records are prepared (data=<records>, or data/prepare.py "
                f"--reasoning_turns=each)")
    return ""


# what preparing records reads (and meta.json)
RECORDS_KEYS = ("max_len", "overlong", "val_fraction", "bad_records", "fields")


def ignored_keys_note(c, data_dir, max_seq_len):
    """-> a note naming the records-only keys the run sets otherwise than its prepared folder
    (data=<folder>) was made with: token files are used as they are; else ''."""
    # records prepared by this run (or the built-in task) follow its keys
    if data_dir != c.get("data"):
        return ""
    # max_len: prepare_data's cap; fields: as meta.json holds them
    meta, run = read_meta(data_dir), dict(c, max_len=min(c.get("max_len", 0), max_seq_len))
    run["fields"] = parse_fields(c.get("fields")) or None
    other = [f"{k}={run[k]!r} (prepared with {meta.get(k)!r})" for k in RECORDS_KEYS if k in run
             and (meta.get(k) is not None or k == "fields") and run[k] != meta.get(k)]
    if not other:
        return ""
    return (f"note: {data_dir} holds prepared token files, used as they are: {', '.join(other)} "
            f"not applied; they apply where records are prepared (data=<records>, or "
            f"data/prepare.py)")


def check_fits(model_config, tok, data_dir, splits, budget, group_size=1, prefix_sharing=False,
               context_parallel=1):
    """Refuse at load time, not iterations later: a tokenizer larger than the embedding table, a
    sequence longer than the model's positions, a unit (example, pair or group, a shared prompt
    once) over a micro-batch (of a CP group)."""
    if tok.vocab_size > model_config.vocab_size:
        raise SystemExit(f"the tokenizer has {tok.vocab_size} tokens but the model only "
                         f"{model_config.vocab_size} embeddings; use the model's own tokenizer "
                         f"(--tokenizer=<its folder>)")
    for split, data in splits.items():
        seq_lengths = np.diff(np.asarray(data["offsets"]))
        if not len(seq_lengths):
            if split == "train":
                raise SystemExit(f"{data_dir} has no train examples; check the data (or lower "
                                 f"val_fraction)")
            print0(f"note: {data_dir} has no val examples: evaluation reports no val loss (a small "
                   f"file? raise val_fraction)")
            continue
        i = int(seq_lengths.argmax())
        if seq_lengths[i] > model_config.max_seq_len:
            raise SystemExit(f"{data_dir}: {split} sequence {i} has {seq_lengths[i]} tokens, more "
                             f"than the model's max_seq_len={model_config.max_seq_len} positions; "
                             f"prepare the data with --max_len={model_config.max_seq_len} (and "
                             f"--overlong=truncate or skip)")
        # turn trees: cut
        cut, prefix, lengths, _ = layout(data, budget * context_parallel, group_size,
                                         prefix_sharing)
        if lengths.max() > budget * context_parallel:
            i, once = int(lengths.argmax()), prefix is not None and "units" not in cut
            unit = {1: "example", 2: "pair (chosen + rejected)"}.get(group_size, "group")
            what = unit + f" ({i})"
            # turn examples: a piece over the budget is one example, laid out whole
            if "units" in cut:
                i = int(cut["units"][i])
                conversation = np.searchsorted(data['units'], i, 'right') - 1
                what = f"example ({i}, a turn of conversation {conversation})"
            group = (f"{context_parallel} x " * (context_parallel > 1)
                     + f"microbatch_tokens={budget}")
            raise SystemExit(f"{data_dir}: the longest {split} {what} has {lengths.max()} "
                             f"tokens{' with its prompt once' * once}, more than {group}; raise "
                             f"microbatch_tokens to at least {lengths.max()}, split it over GPUs "
                             f"with --context_parallel={-(-lengths.max() // budget)} (torchrun), "
                             f"or prepare the data with a smaller --max_len")


def prompt_record(record, where):
    """An RL record -> ("rl", (prompt messages, the other fields)), or ("sft" | "dpo", None) for
    another script's record; a record with no prompt is a DataError (GSM8K's "question": rename
    it)."""
    if "chosen" in record and "rejected" in record:
        return "dpo", None
    if "messages" not in record and "prompt" not in record:
        named = [k for k in PROMPT_NAMES if isinstance(record.get(k), str)]
        rename = f" (rename {named[0]!r} to 'prompt'?)" if named else ""
        keys = ', '.join(map(repr, sorted(record)))
        raise DataError(f"{where}: no 'prompt' or 'messages' (the line's keys: {keys})"
                        f" — put the user's turn in 'prompt'{rename}")
    field = "messages" if "messages" in record else "prompt"
    messages = as_messages(record[field], field, "user", where)
    if field == "messages" and messages[-1]["role"] == "assistant":
        return "sft", None
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: '{field}' ends with a {messages[-1]['role']} turn — a prompt "
                        f"ends with the user's turn, the reply is the model's")
    return "rl", (messages, {k: v for k, v in record.items() if k != field})


def peek_prompts(path, split=None, key="data_split", fields=None):
    """-> (kind, where) of the first record of `path`, as prompt_record reads it: "rl" for
    prompts."""
    for where, record in read_records(data_files(path, split, key), verbose=False, fields=fields):
        return prompt_record(record, where)[0], where
    raise DataError(f"{path}: no prompts found (an empty file?); write one {{\"prompt\": ...}} or "
                    f"{{\"messages\": [...]}} record a line")


def check_group_fits(ids, where, k, max_new_tokens, prefix_sharing, microbatch_tokens, cp,
                     positions):
    """An RL prompt's group must fit one micro-batch (of a CP group: cp x microbatch_tokens) and
    its replies the model's positions, whatever they sample; else one `data error:` line."""
    group_tokens = (len(ids) + k * max_new_tokens if prefix_sharing
                    else k * (len(ids) + max_new_tokens))
    too_many = group_tokens > microbatch_tokens * cp
    if len(ids) + max_new_tokens > positions or too_many:
        cp_needed = -(-group_tokens // microbatch_tokens)
        split = (f"raise microbatch_tokens, split it over GPUs with --context_parallel={cp_needed} "
                 f"(torchrun), ") if too_many else ""
        fail(f"data error: {where}: the prompt has {len(ids)} tokens: with "
             f"max_new_tokens={max_new_tokens} and k={k} its group needs up to {group_tokens} "
             f"tokens, its replies {len(ids) + max_new_tokens} positions "
             f"(microbatch_tokens={microbatch_tokens}, max_seq_len={positions}); {split}lower "
             f"max_new_tokens or shorten the prompt")


def read_prompts(source, n, tok, limit, split=None, key="data_split", fields=None, check=None,
                 bad_records="error", tools=None, builtin_env=False):
    """RL prompts -> [(prompt ids, prompt messages, reward fields, where)], the first n (None: all).
    source: 'builtin' (the hard split: val when n is given, else train) or {"messages"} /
    {"prompt"} records, other fields for the reward; split: a folder's, set by config key `key`.
    limit(ids, where) checks a prompt's length. fields: the key `fields`; check(fields, where) ->
    the error of a record the reward cannot score, or None: a bad record (bad_records). tools: JSON
    schemas every prompt offers (train_rl.py --tools); builtin_env: the built-in task's multi-turn
    prompts (--env=builtin), their fields the environment's."""
    if source == "builtin":
        split = "val" if n else "train"
        found = [(p, f, f"builtin:{split}:{i}")
                 for i, (p, f) in enumerate(env_prompts(split, n or 2000))] if builtin_env else \
            [(p, dict(answer=a), f"builtin:{split}:{i}")
             for i, (p, a) in enumerate(rl_prompts(split, n or 2000, 0, hard=True))]
    else:
        found, bad = [], BadRecords(bad_records)
        try:
            files = data_files(source, split, key)
            renames = parse_fields(fields)
            for where, record in read_records(files, verbose=False, bad=bad, fields=renames):
                try:
                    kind, prompt = prompt_record(record, where)
                    problem = kind == "rl" and check and check(prompt[1], where)
                except DataError as e:
                    kind, problem = "rl", e
                if kind != "rl":
                    raise DataError(f"{where}: {kind.upper()} data among the prompts "
                                    f"({NOT_PROMPTS[kind]}) — a prompt record is "
                                    f"{{\"prompt\": ...}} or {{\"messages\": [prompt turns]}}; "
                                    f"drop the line")
                if problem:
                    bad.add(problem)
                    continue
                found.append((*prompt, where))
                if n and len(found) == n:
                    break
            if bad.count and (bad.policy == "error" or not found):
                bad.raise_error(source, usable=bool(found))
        except (ValueError, OSError) as e:
            raise SystemExit(f"data error: {e}") from None
        if not found:
            raise SystemExit(f"data error: {source}: no prompts found (an empty file?); write one "
                             f"{{\"prompt\": ...}} or {{\"messages\": [...]}} record a line")
        if bad.count:
            print0(f"{source}: {bad.count:,} bad records skipped (bad_records='skip'), the first "
                   f"{len(bad.named)}:\n  " + "\n  ".join(bad.named))
    prompts = []
    for m, fields, where in found:
        # a bad 'tools' field (DataError names the line), a template that refuses the prompt or
        # leaves part out
        try:
            ids = tok.render_prompt(m, **template_inputs(fields, where, tools))
            prompts.append((ids, m, fields, where))
        except ValueError as e:
            named = f"data error: {e}" if isinstance(e, DataError) else f"data error: {where}: {e}"
            raise SystemExit(named) from None
        limit(prompts[-1][0], where)
    return prompts
