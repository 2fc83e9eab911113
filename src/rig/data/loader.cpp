#include "rig/data/loader.h"

#include <algorithm>

#include "rig/core/error.h"

namespace rig {

namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, n) without modulo bias (Lemire's method with rejection).
uint64_t below(uint64_t& state, uint64_t n) {
  for (;;) {
    unsigned __int128 m = (unsigned __int128)splitmix64(state) * n;
    uint64_t lo = uint64_t(m);
    if (lo >= n || lo >= (-n) % n) return uint64_t(m >> 64);
  }
}

}  // namespace

nlohmann::json LoaderState::to_json() const { return {{"epoch", epoch}, {"index", index}}; }

LoaderState LoaderState::from_json(const nlohmann::json& j) {
  LoaderState s;
  for (const char* k : {"epoch", "index"})
    if (!j.is_object() || !j.contains(k) || !j[k].is_number_unsigned())
      bad_input("data loader state: field '{}': expected a non-negative integer in {}", k, j.dump());
  s.epoch = j["epoch"].get<uint64_t>();
  s.index = j["index"].get<uint64_t>();
  return s;
}

std::vector<uint64_t> rank_order(uint64_t n, uint64_t seed, uint64_t epoch, int rank, int world) {
  std::vector<uint64_t> perm(n);
  for (uint64_t i = 0; i < n; ++i) perm[i] = i;
  uint64_t st = seed ^ (epoch * 0xD1B54A32D192ED03ull);
  splitmix64(st);
  for (uint64_t i = n; i > 1; --i) std::swap(perm[i - 1], perm[below(st, i)]);
  uint64_t per = n / uint64_t(world);
  std::vector<uint64_t> out(per);
  for (uint64_t k = 0; k < per; ++k) out[k] = perm[uint64_t(rank) + k * uint64_t(world)];
  return out;
}

DataLoader::DataLoader(std::shared_ptr<const TokenDataset> data, const LoaderOptions& opt)
    : data_(std::move(data)), opt_(opt) {
  RIG_CHECK(data_ != nullptr, "DataLoader needs a dataset");
  if (opt.seq_len < 2) bad_input("sequence length {} is too short (at least 2)", opt.seq_len);
  if (opt.micro_batch < 1) bad_input("micro batch size {} must be at least 1", opt.micro_batch);
  if (opt.world < 1 || opt.rank < 0 || opt.rank >= opt.world)
    bad_input("rank {} of world {} is not valid", opt.rank, opt.world);
  per_rank_ = data_->size() / uint64_t(opt.world);
  if (per_rank_ == 0)
    bad_input("dataset has {} samples, fewer than the {} ranks", data_->size(), opt.world);
}

void DataLoader::restore(const LoaderState& s) {
  if (s.index >= per_rank_)
    bad_input("data loader state index {} is past this rank's {} samples per epoch (different "
              "dataset or world size?)", s.index, per_rank_);
  state_ = s;
}

uint64_t DataLoader::current_sample() {
  if (order_epoch_ != state_.epoch) {
    order_ = rank_order(data_->size(), opt_.seed, state_.epoch, opt_.rank, opt_.world);
    order_epoch_ = state_.epoch;
  }
  return order_[state_.index];
}

Batch DataLoader::next() {
  const int64_t B = opt_.micro_batch, T = opt_.seq_len;
  Batch b;
  b.input_ids = Tensor::empty({B, T}, DType::I64, Device::cpu(), "batch input_ids");
  b.labels = Tensor::empty({B, T}, DType::I64, Device::cpu(), "batch labels");
  b.position_ids = Tensor::empty({B, T}, DType::I64, Device::cpu(), "batch position_ids");
  b.segment_ids = Tensor::empty({B, T}, DType::I64, Device::cpu(), "batch segment_ids");
  int64_t* in = b.input_ids.data<int64_t>();
  int64_t* lab = b.labels.data<int64_t>();
  int64_t* pos = b.position_ids.data<int64_t>();
  int64_t* seg = b.segment_ids.data<int64_t>();
  std::vector<int32_t> cu{0};
  auto advance = [&] {
    if (++state_.index >= per_rank_) {
      state_.index = 0;
      ++state_.epoch;
    }
  };
  uint64_t skipped_in_a_row = 0;
  for (int64_t r = 0; r < B; ++r) {
    int64_t p = 0, s = 0;
    for (;;) {
      uint64_t idx = current_sample();
      auto ids = data_->ids(idx);
      auto train = data_->train(idx);
      int64_t len = std::min<int64_t>(int64_t(ids.size()), T);
      bool any = false;
      for (int64_t k = 1; k < len && !any; ++k) any = train[size_t(k)] != 0;
      if (!any) {  // nothing left to learn after truncation
        advance();
        if (++skipped_in_a_row > per_rank_)
          bad_input("no sample has a trained token within the first {} tokens", T);
        continue;
      }
      skipped_in_a_row = 0;
      if (p + len > T) break;  // does not fit: it starts the next row
      ++s;
      for (int64_t k = 0; k < len; ++k) {
        int64_t o = r * T + p + k;
        in[o] = ids[size_t(k)];
        lab[o] = (k > 0 && train[size_t(k)]) ? ids[size_t(k)] : -100;
        pos[o] = k;
        seg[o] = s;
        b.trained_tokens += lab[o] != -100;
      }
      cu.push_back(cu.back() + int32_t(len));
      b.max_seqlen = std::max(b.max_seqlen, len);
      p += len;
      ++b.samples;
      advance();
      if (!opt_.pack || p == T) break;
    }
    for (int64_t k = p; k < T; ++k) {
      int64_t o = r * T + k;
      in[o] = opt_.pad_id;
      lab[o] = -100;
      pos[o] = k - p;
      seg[o] = 0;
    }
    if (p < T) {
      cu.push_back(cu.back() + int32_t(T - p));
      b.max_seqlen = std::max(b.max_seqlen, T - p);
    }
  }
  b.cu_seqlens = Tensor::empty({int64_t(cu.size())}, DType::I32, Device::cpu(), "batch cu_seqlens");
  std::copy(cu.begin(), cu.end(), b.cu_seqlens.data<int32_t>());
  return b;
}

}  // namespace rig
