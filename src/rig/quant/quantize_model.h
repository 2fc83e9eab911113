// `rig quantize`: a bf16/fp32 Hugging Face model folder written once in bitsandbytes' 4-bit form,
// as transformers saves a model loaded with BitsAndBytesConfig(load_in_4bit=True, ...): the
// decoder's linear weights packed (six tensors each), embeddings, norms and lm_head unchanged,
// config.json with quantization_config. One tensor is quantized at a time and the output goes
// out shard by shard, so memory stays near one shard.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "rig/quant/nf4.h"

namespace rig::quant {

struct QuantizeModelOptions {
  QuantConfig config;                           // type, blocksize, double quantization
  size_t max_shard_bytes = size_t(5000000000);  // transformers' default "5GB"
};

struct QuantizeModelResult {
  int64_t quantized = 0;         // linear weights quantized
  int64_t kept = 0;              // tensors written unchanged
  int64_t quantized_params = 0;  // weights inside the quantized tensors
  size_t bytes_in = 0, bytes_out = 0;
  int shards = 1;
};

// Reads `in_dir`, writes `out_dir` (created; files atomically, the index and config.json last).
// Other files of the folder (tokenizer, generation config) are copied.
QuantizeModelResult quantize_model(const std::string& in_dir, const std::string& out_dir,
                                   const QuantizeModelOptions& opt = {});

}  // namespace rig::quant
