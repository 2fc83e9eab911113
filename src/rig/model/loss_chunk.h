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

}  // namespace rig
