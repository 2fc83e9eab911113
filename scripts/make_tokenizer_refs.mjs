// Same as make_tokenizer_refs.py, with Hugging Face's Rust `tokenizers` through its Node binding
// (npm package `tokenizers`, which ships the native library), for machines with npm but no pip.
//
// usage: (cd /tmp/hftok && npm install tokenizers@0.23.2)
//        NODE_PATH=/tmp/hftok/node_modules node scripts/make_tokenizer_refs.mjs \
//            TOKENIZER_JSON TEXTS OUT_JSON
// TEXTS: a JSON list of strings, a fixture with "text" fields, or one text per line.
import { createRequire } from "module";
import fs from "fs";

const require = createRequire(import.meta.url);
const { Tokenizer } = require("tokenizers");

const [tokPath, textsPath, outPath] = process.argv.slice(2);
if (!outPath) {
  console.error("usage: node make_tokenizer_refs.mjs TOKENIZER_JSON TEXTS OUT_JSON");
  process.exit(2);
}
const raw = fs.readFileSync(textsPath, "utf8");
let texts;
try {
  texts = JSON.parse(raw).map((d) => (typeof d === "string" ? d : d.text));
} catch {
  texts = raw.split("\n");
}
const tok = Tokenizer.fromFile(tokPath);
const out = [];
for (const text of texts) {
  const enc = await tok.encode(text, null, { addSpecialTokens: false });
  const ids = enc.getIds();
  out.push({ text, ids, decoded: await tok.decode(ids, false) });
}
// Python's json.dump(ensure_ascii=False) separators, so files from either script look alike.
fs.writeFileSync(outPath, "[" + out.map((o) => `{"text": ${JSON.stringify(o.text)}, "ids": [${o.ids.join(", ")}], "decoded": ${JSON.stringify(o.decoded)}}`).join(", ") + "]");
console.log(`wrote ${out.length} references to ${outPath}`);
