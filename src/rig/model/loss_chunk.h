// How many rows of logits the loss materialises at once when the caller does not say.
#pragma once
#include <algorithm>
#include <cstdint>

namespace rig {

// About 512 MiB of logits, in steps of 256 rows. The loss writes the logits' gradient over them,
// so this is its whole working set: 2048 rows of a 128k vocabulary in bf16, 1024 in float32.
// Larger chunks make the LM head's products more efficient; this size costs less than one layer's
// saved activations on the models rig targets.
inline int64_t loss_chunk_rows_for(int64_t vocab, int64_t logit_bytes) {
  const int64_t budget = int64_t(512) << 20, row = std::max<int64_t>(1, vocab * logit_bytes);
  return std::max<int64_t>(256, budget / row / 256 * 256);
}

// Vocabulary rows in one slice of a frozen lm_head that a sharded run gathers for the loss (about
// 256 MiB each, so two in flight cost less than the whole matrix); all of them when they fit one.
inline int64_t head_slice_rows_for(int64_t vocab, int64_t row_bytes,
                                   int64_t slice_bytes = int64_t(256) << 20) {
  return std::min(vocab, std::max<int64_t>(1, slice_bytes / std::max<int64_t>(1, row_bytes)));
}

}  // namespace rig
