// What the tensor prefixes of a sharded checkpoint hold, shared by Sharded::load
// (parallel_sharded.cpp) and the checkpoint readers (parallel_resume.cpp). Internal to the train
// module.
#pragma once
#include <cstdint>
#include <string>

#include "rig/ops/adamw8bit.h"
#include "rig/train/parallel.h"

namespace rig::shard_state {

// What a checkpoint prefix holds: its element type, and whether it counts blocks of 256.
struct StateKind {
  DType dtype = DType::F32;
  bool per_block = false;
};
inline StateKind kind_of(const std::string& prefix) {
  if (prefix == "adamw8bit.mq." || prefix == "adamw8bit.vq.") return {DType::U8, false};
  if (prefix == "adamw8bit.mabs." || prefix == "adamw8bit.vabs.") return {DType::F32, true};
  return {};
}
inline int64_t blocks_of(int64_t n) {
  return (n + ops::kAdam8Block - 1) / ops::kAdam8Block;
}
// A tensor's length under a prefix: elements, or blocks.
inline int64_t length_of(int64_t numel, const StateKind& k) {
  return k.per_block ? blocks_of(numel) : numel;
}
// Which of a unit's params a prefix holds: 8-bit moments only for the 8-bit ones, float32
// moments only for the others.
inline bool holds(const std::string& prefix, const FlatUnit& u, size_t j) {
  if (prefix.rfind("adamw8bit.", 0) == 0) return u.eight_bit(j);
  if (prefix.rfind("adamw.", 0) == 0) return !u.eight_bit(j);
  return true;
}

}  // namespace rig::shard_state
