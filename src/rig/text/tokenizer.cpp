// The Tokenizer facade: loads tokenizer.json into the pipeline stages (tokenizer_*.cpp) and runs
// encoding through them: added tokens -> normalizer -> pre-tokenizer -> BPE -> post-processor.
#include "rig/text/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "rig/io/atomic_file.h"
#include "rig/text/tokenizer_internal.h"

namespace rig {

using json = nlohmann::json;

namespace {
std::atomic<uint64_t> g_serial{1};
}

// ---------------------------------------------------------------------------------------------
// Loading

void Tokenizer::Impl::load(const json& j) {
  const std::string& name = path;
  const json& m = j.value("model", json());
  if (!m.is_object()) bad_input("{}: missing 'model'", name);
  std::string type = m.value("type", "BPE");
  if (type != "BPE") bad_input("{}: model.type '{}' is not supported (only BPE)", name, type);
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
    bad_input("{}: model.dropout is not supported", name);
  const json& vocab = m.value("vocab", json());
  if (!vocab.is_object()) bad_input("{}: model.vocab: expected an object", name);
  int32_t max_id = -1;
  const json& added_list = j.value("added_tokens", json::array());
  const tok::IdReader id_of{4 * int64_t(vocab.size() + added_list.size()) + 4096, vocab.size()};
  model.load_vocab(vocab, name, id_of, max_id);
  added.load(added_list, name, id_of, max_id);
  index_ids(max_id);
  model.load_merges(m, name);
  model.load_options(m, name);
  load_pipeline(j);
}

void Tokenizer::Impl::index_ids(int32_t max_id) {
  id_to_tok.assign(size_t(max_id + 1), std::string());
  is_special.assign(size_t(max_id + 1), false);
  for (const auto& [k, v] : model.vocab) id_to_tok[size_t(v)] = k;
  for (const auto& a : added.tokens) {
    id_to_tok[size_t(a.id)] = a.content;
    is_special[size_t(a.id)] = a.special;
  }
  added.index();
}

void Tokenizer::Impl::load_pipeline(const json& j) {
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    normalizer.push_back(tok::Normalizer::parse(j["normalizer"], path + ": normalizer"));
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
    pre.push_back(tok::PreTokenizer::parse(j["pre_tokenizer"], path + ": pre_tokenizer"));
  if (j.contains("decoder") && !j["decoder"].is_null())
    decoder.push_back(tok::Decoder::parse(j["decoder"], path + ": decoder"));
  post.parse(j.value("post_processor", json()), path);

  if (pre.empty() || !pre[0].byte_level()) return;
  if (pre[0].kind == tok::PreTokenizer::Seq && pre[0].children.size() == 2) {
    const tok::PreTokenizer& sp = pre[0].children[0];
    const tok::PreTokenizer& bl = pre[0].children[1];
    if (sp.kind == tok::PreTokenizer::Split && sp.pattern.regex && !sp.invert &&
        sp.behavior == tok::SplitBehavior::Isolated && !bl.add_prefix_space && !bl.gpt2)
      fast_split = sp.pattern.regex.get();
  }
  model.set_byte_level(path);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  return from_json(read_file(path), path);
}

Tokenizer Tokenizer::from_json(const std::string& text, const std::string& name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON: {}", name, e.what());
  }
  auto impl = std::make_unique<Impl>();
  impl->path = name;
  impl->serial = g_serial++;
  try {
    impl->load(j);
  } catch (const json::exception& e) {
    bad_input("{}: unexpected structure: {}", name, e.what());
  }
  return Tokenizer(std::move(impl));
}

// ---------------------------------------------------------------------------------------------
// Encoding

std::unique_ptr<tok::BpeCache> Tokenizer::Impl::take_cache() const {
  std::lock_guard<std::mutex> lk(pool_mu);
  if (cache_pool.empty()) return std::make_unique<tok::BpeCache>();
  auto c = std::move(cache_pool.back());
  cache_pool.pop_back();
  return c;
}

void Tokenizer::Impl::give_cache(std::unique_ptr<tok::BpeCache> c) const {
  std::lock_guard<std::mutex> lk(pool_mu);
  cache_pool.push_back(std::move(c));
}

tok::BpeCache& Tokenizer::Impl::thread_cache() const {
  thread_local tok::BpeCache c;
  if (c.owner != serial) {
    c.map.clear();
    c.owner = serial;
  }
  return c;
}

void Tokenizer::Impl::encode_text(std::string_view seg, bool first, bool special,
                                  std::vector<int32_t>& out, tok::BpeCache& cache) const {
  std::string normed;
  std::string_view s = seg;
  if (!normalizer.empty()) {
    normed.assign(seg);
    normalizer[0].apply(normed);
    s = normed;
  }
  // Added tokens marked "normalized" are matched after normalization, as in HF.
  std::vector<tok::AddedMatch> nm =
      added.has_normalized ? added.find(s, true, special) : std::vector<tok::AddedMatch>{};
  size_t last = 0;
  auto run = [&](std::string_view part, bool is_first) {
    if (part.empty()) return;
    if (fast_split) {  // Isolated split + plain ByteLevel: pieces are views, nothing copied
      size_t gap = 0;
      fast_split->for_each_match(part, [&](size_t b, size_t e) {
        if (b > gap) model.encode_piece(part.substr(gap, b - gap), out, cache);
        model.encode_piece(part.substr(b, e - b), out, cache);
        gap = e;
      });
      if (gap < part.size()) model.encode_piece(part.substr(gap), out, cache);
      return;
    }
    tok::Pieces pieces{std::string(part)};
    if (!pre.empty()) pre[0].apply(pieces, is_first);
    for (const auto& p : pieces) model.encode_piece(p, out, cache);
  };
  for (const auto& m : nm) {
    run(std::string_view(s).substr(last, m.b - last), first && last == 0);
    out.push_back(m.id);
    last = m.e;
  }
  run(std::string_view(s).substr(last), first && last == 0);
}

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view text,
                                             const EncodeOptions& opt) const {
  return encode(text, opt, thread_cache());
}

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view text, const EncodeOptions& opt,
                                             tok::BpeCache& cache) const {
  size_t bad;
  if (!utf8_valid(text, &bad)) bad_input("text is not valid UTF-8 at byte offset {}", bad);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  auto matches = added.find(text, false, opt.special);
  size_t last = 0;
  for (const auto& m : matches) {
    if (m.b > last) encode_text(text.substr(last, m.b - last), last == 0, opt.special, out, cache);
    out.push_back(m.id);
    last = m.e;
  }
  if (last < text.size()) encode_text(text.substr(last), last == 0, opt.special, out, cache);
  if (opt.add_special) post.apply(out, path);
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& opt) const {
  return impl_->encode(text, opt);
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string>& texts,
                                                          const EncodeOptions& opt,
                                                          int threads) const {
  std::vector<std::vector<int32_t>> out(texts.size());
  int n = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  n = int(std::min<size_t>(size_t(n), texts.size()));
  if (n <= 1) {
    for (size_t i = 0; i < texts.size(); ++i) out[i] = encode(texts[i], opt);
    return out;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr err;
  std::mutex err_mu;
  auto work = [&] {
    try {
      auto cache = impl_->take_cache();
      for (;;) {
        size_t b = next.fetch_add(64);
        if (b >= texts.size()) break;
        for (size_t i = b; i < std::min(texts.size(), b + 64); ++i)
          out[i] = impl_->encode(texts[i], opt, *cache);
      }
      impl_->give_cache(std::move(cache));
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu);
      if (!err) err = std::current_exception();
      next = texts.size();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < n; ++i) pool.emplace_back(work);
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Vocabulary

int32_t Tokenizer::vocab_size() const {
  return int32_t(impl_->id_to_tok.size());
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : impl_->added.tokens)
    if (a.content == token) return a.id;
  auto it = impl_->model.vocab.find(token);
  return it == impl_->model.vocab.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->id_to_tok.size()) return "";
  return impl_->id_to_tok[size_t(id)];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added.tokens;
}
const std::string& Tokenizer::path() const {
  return impl_->path;
}

}  // namespace rig
