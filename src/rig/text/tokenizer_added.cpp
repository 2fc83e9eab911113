// Added tokens (HF AddedVocabulary): loaded from added_tokens and matched in the text before the
// normalizer (normalized: false) or after it (normalized: true), with lstrip/rstrip/single_word.
#include <algorithm>
#include <cctype>

#include "rig/text/tokenizer_internal.h"

namespace rig::tok {

void AddedVocab::load(const json& list, const std::string& name, const IdReader& id_of,
                      int32_t& max_id) {
  for (size_t i = 0; i < list.size(); ++i) {
    const json& a = list[i];
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
    tokens.push_back(tok);
  }
}

void AddedVocab::index() {
  for (const auto& a : tokens) has_normalized = has_normalized || a.normalized;
  for (const auto& a : tokens) by_first_byte[uint8_t(a.content[0])].push_back(&a);
  for (auto& v : by_first_byte)
    std::stable_sort(v.begin(), v.end(),
                     [](auto* a, auto* b) { return a->content.size() > b->content.size(); });
}

std::vector<AddedMatch> AddedVocab::find(std::string_view s, bool normalized_set,
                                         bool special) const {
  std::vector<AddedMatch> out;
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
    if (hit->lstrip)
      while (b > floor && ws(s[b - 1])) --b;
    if (hit->rstrip)
      while (e < s.size() && ws(s[e])) ++e;
    out.push_back({b, e, hit->id});
    i = e;
  }
  return out;
}

}  // namespace rig::tok
