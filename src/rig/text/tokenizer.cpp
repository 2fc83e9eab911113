// The Tokenizer: BPE model, added tokens, post-processor and loading; the other stages of the
// pipeline live in tokenizer_*.cpp (see tokenizer_internal.h).
#include "rig/text/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <queue>
#include <thread>
#include <unordered_map>

#include "rig/io/atomic_file.h"
#include "rig/text/tokenizer_internal.h"

namespace rig {

using json = nlohmann::json;
using namespace tok;

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string path;
  uint64_t serial = 0;
  // model
  StrMap<int32_t> vocab;
  std::vector<std::string> id_to_tok;  // model and added tokens
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_fallback_ids[256];
  std::string cont_prefix, word_suffix;
  bool byte_level = false;
  int32_t byte_ids[256];  // byte-level: vocab id of each byte's character
  // pipeline
  std::vector<Normalizer> normalizer;  // zero or one
  std::vector<PreTokenizer> pre;       // zero or one
  std::vector<Decoder> decoder;        // zero or one
  // added tokens
  std::vector<AddedToken> added;
  std::vector<bool> is_special;  // by id
  std::vector<const AddedToken*> by_first_byte[256];  // longest first
  // post-processor: single-sequence template ids, or the unsupported type's name
  std::vector<int32_t> post_prefix, post_suffix;
  std::string post_unsupported;

  // Leftmost-longest search for added tokens; normalized selects which set.
  struct Match {
    size_t b, e;
    int32_t id;
  };
  std::vector<Match> find_added(std::string_view s, bool normalized_set, bool special) const {
    std::vector<Match> out;
    size_t i = 0;
    while (i < s.size()) {
      const auto& cands = by_first_byte[uint8_t(s[i])];
      const AddedToken* hit = nullptr;
      for (const AddedToken* t : cands) {
        if (t->normalized != normalized_set || (t->special && !special)) continue;
        if (s.compare(i, t->content.size(), t->content) == 0) {
          if (t->single_word) {
            auto word = [](char c) { return isalnum(uint8_t(c)) || c == '_' || uint8_t(c) >= 0x80; };
            size_t e = i + t->content.size();
            if ((i > 0 && word(s[i - 1])) || (e < s.size() && word(s[e]))) continue;
          }
          hit = t;
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->content.size();
      size_t floor = out.empty() ? 0 : out.back().e;
      auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
      if (hit->lstrip) while (b > floor && ws(s[b - 1])) --b;
      if (hit->rstrip) while (e < s.size() && ws(s[e])) ++e;
      out.push_back({b, e, hit->id});
      i = e;
    }
    return out;
  }

  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  // HF BPE::merge_word + Word::merge_all.
  void bpe_word(std::string_view w, std::vector<int32_t>& out) const {
    struct Sym {
      int32_t id;
      int32_t prev, next;
      bool alive;
    };
    std::vector<Sym> syms;
    syms.reserve(w.size());
    auto add = [&](int32_t id) {
      int32_t n = int32_t(syms.size());
      syms.push_back({id, n - 1, -1, true});
      if (n > 0) syms[size_t(n - 1)].next = n;
    };
    if (byte_level) {
      for (unsigned char c : w) {
        if (byte_ids[c] < 0) bad_input("tokenizer: byte 0x{:02X} has no token in the vocabulary", c);
        add(byte_ids[c]);
      }
    } else {
      int32_t unk = -1;
      bool have_unk = false;
      for (size_t i = 0; i < w.size();) {
        int n = std::max(1, utf8::seq_len(w, i));
        bool first = i == 0, last = i + size_t(n) == w.size();
        std::string s(w.substr(i, size_t(n)));
        if (!first && !cont_prefix.empty()) s = cont_prefix + s;
        if (last && !word_suffix.empty()) s += word_suffix;
        auto it = vocab.find(std::string_view(s));
        if (it != vocab.end()) {
          if (have_unk) add(unk), have_unk = false;
          add(it->second);
        } else {
          bool done = false;
          if (byte_fallback) {
            bool all = true;
            for (unsigned char c : s) all = all && byte_fallback_ids[c] >= 0;
            if (all) {
              for (unsigned char c : s) add(byte_fallback_ids[c]);
              done = true;
            }
          }
          if (!done && unk_id >= 0) {
            if (have_unk && !fuse_unk) add(unk);
            unk = unk_id;
            have_unk = true;
          }
        }
        i += size_t(n);
      }
      if (have_unk) add(unk);
    }
    struct Cand {
      int32_t rank, pos, new_id;
      bool operator<(const Cand& o) const {  // max-heap: lowest rank, then lowest pos on top
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Cand> q;
    auto lookup = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
      auto it = merges.find(pair_key(a, b));
      return it == merges.end() ? nullptr : &it->second;
    };
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      if (auto m = lookup(syms[i].id, syms[i + 1].id)) q.push({m->first, int32_t(i), m->second});
    while (!q.empty()) {
      Cand top = q.top();
      q.pop();
      Sym& cur = syms[size_t(top.pos)];
      if (!cur.alive || cur.next < 0) continue;
      Sym& right = syms[size_t(cur.next)];
      auto m = lookup(cur.id, right.id);
      if (!m || m->second != top.new_id) continue;  // stale entry
      cur.id = top.new_id;
      right.alive = false;
      cur.next = right.next;
      if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;
      if (cur.prev >= 0)
        if (auto pm = lookup(syms[size_t(cur.prev)].id, cur.id)) q.push({pm->first, cur.prev, pm->second});
      if (cur.next >= 0)
        if (auto nm = lookup(cur.id, syms[size_t(cur.next)].id)) q.push({nm->first, top.pos, nm->second});
    }
    for (const auto& s : syms)
      if (s.alive) out.push_back(s.id);
  }

  struct Cache {
    uint64_t owner = 0;
    StrMap<std::vector<int32_t>> map;
  };

  void model_piece(std::string_view piece, std::vector<int32_t>& out, Cache& cache) const {
    if (piece.empty()) return;
    // The cache holds the final ids of a piece, including the ignore_merges shortcut.
    auto it = cache.map.find(piece);
    if (it != cache.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    std::vector<int32_t> ids;
    int32_t whole = -1;
    if (ignore_merges) {
      if (byte_level) {
        std::string mapped;
        mapped.reserve(piece.size() * 2);
        for (unsigned char c : piece) mapped += bytes().byte_to_str[c];
        auto v = vocab.find(std::string_view(mapped));
        if (v != vocab.end()) whole = v->second;
      } else {
        auto v = vocab.find(piece);
        if (v != vocab.end()) whole = v->second;
      }
    }
    if (whole >= 0) ids.push_back(whole);
    else bpe_word(piece, ids);
    out.insert(out.end(), ids.begin(), ids.end());
    if (cache.map.size() > (1u << 18)) cache.map.clear();
    cache.map.emplace(std::string(piece), std::move(ids));
  }

  Cache& thread_cache() const {
    thread_local Cache c;
    if (c.owner != serial) {
      c.map.clear();
      c.owner = serial;
    }
    return c;
  }

  void encode_text(std::string_view seg, bool first, bool special, std::vector<int32_t>& out,
                   Cache& cache) const {
    std::string normed;
    std::string_view s = seg;
    if (!normalizer.empty()) {
      normed.assign(seg);
      normalizer[0].apply(normed);
      s = normed;
    }
    // Added tokens marked "normalized" are matched after normalization, as in HF.
    std::vector<Match> nm = has_normalized_added ? find_added(s, true, special) : std::vector<Match>{};
    size_t last = 0;
    auto run = [&](std::string_view part, bool is_first) {
      if (part.empty()) return;
      if (fast_split) {  // Isolated split + plain ByteLevel: pieces are views, nothing copied
        size_t gap = 0;
        fast_split->for_each_match(part, [&](size_t b, size_t e) {
          if (b > gap) model_piece(part.substr(gap, b - gap), out, cache);
          model_piece(part.substr(b, e - b), out, cache);
          gap = e;
        });
        if (gap < part.size()) model_piece(part.substr(gap), out, cache);
        return;
      }
      Pieces pieces{std::string(part)};
      if (!pre.empty()) pre[0].apply(pieces, is_first);
      for (const auto& p : pieces) model_piece(p, out, cache);
    };
    for (const auto& m : nm) {
      run(std::string_view(s).substr(last, m.b - last), first && last == 0);
      out.push_back(m.id);
      last = m.e;
    }
    run(std::string_view(s).substr(last), first && last == 0);
  }
  bool has_normalized_added = false;
  const Regex* fast_split = nullptr;  // set when the pre-tokenizer is the common Llama 3/Qwen shape

  // Word caches for encode_batch workers, kept across calls so each batch starts warm.
  mutable std::mutex pool_mu;
  mutable std::vector<std::unique_ptr<Cache>> cache_pool;
  std::unique_ptr<Cache> take_cache() const {
    std::lock_guard<std::mutex> lk(pool_mu);
    if (cache_pool.empty()) return std::make_unique<Cache>();
    auto c = std::move(cache_pool.back());
    cache_pool.pop_back();
    return c;
  }
  void give_cache(std::unique_ptr<Cache> c) const {
    std::lock_guard<std::mutex> lk(pool_mu);
    cache_pool.push_back(std::move(c));
  }

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt) const {
    return encode(text, opt, thread_cache());
  }
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt, Cache& cache) const {
    size_t bad;
    if (!utf8_valid(text, &bad)) bad_input("text is not valid UTF-8 at byte offset {}", bad);
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    auto matches = find_added(text, false, opt.special);
    size_t last = 0;
    for (const auto& m : matches) {
      if (m.b > last) encode_text(text.substr(last, m.b - last), last == 0, opt.special, out, cache);
      out.push_back(m.id);
      last = m.e;
    }
    if (last < text.size()) encode_text(text.substr(last), last == 0, opt.special, out, cache);
    if (opt.add_special) {
      if (!post_unsupported.empty())
        bad_input("{}: post_processor type '{}' is not supported", path, post_unsupported);
      out.insert(out.begin(), post_prefix.begin(), post_prefix.end());
      out.insert(out.end(), post_suffix.begin(), post_suffix.end());
    }
    return out;
  }

  void parse_post(const json& j, bool in_seq) {
    if (j.is_null()) return;
    std::string type = j.value("type", "");
    if (type == "ByteLevel") return;
    if (type == "Sequence") {
      for (const auto& c : j.value("processors", json::array())) parse_post(c, true);
      return;
    }
    if (type != "TemplateProcessing") {
      post_unsupported = type;
      return;
    }
    const json& specials = j.value("special_tokens", json::object());
    bool seen_a = false;
    for (const auto& item : j.value("single", json::array())) {
      if (item.contains("Sequence")) {
        seen_a = true;
      } else if (item.contains("SpecialToken")) {
        std::string id = item["SpecialToken"].value("id", "");
        if (!specials.contains(id)) bad_input("{}: post_processor: special token '{}' not listed", path, id);
        for (const auto& v : specials[id].value("ids", json::array()))
          (seen_a ? post_suffix : post_prefix).push_back(v.get<int32_t>());
      }
    }
  }
};

namespace {
std::atomic<uint64_t> g_serial{1};
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) { return from_json(read_file(path), path); }

Tokenizer Tokenizer::from_json(const std::string& text, const std::string& name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON: {}", name, e.what());
  }
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.path = name;
  t.serial = g_serial++;
  try {
    const json& m = j.value("model", json());
    if (!m.is_object()) bad_input("{}: missing 'model'", name);
    std::string type = m.value("type", "BPE");
    if (type != "BPE") bad_input("{}: model.type '{}' is not supported (only BPE)", name, type);
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
      bad_input("{}: model.dropout is not supported", name);
    const json& vocab = m.value("vocab", json());
    if (!vocab.is_object()) bad_input("{}: model.vocab: expected an object", name);
    int32_t max_id = -1;
    t.vocab.reserve(vocab.size());
    // Ids index a table as large as the largest one: read them whole (get<int32_t> would wrap a
    // large one silently) and refuse ids far beyond the number of tokens.
    const json& added_list = j.value("added_tokens", json::array());
    const int64_t limit = 4 * int64_t(vocab.size() + added_list.size()) + 4096;
    auto id_of = [&](const json& v, const std::string& where) {
      if (!v.is_number_integer()) bad_input("{}: expected an integer id, got {}", where, v.dump());
      const int64_t id = v.get<int64_t>();
      if (id < 0) bad_input("{}: negative id {}", where, id);
      if (id >= limit)
        bad_input(
            "{}: id {} is far beyond the {} tokens of this file (ids of a vocabulary are "
            "0, 1, 2, ...)",
            where, id, vocab.size());
      return int32_t(id);
    };
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      int32_t id = id_of(it.value(), fmt::format("{}: model.vocab['{}']", name, it.key()));
      t.vocab.emplace(it.key(), id);
      max_id = std::max(max_id, id);
    }
    const json& added = j.value("added_tokens", json::array());
    for (size_t i = 0; i < added.size(); ++i) {
      const json& a = added[i];
      std::string where = fmt::format("{}: added_tokens[{}]", name, i);
      AddedToken tok;
      if (!a.is_object() || !a.contains("id")) bad_input("{}: missing 'id'", where);
      tok.id = id_of(a["id"], where + ": id");
      tok.content = jstr(a, "content", where);
      if (tok.content.empty()) bad_input("{}: empty content", where);
      tok.special = jbool(a, "special", false);
      tok.lstrip = jbool(a, "lstrip", false);
      tok.rstrip = jbool(a, "rstrip", false);
      tok.normalized = jbool(a, "normalized", !tok.special);
      tok.single_word = jbool(a, "single_word", false);
      max_id = std::max(max_id, tok.id);
      t.added.push_back(tok);
    }
    t.id_to_tok.assign(size_t(max_id + 1), std::string());
    t.is_special.assign(size_t(max_id + 1), false);
    for (const auto& [k, v] : t.vocab) t.id_to_tok[size_t(v)] = k;
    for (const auto& a : t.added) {
      t.id_to_tok[size_t(a.id)] = a.content;
      t.is_special[size_t(a.id)] = a.special;
      t.has_normalized_added = t.has_normalized_added || a.normalized;
    }
    for (const auto& a : t.added) t.by_first_byte[uint8_t(a.content[0])].push_back(&a);
    for (auto& v : t.by_first_byte)
      std::stable_sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->content.size() > b->content.size(); });

    const json& merges = m.value("merges", json::array());
    t.merges.reserve(merges.size() * 2);
    for (size_t i = 0; i < merges.size(); ++i) {
      std::string a, b;
      const json& e = merges[i];
      if (e.is_string()) {
        std::string s = e.get<std::string>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos) bad_input("{}: model.merges[{}]: expected \"a b\", got '{}'", name, i, s);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        bad_input("{}: model.merges[{}]: expected a string or a pair", name, i);
      }
      auto ia = t.vocab.find(a), ib = t.vocab.find(b), in = t.vocab.find(a + b);
      if (ia == t.vocab.end() || ib == t.vocab.end() || in == t.vocab.end())
        bad_input("{}: model.merges[{}]: '{}' + '{}' uses a token missing from the vocabulary", name, i, a, b);
      t.merges[Impl::pair_key(ia->second, ib->second)] = {int32_t(i), in->second};
    }
    t.ignore_merges = jbool(m, "ignore_merges", false);
    t.byte_fallback = jbool(m, "byte_fallback", false);
    t.fuse_unk = jbool(m, "fuse_unk", false);
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = t.vocab.find(m["unk_token"].get<std::string>());
      if (it == t.vocab.end()) bad_input("{}: model.unk_token is not in the vocabulary", name);
      t.unk_id = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      auto it = t.vocab.find(fmt::format("<0x{:02X}>", b));
      t.byte_fallback_ids[b] = it == t.vocab.end() ? -1 : it->second;
    }
    if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string())
      t.cont_prefix = m["continuing_subword_prefix"].get<std::string>();
    if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string())
      t.word_suffix = m["end_of_word_suffix"].get<std::string>();

    if (j.contains("normalizer") && !j["normalizer"].is_null())
      t.normalizer.push_back(Normalizer::parse(j["normalizer"], name + ": normalizer"));
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
      t.pre.push_back(PreTokenizer::parse(j["pre_tokenizer"], name + ": pre_tokenizer"));
    if (j.contains("decoder") && !j["decoder"].is_null())
      t.decoder.push_back(Decoder::parse(j["decoder"], name + ": decoder"));
    t.parse_post(j.value("post_processor", json()), false);

    t.byte_level = !t.pre.empty() && t.pre[0].byte_level();
    if (t.byte_level && t.pre[0].kind == PreTokenizer::Seq && t.pre[0].children.size() == 2) {
      const PreTokenizer& sp = t.pre[0].children[0];
      const PreTokenizer& bl = t.pre[0].children[1];
      if (sp.kind == PreTokenizer::Split && sp.pattern.regex && !sp.invert &&
          sp.behavior == SplitBehavior::Isolated && !bl.add_prefix_space && !bl.gpt2)
        t.fast_split = sp.pattern.regex.get();
    }
    if (t.byte_level) {
      if (!t.cont_prefix.empty() || !t.word_suffix.empty())
        bad_input("{}: continuing_subword_prefix/end_of_word_suffix with ByteLevel are not supported", name);
      for (int b = 0; b < 256; ++b) {
        auto it = t.vocab.find(bytes().byte_to_str[b]);
        t.byte_ids[b] = it == t.vocab.end() ? -1 : it->second;
      }
    }
  } catch (const json::exception& e) {
    bad_input("{}: unexpected structure: {}", name, e.what());
  }
  return Tokenizer(std::move(impl));
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
        for (size_t i = b; i < std::min(texts.size(), b + 64); ++i) out[i] = impl_->encode(texts[i], opt, *cache);
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

std::string Tokenizer::decode(const std::vector<int32_t>& ids, const DecodeOptions& opt) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id = ids[i];
    if (id < 0 || size_t(id) >= impl_->id_to_tok.size() || impl_->id_to_tok[size_t(id)].empty())
      bad_input("decode: id {} at position {} is not in the vocabulary (size {})", id, i, vocab_size());
    if (opt.skip_special && impl_->is_special[size_t(id)]) continue;
    toks.push_back(impl_->id_to_tok[size_t(id)]);
  }
  if (!impl_->decoder.empty()) toks = impl_->decoder[0].apply(std::move(toks));
  else {
    std::string joined;
    for (size_t i = 0; i < toks.size(); ++i) joined += (i ? " " : "") + toks[i];
    return joined;
  }
  std::string r;
  for (auto& t : toks) r += t;
  return r;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->id_to_tok.size()); }

int32_t Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->id_to_tok.size()) return "";
  return impl_->id_to_tok[size_t(id)];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::string& Tokenizer::path() const { return impl_->path; }

}  // namespace rig
