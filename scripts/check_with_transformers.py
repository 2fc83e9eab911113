#!/usr/bin/env python3
"""Loads what rig wrote into Hugging Face transformers and PEFT and compares logits with rig's.
Run on a machine with torch, transformers and peft:
  python3 scripts/check_with_transformers.py BASE_MODEL ADAPTER_BY_RIG MERGED_BY_RIG RIG_LOGITS_DIR BATCH
RIG_LOGITS_DIR holds merged.safetensors and adapter.safetensors from `rig debug forward-backward`
(logits key). BATCH is a safetensors file with input_ids."""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from peft import PeftModel


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main():
    base, adapter, merged, logits_dir, batch = sys.argv[1:6]
    ids = load_file(batch)["input_ids"]
    out = {}
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
        hf = m(input_ids=ids).logits
        out["merged_vs_rig"] = rel(load_file(logits_dir + "/merged.safetensors")["logits"], hf)
        b = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        pm = PeftModel.from_pretrained(b, adapter).eval()
        hp = pm(input_ids=ids).logits
        out["peft_adapter_vs_rig"] = rel(load_file(logits_dir + "/adapter.safetensors")["logits"], hp)
        out["merged_vs_peft"] = rel(hf, hp)
    print(json.dumps(out))
    bad = {k: v for k, v in out.items() if not v < 1e-4}
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
