#!/usr/bin/env python3
"""Writes the built-in demo's bundled data: a byte-level tokenizer.json and a chat dataset of a
synthetic task (reverse the letters of a word), so held-out exact match measures real learning.
Deterministic; run from the repository root: python3 scripts/make_demo_data.py"""
import json
import random


def bytes_to_unicode():
    # GPT-2's printable mapping of the 256 byte values, as Hugging Face's ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def tokenizer():
    vocab = {ch: b for b, ch in sorted(bytes_to_unicode().items())}
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    added = [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(specials)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def main():
    rng = random.Random(2026)
    seen = set()
    rows = []
    while len(rows) < 6000:
        n = rng.randint(3, 6)
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
        if w in seen:
            continue
        seen.add(w)
        rows.append({"messages": [{"role": "user", "content": "reverse " + w},
                                  {"role": "assistant", "content": w[::-1]}]})
    with open("data/demo/tokenizer.json", "w") as f:
        json.dump(tokenizer(), f, ensure_ascii=False)
    with open("data/demo/reverse.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
