// The training loop: a TrainConfig in, a run folder out (resolved config, metrics.jsonl, a human
// log, checkpoints, the final adapter or model). In a distributed run (rig's launcher, torchrun,
// Slurm, or a communicator handed in) every rank calls train(): data-parallel or sharded by
// `strategy`, rank 0 alone writes the run folder.
#pragma once
#include <atomic>
#include <functional>
#include <random>
#include <memory>
#include <string>
#include <vector>

#include "rig/data/dataset.h"
#include "rig/model/llama.h"
#include "rig/text/tokenizer.h"
#include "rig/train/train_config.h"

namespace rig {

struct TrainResult {
  int64_t steps = 0;          // optimizer steps done in total
  double final_loss = 0;      // mean loss of the last step
  double eval_loss = -1;      // -1: no held-out data
  double exact_match = -1;    // fraction of held-out samples generated exactly; -1: not measured
  bool interrupted = false;   // stopped by a signal after saving a checkpoint
  int64_t skipped_steps = 0;  // optimizer steps the guard skipped (NaN/Inf), over the whole run
  int64_t rollbacks = 0;      // times the guard went back to a checkpoint, over the whole run
  std::string output;         // the final adapter or model folder
  std::vector<std::string> samples;  // a few "prompt -> generated (expected)" lines
};

namespace dist {
class Communicator;
}

struct TrainHooks {
  std::function<bool()> should_stop;  // polled between steps (signals)
  bool quiet = false;                 // no progress output (tests)
  // The ranks to train with (tests run ranks as threads); null: from the process environment.
  dist::Communicator* comm = nullptr;
  // Tests: before optimizer step N (from 1) is computed, draw and drop this many global batches.
  // A clean run that skipped the batches a guarded run skipped is the reference it must equal.
  std::function<int64_t(int64_t step)> discard_batches = {};
};

// Runs (or resumes, when run_dir holds a checkpoint and cfg.resume allows it) a training run.
TrainResult train(const TrainConfig& cfg, const TrainHooks& hooks = {});

// Builds the model a config describes (pretrained or random, with LoRA attached).
struct BuildOptions {
  bool sharded = false;  // a rank of a sharded run: it makes only the 4-bit bytes its shards hold
  bool bf16 = false;     // bf16 compute follows: a LoRA/QLoRA base stored in bf16 stays bf16
};
std::unique_ptr<LlamaModel> build_model(const TrainConfig& cfg, const BuildOptions& b = {});

// Held-out evaluation helpers, shared by `rig eval`.
struct EvalResult {
  double loss = 0;
  int64_t tokens = 0;
  double exact_match = -1;
  std::vector<std::string> samples;
};
// `hooks` as in training (sharded: each layer gathered for its forward and released after it, so a
// model larger than one card is evaluated in the memory that trains it).
EvalResult evaluate(LlamaModel& model, const TokenDataset& data, int64_t seq_len,
                    int64_t micro_batch, int64_t max_batches = 0, StepHooks* hooks = nullptr);
// Greedy-generates each sample's trained tokens from its prompt (the tokens before the first
// trained one) and counts exact matches over the first `n` samples.
EvalResult exact_match(LlamaModel& model, const TokenDataset& data, const Tokenizer& tok,
                       int64_t n, int64_t show = 3);

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  float temperature = 0;  // 0: greedy
  float top_p = 1;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;
  // Only ids below this are generated (0: the model's vocabulary). Models often pad their
  // vocabulary past the tokenizer's; those rows are never valid output.
  int64_t vocab_limit = 0;
};
// What one generate() call measured (rig generate --stats). The prompt runs as one pass; its
// time counts until the first new token is known, so prefill_ms is the time to the first token
// and decode_ms covers the new_tokens - 1 that follow, one decode step each.
struct GenerateStats {
  int64_t prompt_tokens = 0, new_tokens = 0;
  double prefill_ms = 0, decode_ms = 0;
  double decode_tokens_per_s() const {
    return new_tokens > 1 && decode_ms > 0 ? double(new_tokens - 1) * 1000.0 / decode_ms : 0.0;
  }
};
// Greedy (temperature 0) on a GPU picks each token there (LlamaModel::decode_greedy): a step
// reads back one id, and the id feeds the next step without a copy to the device. Sampling, and
// the CPU, read the last row's logits back and pick on the host (sample_token).
std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, GenerateStats* stats = nullptr);
// InputError naming the flag when a setting is out of range: temperature finite and >= 0, top_p
// in (0, 1], max_new_tokens in [0, 1e6].
void check_generate_options(const GenerateOptions& opt);
// One token from `logits` as generate() draws it: the argmax at temperature 0, else softmax at
// `temperature`, cut to the smallest set of most likely tokens whose mass reaches top_p (at least
// one), renormalised.
int32_t sample_token(const std::vector<float>& logits, float temperature, float top_p,
                     std::mt19937_64& rng);

}  // namespace rig
