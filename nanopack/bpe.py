"""
A Hugging Face tokenizer.json's byte-level BPE in tiktoken's terms: GPT-2's byte alphabet, and the
pre-tokenizer as one split regex.
"""
# tiktoken's regex dialect, same as the Hugging Face tokenizers one for this
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def split_regex(pre, unsupported):
    """A tokenizer.json pre_tokenizer -> one tiktoken split regex, or raise if there is none."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    kinds = [s.get("type") for s in steps]
    byte_level = steps[-1] if kinds[-1:] == ["ByteLevel"] else None
    if byte_level is None or byte_level.get("add_prefix_space"):
        raise unsupported("pre_tokenizer",
                          f"{kinds} does not end in ByteLevel without add_prefix_space")
    use_regex = byte_level.get("use_regex", True)
    if kinds == ["ByteLevel"] and use_regex:  # GPT-2
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not use_regex:  # Llama-3, Qwen2
        split = steps[0]
        pat = split.get("pattern", {}).get("Regex")
        if pat is None or split.get("behavior") != "Isolated" or split.get("invert"):
            raise unsupported("pre_tokenizer",
                              f"Split {split} is not an isolated, non-inverted regex")
        # Hugging Face keeps the text between matches as its own pieces; tiktoken would drop it,
        # so the second alternative matches such a stretch (a no-op for patterns that cover all
        # text)
        return f"{pat}|(?:(?!(?:{pat}))[\\s\\S])+"
    if kinds == ["Digits", "ByteLevel"] and use_regex:  # SmolLM2, StarCoder
        # Digits cuts around digits, then GPT-2's regex runs on each stretch. As one regex: digits
        # stand alone, and whitespace just before a digit is matched whole (the (?!\S) lookahead
        # would keep its last space back).
        digits = r"\p{N}" if steps[0].get("individual_digits") else r"\p{N}+"
        return GPT2_PATTERN.replace(r" ?\p{N}+", digits).replace(r"\s+(?!\S)",
                                                                 r"\s+(?=\p{N})|\s+(?!\S)")
    raise unsupported("pre_tokenizer", f"{kinds} cannot be expressed as one tiktoken split regex")


def bytes_to_unicode():
    """GPT-2's map from each byte to a printable character (how byte-level BPE vocabs are
    spelled)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    # control bytes and space, to 256.. so every token prints
    moved = [b for b in range(256) if b not in printable]
    return {b: chr(b) if b in printable else chr(256 + moved.index(b)) for b in range(256)}
