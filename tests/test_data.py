"""data/prepare.py and data/arithmetic.py: bad input named by file and line, overlong policies,
prepare -> load round trip, DPO prompt inference, the built-in dataset."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from data import arithmetic  # noqa: E402
from data.prepare import DataError, TokenWriter, load, prepare  # noqa: E402
from nanopack.tokenizer import Tokenizer  # noqa: E402

TOK = Tokenizer.byte_level()


def sft(*turns, system=None):
    """sft("q1", "a1", "q2", "a2") -> {"messages": [...]} alternating user/assistant."""
    messages = [dict(role="system", content=system)] if system else []
    messages += [dict(role=("user", "assistant")[i % 2], content=t) for i, t in enumerate(turns)]
    return dict(messages=messages)


def write_jsonl(path, lines):
    """lines: dicts (dumped as JSON) or str/bytes (written as they are)."""
    with open(path, "wb") as f:
        for line in lines:
            line = json.dumps(line) if isinstance(line, dict) else line
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return str(path)


def examples(data_dir, split):
    """-> [(ids, mask)] from the token files, as lists."""
    data, _ = load(data_dir, split)
    ids, offsets, mask = data["ids"], data["offsets"], data["loss_mask"]
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


# --------------------------------------------------------------------------------------------------
# bad input: one error naming file:line, the field, and what to do

GOOD = sft("What is 1+1?", "2")
PAIR = {"prompt": "hi", "chosen": "a", "rejected": "b"}
CONV_A, CONV_B = sft("hi", "a")["messages"], sft("hello", "a")["messages"]
BAD_LINES = {  # name -> (bad line, regex the message must match after 'bad.jsonl:3: ')
    "malformed JSON": ('{"messages": [{"role": "user", "content": "hi"}', r"malformed JSON .* fix or delete"),
    "not an object": ("[1, 2]", r"the line is a JSON list, not an object — write one"),
    "unknown format": ({"text": "hello"},
                       r"expected 'messages' \(SFT\) or 'chosen' and 'rejected'.*got keys \['text'\]"),
    "missing role": ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]},
                     r"messages\[0\] has no 'role' — give every message a role"),
    "unknown role": ({"messages": [{"role": "human", "content": "hi"}]},
                     r"messages\[0\]\.role is 'human', an unknown role — use one of system, user, assistant, tool"),
    "a role the format cannot render": ({"messages": [*GOOD["messages"], {"role": "tool", "content": "4"}]},
                                        r"messages\[2\]\.role 'tool': the built-in 'simple' chat format renders only"),
    "a field the format cannot render": (
        {"messages": [GOOD["messages"][0], dict(GOOD["messages"][1], reasoning_content="1+1")]},
        r"messages\[1\]\.reasoning_content: the built-in 'simple' chat format renders only the role and content"),
    "a bad tool call": ({"messages": [GOOD["messages"][0], {"role": "assistant", "tool_calls": [{"name": "f"}]}]},
                        r"messages\[1\]\.tool_calls\[0\] is \{\"name\": \"f\"\}, not a tool call"),
    "tools not a list": (dict(GOOD, tools={"name": "f"}), r"'tools' is \{\"name\": \"f\"\}, not a list of JSON"),
    "non-string content": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                         {"role": "assistant", "content": "x"}]},
                           r"messages\[0\]\.content is a list, not a string — content must be plain text"),
    "missing content": ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
                        r"messages\[0\]\.content is missing"),
    "empty assistant turn": (sft("hi", "  \n"), r"messages\[1\] is an empty assistant turn — write the reply"),
    "no assistant turn": (sft("hi"), r"no assistant turn in 'messages' — nothing would be trained"),
    "every reply weight 0": ({"messages": [GOOD["messages"][0], dict(GOOD["messages"][1], weight=0)]},
                             r"no assistant turn in 'messages' with a weight other than 0 — nothing would be trained"),
    "empty messages": ({"messages": []}, r"'messages' must be a non-empty list"),
    "non-UTF-8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
                  r"invalid UTF-8 byte b'\\xe9' .* re-encode the file as UTF-8"),
    "mixed kinds": (PAIR, r"a DPO line in a file that began as SFT at .*bad.jsonl:1"),
    "messages and chosen": (dict(GOOD, chosen="a"), r"the line has both 'messages' \(SFT\) and 'chosen' \(DPO\), "
                                                    r"and 'messages' is not the chosen conversation — keep one kind"),
}
BAD_PAIRS = {  # the same, in a DPO file
    "chosen equals rejected": ({"prompt": "hi", "chosen": "same", "rejected": "same"},
                               r"chosen and rejected are identical — a preference pair needs two different"),
    "identical conversations": ({"chosen": CONV_A, "rejected": CONV_A}, r"chosen and rejected are identical"),
    "differ in a user turn": ({"chosen": CONV_A, "rejected": CONV_B},
                              r"chosen and rejected differ in a user turn, not only in assistant turns — both"),
    "empty chosen": ({"prompt": "hi", "chosen": "", "rejected": "b"}, r"chosen\[0\] is an empty assistant turn"),
    "one side is a prefix": ({"chosen": CONV_A, "rejected": sft("hi", "a", "more?", "b")["messages"]},
                             r"'chosen' has no response after the prompt"),
    "bad role in prompt": ({"prompt": [{"role": "human", "content": "hi"}], "chosen": "a", "rejected": "b"},
                           r"prompt\[0\]\.role is 'human', an unknown role"),
    "non-string chosen": ({"prompt": "hi", "chosen": 42, "rejected": "b"}, r"'chosen' must be a non-empty list"),
    "non-string prompt": ({"prompt": 42, "chosen": "a", "rejected": "b"}, r"'prompt' must be a non-empty list.*got 42"),
    "rejected is one message": ({"prompt": "hi", "chosen": "a", "rejected": {"role": "assistant", "content": "b"}},
                                r"'rejected' must be a non-empty list.*got \{\"role\""),
    "messages differ from chosen": ({"prompt": "hi", "chosen": CONV_A, "rejected": sft("hi", "b")["messages"],
                                     "messages": sft("hi", "c")["messages"]},
                                    r"the line has both 'messages' \(SFT\) and 'chosen' and 'rejected' \(DPO\)"),
}


@pytest.mark.parametrize("case", list(BAD_LINES) + list(BAD_PAIRS))
def test_bad_input_names_file_line_and_fix(tmp_path, case):
    bad, message = BAD_LINES[case] if case in BAD_LINES else BAD_PAIRS[case]
    first = GOOD if case in BAD_LINES else PAIR
    path = write_jsonl(tmp_path / "bad.jsonl", [first, "", bad, first])  # a blank line 2 still counts
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: {message}"):
        prepare(path, str(tmp_path / "out"), TOK, verbose=False)
    # nothing half-written is left behind for a training script to pick up
    assert not os.path.exists(tmp_path / "out" / "meta.json")
    assert not [f for f in os.listdir(tmp_path / "out") if f.endswith(".tmp")]


def test_cli_prints_one_line_not_a_traceback(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, sft("hi", "")])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data", "prepare.py"), "--input", path,
                        "--out_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"error: {path}:2: messages[1] is an empty assistant turn" in r.stderr


# --------------------------------------------------------------------------------------------------
# overlong examples: error (default), truncate, skip; counted

def test_overlong_policies(tmp_path):
    lines = [sft("hi", "short"), sft("hi", "x" * 100), sft("q" * 100, "a"), sft("hi", "ok")]
    path = write_jsonl(tmp_path / "long.jsonl", lines)
    kw = dict(tokenizer=TOK, max_len=40, val_fraction=0, verbose=False)
    # line 2 in byte tokens: <|bos|><|user|>hi<|end|><|assistant|> + 100 x + <|end|> = 107
    with pytest.raises(DataError, match=r"long\.jsonl:2: the example is 107 tokens, more than max_len=40 — "
                                        r"raise --max_len, or pass --overlong=truncate"):
        prepare(path, str(tmp_path / "e"), **kw)

    meta = prepare(path, str(tmp_path / "t"), overlong="truncate", **kw)
    got = examples(str(tmp_path / "t"), "train")
    # line 2 is cut to its first 40 tokens; line 3 is skipped: its prompt alone fills max_len
    assert (meta["truncated"], meta["skipped"]) == (1, 1) and len(got) == 3
    ids, mask = TOK.render(lines[1]["messages"])
    assert got[1] == (ids[:40], mask[:40])
    assert meta["length_min_median_p99_max"][-1] == 40

    meta = prepare(path, str(tmp_path / "s"), overlong="skip", **kw)
    assert (meta["truncated"], meta["skipped"]) == (0, 2)
    kept = [ids for ids, _ in examples(str(tmp_path / "s"), "train")]
    assert kept == [TOK.render(lines[i]["messages"])[0] for i in (0, 3)]


def test_overlong_dpo_truncates_each_side(tmp_path):
    same = "same start" * 5
    lines = [{"prompt": "p" * 10, "chosen": "c" * 50, "rejected": "r" * 20},  # chosen cut, rejected fits
             {"prompt": "p" * 10, "chosen": same + "A", "rejected": same + "B"},  # both sides equal once cut
             {"prompt": "p" * 60, "chosen": "a", "rejected": "b"}]  # the prompt alone is too long
    path = write_jsonl(tmp_path / "dpo.jsonl", lines)
    meta = prepare(path, str(tmp_path / "out"), TOK, max_len=40, overlong="truncate", val_fraction=0,
                   verbose=False)
    assert (meta["truncated"], meta["skipped"]) == (1, 2) and meta["counts"]["train"]["examples"] == 1
    assert meta["longest_example"] == 40 + len(TOK.render_pair("p" * 10, "c", "r" * 20)[1][0])
    (c, cm), (r, rm) = examples(str(tmp_path / "out"), "train")
    (c_full, cm_full), (r_full, rm_full) = TOK.render_pair("p" * 10, "c" * 50, "r" * 20)
    assert (c, cm) == (c_full[:40], cm_full[:40]) and (r, rm) == (r_full, rm_full)


# --------------------------------------------------------------------------------------------------
# prepare -> load

def test_prepare_load_round_trip_and_split(tmp_path):
    lines = [sft(f"What is {i}+{i}?", f"{i}+{i} = {2 * i}", "and again?", "same",
                 system="Be brief." if i % 3 else None) for i in range(300)]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    meta = prepare(path, str(tmp_path / "out"), "byte", val_fraction=0.2, seed=7, verbose=False)
    assert meta["kind"] == "sft" and meta["tokenizer"] == "byte" and meta["template"] == "simple"
    assert meta["vocab_size"] == 261 and meta["eos_id"] == 260
    data, meta2 = load(str(tmp_path / "out"), "train")
    ids, offsets, mask = data["ids"], data["offsets"], data["loss_mask"]
    assert meta2 == meta and isinstance(ids, np.memmap)
    assert (ids.dtype, offsets.dtype, mask.dtype) == (np.uint16, np.int64, np.uint8)
    assert offsets[0] == 0 and offsets[-1] == len(ids) == len(mask)
    train, val = examples(str(tmp_path / "out"), "train"), examples(str(tmp_path / "out"), "val")
    assert 30 < len(val) < 90 and len(train) + len(val) == 300
    # every line is in exactly one split, in file order, exactly as tok.render makes it
    rendered = [TOK.render(line["messages"]) for line in lines]
    assert sorted(train + val) == sorted(rendered)
    assert train == [r for r in rendered if r in train] and val == [r for r in rendered if r in val]
    assert meta["counts"]["train"]["target_tokens"] == sum(sum(m) for _, m in train)
    # the split is a function of the seed only
    prepare(path, str(tmp_path / "again"), TOK, val_fraction=0.2, seed=7, verbose=False)
    assert examples(str(tmp_path / "again"), "val") == val
    prepare(path, str(tmp_path / "other"), TOK, val_fraction=0.2, seed=8, verbose=False)
    assert examples(str(tmp_path / "other"), "val") != val
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        load(str(tmp_path / "missing"), "train")


def test_bom_crlf_and_blank_lines_are_fine(tmp_path):
    path = tmp_path / "win.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n\r\n" + json.dumps(GOOD).encode() + b"\r\n")
    meta = prepare(str(path), str(tmp_path / "out"), TOK, val_fraction=0, verbose=False)
    assert meta["counts"]["train"]["examples"] == 2
    assert examples(str(tmp_path / "out"), "train") == [TOK.render(GOOD["messages"])] * 2


def test_big_vocab_is_uint32(tmp_path):
    w = TokenWriter(str(tmp_path), "train", vocab_size=151_665)
    w.add([70_000, 1, 151_664], [0, 1, 1])
    w.add([5], [1])
    assert w.close() == dict(sequences=2, tokens=4, target_tokens=3)
    ids = np.load(tmp_path / "train_ids.npy")
    assert ids.dtype == np.uint32 and ids.tolist() == [70_000, 1, 151_664, 5]
    assert np.load(tmp_path / "train_offsets.npy").tolist() == [0, 3, 4]


# --------------------------------------------------------------------------------------------------
# DPO formats and shared-prompt inference

def test_dpo_formats_give_the_same_pairs(tmp_path):
    system, user = dict(role="system", content="Be nice."), dict(role="user", content="What is 2+2?")
    earlier = [dict(role="user", content="hi"), dict(role="assistant", content="hello")]
    prompt = [system] + earlier + [user]
    good, bad = dict(role="assistant", content="4"), dict(role="assistant", content="5")
    lines = [
        {"chosen": prompt + [good], "rejected": prompt + [bad]},        # prompt inferred
        {"prompt": prompt, "chosen": "4", "rejected": "5"},             # explicit, strings
        {"prompt": prompt, "chosen": [good], "rejected": [bad]},        # explicit, message lists
        {"prompt": "ignored", "chosen": prompt + [good], "rejected": prompt + [bad]},  # ultrafeedback layout
        {"prompt": "ignored", "chosen": prompt + [good], "rejected": prompt + [bad],  # ... with its messages column
         "messages": prompt + [good]},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", lines)
    meta = prepare(path, str(tmp_path / "out"), TOK, val_fraction=0, verbose=False)
    assert meta["kind"] == "dpo" and meta["counts"]["train"]["examples"] == 5
    got = examples(str(tmp_path / "out"), "train")
    expected = list(TOK.render_pair(prompt, "4", "5"))
    assert len(got) == 10 and all(got[2 * i:2 * i + 2] == expected for i in range(5))
    # the mask covers the final reply only, not the assistant turn inside the prompt
    (c, cm), (r, rm) = expected
    assert TOK.decode([t for t, m in zip(c, cm) if m]) == "4<|end|>"
    assert TOK.decode([t for t, m in zip(r, rm) if m]) == "5<|end|>"
    # a prompt string is one user turn; multi-message responses are kept whole
    write_jsonl(tmp_path / "p2.jsonl", [{"prompt": "Q", "chosen": [good, good], "rejected": [bad]}])
    prepare(str(tmp_path / "p2.jsonl"), str(tmp_path / "out2"), TOK, val_fraction=0, verbose=False)
    (c, cm), _ = examples(str(tmp_path / "out2"), "train")
    assert TOK.decode(c) == "<|bos|><|user|>Q<|end|><|assistant|>4<|end|><|assistant|>4<|end|>"
    assert TOK.decode([t for t, m in zip(c, cm) if m]) == "4<|end|>4<|end|>"


# --------------------------------------------------------------------------------------------------
# the built-in arithmetic dataset

def test_arithmetic_is_deterministic_and_split_disjoint():
    train = list(arithmetic.conversations("train", 3000))
    assert train == list(arithmetic.conversations("train", 3000))
    assert train != list(arithmetic.conversations("train", 3000, seed=1))
    val = list(arithmetic.conversations("val", 500))
    # held-out conversations: none of them is among the training ones (the fact table is shared)
    train_texts = {json.dumps(m) for m, _ in arithmetic.conversations("train", 20_000)}
    assert not {json.dumps(m) for m, _ in val} & train_texts
    # lengths really vary, and the answers check out
    lengths = [len(TOK.render(m)[0]) for m, _ in train]
    assert min(lengths) < 40 and max(lengths) > 150
    assert {len(m) // 2 for m, _ in train} == {1, 2, 3, 4}
    assert 0.2 < sum(m[0]["role"] == "system" for m, _ in train) / len(train) < 0.4
    plain = 0
    for messages, problems in train[:200]:
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [r.removeprefix("Sure! ") for r in replies] == [f"{a}{op}{b} = {arithmetic.OPS[op](a, b)}"
                                                               for a, op, b, _ in problems]
        plain += sum(map(arithmetic.preferred, replies))
    # both answer styles, mixed turn by turn: what SFT leaves to DPO
    assert 0.4 < plain / sum(len(m) // 2 for m, _ in train[:200]) < 0.6


def test_arithmetic_dpo_and_score():
    for pair, (messages, _) in zip(arithmetic.dpo_examples("val", 300), arithmetic.conversations("val", 300)):
        assert pair["prompt"] == messages[:-1] and pair["chosen"] == messages[-1]["content"].removeprefix("Sure! ")
    problems = arithmetic.val_problems(300)
    pairs = list(arithmetic.dpo_examples("val", 300))
    style_pairs = 0
    for (prompt, answer), pair in zip(problems, pairs):
        assert prompt == pair["prompt"] and prompt[-1]["role"] == "user"
        # chosen: right and plain; rejected: right but chatty, or plain but wrong
        assert arithmetic.score(answer, pair["chosen"]) and arithmetic.preferred(pair["chosen"])
        right, plain = arithmetic.score(answer, pair["rejected"]), arithmetic.preferred(pair["rejected"])
        assert right != plain
        style_pairs += right
    assert 0.65 < style_pairs / len(pairs) < 0.85  # 3 in 4 pairs teach the style
    score = arithmetic.score
    assert score(85, "37+48 = 85") and score(85, "85") and score(85, "The answer is 85.")
    for wrong in ("37+48 = 84", "", "37+48 =", "37+48 = 855", "85+1 = 86"):
        assert not score(85, wrong)
    assert score(-3, "2-5 = -3")


def test_arithmetic_rl_prompts_hard_split_and_reward():
    """RL prompts are the chats cut before their last answer (val: val_problems'); the hard chats are those whose last
    question is a + or - follow-up on the previous answer, taken from the same stream; train and held-out disjoint."""
    assert list(arithmetic.rl_prompts("val", 50)) == arithmetic.val_problems(50)
    for hard in (False, True):
        for split in ("train", "val"):
            chats = list(arithmetic.conversations(split, 300, hard=hard))
            for (prompt, answer), (messages, (*_, (a, op, b, _))) in zip(
                    arithmetic.rl_prompts(split, 300, hard=hard), chats):
                assert prompt == messages[:-1] and prompt[-1]["role"] == "user" and answer >= 0
                assert arithmetic.reward(prompt, messages[-1]["content"], answer) == 1.0  # either style
                assert arithmetic.reward(prompt, f"{a}{op}{b} = {answer + 1}", answer) == 0.0
    easy = list(arithmetic.conversations("train", 3000))
    hard = list(arithmetic.conversations("train", 300, hard=True))
    wanted = [c for c in easy if c[1][-1][3] and c[1][-1][1] in "+-"]  # the easy stream's follow-up +/- chats
    assert 0.1 < len(wanted) / len(easy) < 0.3 and hard == wanted[:300]
    assert any(len(p) == 1 for _, p in easy) and all(len(p) >= 2 for _, p in hard)
    train_texts = {json.dumps(m) for m, _ in hard}
    assert not {json.dumps(m) for m, _ in arithmetic.conversations("val", 300, hard=True)} & train_texts
    reward = arithmetic.reward
    assert reward([], "40+17 = 57", 57) == reward([], "Sure! 40+17 = 57", 57) == 1.0
    assert reward([], "40+17 = 56", 57) == reward([], "", 57) == reward([], "40+17 = 570", 57) == 0.0


def test_prepare_builtin_writes_once(tmp_path):
    out = str(tmp_path / "arith")
    meta = arithmetic.prepare_builtin(out, TOK, "dpo", n_train=300, n_val=50, verbose=False)
    assert meta["kind"] == "dpo" and meta["counts"]["train"]["examples"] == 300
    assert meta["counts"]["val"]["examples"] == 50
    stamp = os.path.getmtime(os.path.join(out, "train_ids.npy"))
    assert arithmetic.prepare_builtin(out, "byte", "dpo", n_train=300, n_val=50, verbose=False) == meta
    assert os.path.getmtime(os.path.join(out, "train_ids.npy")) == stamp  # cached, not rewritten
    pairs = examples(out, "val")
    for (c, cm), (r, rm), (prompt, answer) in zip(pairs[0::2], pairs[1::2], arithmetic.val_problems(50)):
        assert c[:len(TOK.render_prompt(prompt))] == TOK.render_prompt(prompt)
        reply = TOK.decode([t for t, m in zip(c, cm) if m])
        assert reply.endswith("<|end|>") and arithmetic.score(answer, reply[:-len("<|end|>")])
    meta = arithmetic.prepare_builtin(out, TOK, "sft", n_train=300, n_val=50, verbose=False)  # rebuilt
    assert meta["kind"] == "sft" and len(examples(out, "train")) == 300


def test_records_only_keys_a_prepared_folder_was_made_otherwise_are_named(tmp_path):
    """data=<prepared folder>: max_len, overlong, val_fraction, bad_records are not applied (the token files are used
    as they are), so a run setting them otherwise gets a note naming each; the same values, a folder this run
    prepares itself, or a val_input folder's absent val_fraction, none."""
    from data.dataset import ignored_keys_note
    path = write_jsonl(tmp_path / "chats.jsonl", [sft("hi", "hello")] * 4)
    folder = str(tmp_path / "p")
    prepare(path, folder, TOK, max_len=64, overlong="truncate", val_fraction=0.25, verbose=False)
    run = dict(data=folder, max_len=64, overlong="truncate", val_fraction=0.25, bad_records="error")
    assert ignored_keys_note(run, folder, max_seq_len=2048) == ""
    assert ignored_keys_note(dict(run, max_len=4096), folder, max_seq_len=64) == ""  # prepare_data's cap: 64 as well
    note = ignored_keys_note(dict(run, max_len=32, overlong="skip"), folder, max_seq_len=2048)
    assert note.startswith(f"note: {folder} holds prepared token files") and "max_len=32 (prepared with 64), " \
        "overlong='skip' (prepared with 'truncate') not applied" in note, note
    assert ignored_keys_note(dict(run, data=path, max_len=32), folder, max_seq_len=2048) == ""  # records: applied
