// The BPE model: vocabulary and merges, with merges in string or pair form, ignore_merges,
// byte_fallback, unk/fuse_unk, continuing_subword_prefix/end_of_word_suffix, and byte-level input.
#include <algorithm>
#include <queue>

#include "rig/text/tokenizer_internal.h"

namespace rig::tok {

namespace {

// A symbol of the word being merged, in a doubly linked list over the initial symbols.
struct Sym {
  int32_t id;
  int32_t prev, next;
  bool alive;
};

void add_sym(std::vector<Sym>& syms, int32_t id) {
  int32_t n = int32_t(syms.size());
  syms.push_back({id, n - 1, -1, true});
  if (n > 0) syms[size_t(n - 1)].next = n;
}

// Initial symbols of a non-byte-level word: one per character, with the subword prefix/suffix,
// else its <0xNN> byte tokens, else unk (consecutive unks fused when fuse_unk).
void char_symbols(const BpeModel& m, std::string_view w, std::vector<Sym>& syms) {
  int32_t unk = -1;
  bool have_unk = false;
  for (size_t i = 0; i < w.size();) {
    int n = std::max(1, utf8::seq_len(w, i));
    bool first = i == 0, last = i + size_t(n) == w.size();
    std::string s(w.substr(i, size_t(n)));
    if (!first && !m.cont_prefix.empty()) s = m.cont_prefix + s;
    if (last && !m.word_suffix.empty()) s += m.word_suffix;
    auto it = m.vocab.find(std::string_view(s));
    if (it != m.vocab.end()) {
      if (have_unk) add_sym(syms, unk), have_unk = false;
      add_sym(syms, it->second);
    } else {
      bool done = false;
      if (m.byte_fallback) {
        bool all = true;
        for (unsigned char c : s) all = all && m.byte_fallback_ids[c] >= 0;
        if (all) {
          for (unsigned char c : s) add_sym(syms, m.byte_fallback_ids[c]);
          done = true;
        }
      }
      if (!done && m.unk_id >= 0) {
        if (have_unk && !m.fuse_unk) add_sym(syms, unk);
        unk = m.unk_id;
        have_unk = true;
      }
    }
    i += size_t(n);
  }
  if (have_unk) add_sym(syms, unk);
}

// Applies merges lowest rank first (leftmost on ties) until none applies.
void merge_all(const BpeModel& m, std::vector<Sym>& syms) {
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator<(const Cand& o) const {  // max-heap: lowest rank, then lowest pos on top
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Cand> q;
  auto lookup = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
    auto it = m.merges.find(BpeModel::pair_key(a, b));
    return it == m.merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i)
    if (auto mg = lookup(syms[i].id, syms[i + 1].id)) q.push({mg->first, int32_t(i), mg->second});
  while (!q.empty()) {
    Cand top = q.top();
    q.pop();
    Sym& cur = syms[size_t(top.pos)];
    if (!cur.alive || cur.next < 0) continue;
    Sym& right = syms[size_t(cur.next)];
    auto mg = lookup(cur.id, right.id);
    if (!mg || mg->second != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    right.alive = false;
    cur.next = right.next;
    if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;
    if (cur.prev >= 0)
      if (auto pm = lookup(syms[size_t(cur.prev)].id, cur.id))
        q.push({pm->first, cur.prev, pm->second});
    if (cur.next >= 0)
      if (auto nm = lookup(cur.id, syms[size_t(cur.next)].id))
        q.push({nm->first, top.pos, nm->second});
  }
}

}  // namespace

void BpeModel::load_vocab(const json& vocab_json, const std::string& name, const IdReader& id_of,
                          int32_t& max_id) {
  vocab.reserve(vocab_json.size());
  for (auto it = vocab_json.begin(); it != vocab_json.end(); ++it) {
    int32_t id = id_of(it.value(), fmt::format("{}: model.vocab['{}']", name, it.key()));
    vocab.emplace(it.key(), id);
    max_id = std::max(max_id, id);
  }
}

void BpeModel::load_merges(const json& m, const std::string& name) {
  const json& list = m.value("merges", json::array());
  merges.reserve(list.size() * 2);
  for (size_t i = 0; i < list.size(); ++i) {
    std::string a, b;
    const json& e = list[i];
    if (e.is_string()) {
      std::string s = e.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos)
        bad_input("{}: model.merges[{}]: expected \"a b\", got '{}'", name, i, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      bad_input("{}: model.merges[{}]: expected a string or a pair", name, i);
    }
    auto ia = vocab.find(a), ib = vocab.find(b), in = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || in == vocab.end())
      bad_input("{}: model.merges[{}]: '{}' + '{}' uses a token missing from the vocabulary", name,
                i, a, b);
    merges[pair_key(ia->second, ib->second)] = {int32_t(i), in->second};
  }
}

void BpeModel::load_options(const json& m, const std::string& name) {
  ignore_merges = jbool(m, "ignore_merges", false);
  byte_fallback = jbool(m, "byte_fallback", false);
  fuse_unk = jbool(m, "fuse_unk", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = vocab.find(m["unk_token"].get<std::string>());
    if (it == vocab.end()) bad_input("{}: model.unk_token is not in the vocabulary", name);
    unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(fmt::format("<0x{:02X}>", b));
    byte_fallback_ids[b] = it == vocab.end() ? -1 : it->second;
  }
  if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string())
    cont_prefix = m["continuing_subword_prefix"].get<std::string>();
  if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string())
    word_suffix = m["end_of_word_suffix"].get<std::string>();
}

void BpeModel::set_byte_level(const std::string& name) {
  byte_level = true;
  if (!cont_prefix.empty() || !word_suffix.empty())
    bad_input("{}: continuing_subword_prefix/end_of_word_suffix with ByteLevel are not supported",
              name);
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(bytes().byte_to_str[b]);
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }
}

void BpeModel::bpe_word(std::string_view w, std::vector<int32_t>& out) const {
  std::vector<Sym> syms;
  syms.reserve(w.size());
  if (byte_level) {
    for (unsigned char c : w) {
      if (byte_ids[c] < 0) bad_input("tokenizer: byte 0x{:02X} has no token in the vocabulary", c);
      add_sym(syms, byte_ids[c]);
    }
  } else {
    char_symbols(*this, w, syms);
  }
  merge_all(*this, syms);
  for (const auto& s : syms)
    if (s.alive) out.push_back(s.id);
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out,
                            BpeCache& cache) const {
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
  if (whole >= 0)
    ids.push_back(whole);
  else
    bpe_word(piece, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cache.map.size() > (1u << 18)) cache.map.clear();
  cache.map.emplace(std::string(piece), std::move(ids));
}

}  // namespace rig::tok
