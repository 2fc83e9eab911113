// 4-bit weights drawn straight as codes (random models): any byte range equals the same range of
// the whole draw, and the decoded weights look like normal(0, 0.02) blocks quantized.
#include "rig/quant/random_codes.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "rig/model/llama.h"
#include "rig/quant/nf4.h"

using namespace rig;
using namespace rig::quant;

TEST(RandomCodes, AnyByteRangeEqualsThatRangeOfTheWholeDraw) {
  for (bool nested : {true, false}) {
    QuantizedWeight q = drawn_4bit_skeleton({96, 200}, QuantType::NF4, 64, nested);
    QuantizedWeight whole = q;
    draw_4bit(whole, 7);
    for (const auto& st : stored_tensors(q)) {
      const Tensor& t = whole.*st.field;
      ASSERT_TRUE(t.defined());
      ASSERT_EQ(t.nbytes(), st.nbytes());
      const auto* all = static_cast<const uint8_t*>(t.raw());
      const int64_t n = int64_t(st.nbytes());
      for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{
               {0, n}, {1, n - 3}, {5, 6}, {n / 3, n / 2 + 1}, {n - 1, n}}) {
        std::vector<uint8_t> part(size_t(e - b));
        draw_4bit_bytes(q, 7, st.field, b, e, part.data());
        for (int64_t i = b; i < e; ++i)
          ASSERT_EQ(part[size_t(i - b)], all[i]) << "nested " << nested << " byte " << i;
      }
    }
    // Another seed, other codes.
    QuantizedWeight other = q;
    draw_4bit(other, 8);
    EXPECT_NE(std::memcmp(other.packed.raw(), whole.packed.raw(), whole.packed.nbytes()), 0);
  }
}

TEST(RandomCodes, DecodedWeightsAreCenteredWithTheSpreadOfQuantizedNormalBlocks) {
  QuantizedWeight q = drawn_4bit_skeleton({512, 512}, QuantType::NF4, 64, true);
  draw_4bit(q, 3);
  Tensor w = Tensor::empty({512, 512}, DType::F32);
  dequantize_4bit(q, w);
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    sum += w.f32()[i];
    sq += double(w.f32()[i]) * w.f32()[i];
  }
  const double mean = sum / double(w.numel()), sd = std::sqrt(sq / double(w.numel()) - mean * mean);
  // Uniform NF4 indices times block scales near 0.048: the mean and rms of the 16 levels, scaled.
  double lm = 0, l2 = 0;
  for (float c : code_table(QuantType::NF4)) {
    lm += c / 16.0;
    l2 += double(c) * c / 16.0;
  }
  EXPECT_NEAR(mean, lm * 0.048, 0.05 * lm * 0.048);
  EXPECT_NEAR(sd, std::sqrt(l2 - lm * lm) * 0.048, 0.05 * std::sqrt(l2) * 0.048);
  for (float a : effective_absmax(q)) {
    EXPECT_GE(a, 0.040f - 1e-6f);
    EXPECT_LE(a, 0.056f + 1e-6f);
  }
}

TEST(RandomCodes, RandomModelMaterializesTheBytesItDrawsOnDemand) {
  ModelConfig cfg = ModelConfig::from_json({{"model_type", "llama"},
                                            {"vocab_size", 64},
                                            {"hidden_size", 32},
                                            {"intermediate_size", 64},
                                            {"num_hidden_layers", 2},
                                            {"num_attention_heads", 4},
                                            {"num_key_value_heads", 2}},
                                           "test");
  LoadOptions lo;
  lo.quantize = lo.draw_codes = true;
  auto m = LlamaModel::random(cfg, 11, lo);
  ASSERT_TRUE(m->codes_deferred());
  // Deferred: nothing stored yet; the per-range draw is what materialize_4bit stores.
  std::vector<std::vector<uint8_t>> drawn;
  for (size_t i = 0; i < m->params().size(); ++i) {
    const auto& p = m->params()[i];
    if (!p.quant) continue;
    EXPECT_FALSE(p.quant->packed.defined());
    std::vector<uint8_t> b((p.quant->numel() + 1) / 2);
    m->deferred_4bit_bytes(i, &QuantizedWeight::packed, 0, int64_t(b.size()), b.data());
    drawn.push_back(std::move(b));
  }
  ASSERT_EQ(drawn.size(), 14u);
  m->materialize_4bit(Device::cpu());
  EXPECT_FALSE(m->codes_deferred());
  size_t k = 0;
  for (const auto& p : m->params()) {
    if (!p.quant) continue;
    ASSERT_TRUE(p.quant->packed.defined());
    EXPECT_EQ(std::memcmp(p.quant->packed.raw(), drawn[k].data(), drawn[k].size()), 0) << p.name;
    ++k;
  }
}
