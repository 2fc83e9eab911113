#!/usr/bin/env python3
"""Writes tokenizer reference fixtures for tests/unit/tokenizer_test.cpp.

usage: make_tokenizer_refs.py TOKENIZER_JSON TEXTS OUT_JSON

TEXTS is either a JSON list of strings, a JSON fixture of the same shape as the output (its
"text" fields are reused), or a plain text file with one text per line. The output is a JSON list of
{"text", "ids", "decoded"}: ids from Hugging Face `encode(text, add_special_tokens=False)` and
`decoded` from its `decode(ids)`, exactly like tests/data/tokenizer/tok_llama3_public.json.

Example (Llama 2 references from the same texts as the Llama 3 ones):
  pip install tokenizers
  python3 scripts/make_tokenizer_refs.py third_party/cache/tokenizer-llama2/tokenizer.json \
      tests/data/tokenizer/tok_llama3_public.json tests/data/tokenizer/tok_llama2_public.json
"""
import json
import sys


def load_texts(path):
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return raw.split("\n")
    if not isinstance(data, list):
        sys.exit(f"{path}: expected a JSON list")
    return [d["text"] if isinstance(d, dict) else d for d in data]


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    from tokenizers import Tokenizer  # the Hugging Face Rust tokenizer, not transformers

    tok = Tokenizer.from_file(sys.argv[1])
    out = []
    for text in load_texts(sys.argv[2]):
        ids = tok.encode(text, add_special_tokens=False).ids
        out.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    with open(sys.argv[3], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)
    print(f"wrote {len(out)} references to {sys.argv[3]}")


if __name__ == "__main__":
    main()
