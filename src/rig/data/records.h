// Training records: reading datasets (Alpaca JSONL, chat JSONL, raw text, pre-tokenized
// safetensors) and rendering each record with a prompt format into token ids plus a per-token
// "train" flag (1 = the loss sees this token as a target).
//
// Prompt formats (prompt and response are tokenized separately, so the mask boundary is always a
// token boundary; template text that holds control tokens is tokenized with special=true, user
// content with special=false so "<|eot_id|>" typed in data stays plain text):
//  * Alpaca (records with instruction/input/output), the Stanford/alpaca-lora template:
//      [BOS] "Below is an instruction that describes a task, paired with an input that provides
//      further context. Write a response that appropriately completes the request.\n\n
//      ### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n" {output} EOS
//    and without input (empty or absent "input"):
//      [BOS] "Below is an instruction that describes a task. Write a response that appropriately
//      completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n" {output} EOS
//    BOS is <|begin_of_text|> or <s> when the tokenizer has one; EOS is <|end_of_text|>, </s> or
//    <|endoftext|>. Trained: output and EOS.
//  * Llama 3 chat: <|begin_of_text|> then per message
//      <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
//    Trained: each assistant content and its <|eot_id|>.
//  * ChatML (Qwen): per message  <|im_start|>{role}\n{content}<|im_end|>\n
//    Trained: each assistant content and its <|im_end|>.
//  * The model's own chat template, with `auto` when a tokenizer_config.json holding a
//    chat_template (or a chat_template.jinja) sits beside tokenizer.json: each record rendered
//    as transformers' apply_chat_template(messages, tools=record["tools"]) renders it
//    (rig/text/chat_template.h) and tokenized as HF tokenizes that string (special tokens
//    matched). Trained: the {% generation %} spans when the template has them (transformers'
//    return_assistant_tokens_mask); otherwise each assistant turn, from the end of the
//    conversation before it rendered with add_generation_prompt=True (which must be a prefix of
//    the whole rendering) to the first special token after it, inclusive (<|im_end|>,
//    <|eot_id|>, <end_of_turn>, </s>). A record the template refuses (raise_exception) is
//    invalid, with the template's message. Without such a file `auto` picks a built-in below.
//  * Raw text: [BOS] line EOS, all trained.  Pre-tokenized rows: all trained.
// With train_on_all every token is trained.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "rig/text/tokenizer.h"

namespace rig {

enum class DataFormat { Auto, Alpaca, Chat, Text, Tokens };
enum class ChatTemplate { Auto, Llama3, ChatML };

DataFormat parse_data_format(const std::string& s);      // "auto", "alpaca", "chat", "text", "tokens"
ChatTemplate parse_chat_template(const std::string& s);  // "auto", "llama3", "chatml"
std::string data_format_name(DataFormat f);
std::string chat_template_name(ChatTemplate t);

// Picks the format from the extension (.txt, .safetensors) or the first JSONL record's fields.
DataFormat detect_data_format(const std::string& path);
// Llama 3 when the tokenizer has <|start_header_id|>, ChatML when it has <|im_start|>.
ChatTemplate detect_chat_template(const Tokenizer& tok);

// One tokenized training sample.
struct Sample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> train;  // same length; 1 where the token is a loss target
};

struct RenderOptions {
  DataFormat format = DataFormat::Auto;
  ChatTemplate chat = ChatTemplate::Auto;
  bool train_on_all = false;
  bool skip_invalid = false;  // count and skip bad records instead of failing on the first
  int threads = 0;            // tokenization threads (0: all)
  // Pre-tokenized data: every id must be below this (the model's vocab_size), checked at load so
  // the error names the file and the row; 0: not checked.
  int64_t vocab_limit = 0;
};

struct RenderStats {
  size_t records = 0;   // records read (valid or not)
  size_t samples = 0;   // samples produced
  size_t invalid = 0;   // skipped with skip_invalid
  std::string first_invalid;  // message of the first skipped record
  uint64_t tokens = 0, trained_tokens = 0;
  // What chat records were rendered with: "llama3", "chatml", or the model's template file.
  std::string chat_template;
};

// Reads and tokenizes a whole dataset. Bad records throw InputError "FILE:LINE: field 'F': what"
// unless skip_invalid is set, in which case they are counted in stats.
std::vector<Sample> load_samples(const std::string& path, const Tokenizer* tok,
                                 const RenderOptions& opt, RenderStats* stats = nullptr);

}  // namespace rig
