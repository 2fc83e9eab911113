// Reference ids for the prompt templates: each record rendered as ONE string (the way HF's
// apply_chat_template and the Alpaca scripts do) and encoded by HF tokenizers (npm binding), to
// check that rig's per-segment tokenization gives the same ids.
// usage: NODE_PATH=/tmp/hftok/node_modules node scripts/make_template_refs.mjs TOKENIZER_JSON {llama3|chatml|alpaca} RECORDS_JSONL OUT_JSON
import { createRequire } from "module";
import fs from "fs";
const require = createRequire(import.meta.url);
const { Tokenizer } = require("tokenizers");
const [tokPath, kind, recPath, outPath] = process.argv.slice(2);
const tok = Tokenizer.fromFile(tokPath);
const render = {
  llama3: (r) => "<|begin_of_text|>" + r.messages.map((m) =>
    `<|start_header_id|>${m.role}<|end_header_id|>\n\n${m.content.trim()}<|eot_id|>`).join(""),
  chatml: (r) => r.messages.map((m) => `<|im_start|>${m.role}\n${m.content}<|im_end|>\n`).join(""),
  alpaca: (r) => "<|begin_of_text|>" + (r.input
    ? `Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n${r.instruction}\n\n### Input:\n${r.input}\n\n### Response:\n`
    : `Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n${r.instruction}\n\n### Response:\n`) + r.output + "<|end_of_text|>",
}[kind];
const out = [];
for (const line of fs.readFileSync(recPath, "utf8").split("\n")) {
  if (!line.trim()) continue;
  const text = render(JSON.parse(line));
  const enc = await tok.encode(text, null, { addSpecialTokens: false });
  out.push({ text, ids: enc.getIds() });
}
fs.writeFileSync(outPath, JSON.stringify(out));
console.log(`wrote ${out.length} to ${outPath}`);
