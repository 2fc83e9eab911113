// Decoders: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence; and
// Tokenizer::decode, which feeds them the token strings of the ids.
#include <algorithm>
#include <cctype>

#include "rig/text/tokenizer_internal.h"

namespace rig {

namespace tok {

namespace {

using Strings = std::vector<std::string>;

// Maps each token's characters back to bytes and joins them; invalid UTF-8 becomes U+FFFD.
Strings decode_byte_level(const Strings& toks) {
  const auto& bt = bytes();
  std::string raw;
  for (const auto& t : toks) {
    std::string tb;
    bool ok = true;
    for (size_t i = 0; i < t.size() && ok;) {
      int n = utf8::seq_len(t, i);
      auto it = n ? bt.char_to_byte.find(utf8::decode_at(t, i, n)) : bt.char_to_byte.end();
      if (it == bt.char_to_byte.end())
        ok = false;
      else
        tb += char(it->second);
      i += size_t(n ? n : 1);
    }
    raw += ok ? tb : t;  // a token with a non-byte character passes through as is
  }
  return {utf8_lossy(raw)};
}

// Runs of <0xNN> tokens become their bytes, or one U+FFFD per byte when not valid UTF-8.
Strings decode_byte_fallback(Strings& toks) {
  Strings out;
  std::string pending;
  auto flush = [&] {
    if (pending.empty()) return;
    if (utf8_valid(pending))
      out.push_back(pending);
    else
      for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
    pending.clear();
  };
  for (auto& t : toks) {
    if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && isxdigit(uint8_t(t[3])) &&
        isxdigit(uint8_t(t[4]))) {
      pending += char(std::stoi(t.substr(3, 2), nullptr, 16));
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  return out;
}

// Removes up to `start` leading and `stop` trailing strip_char characters of each token.
Strings decode_strip(const Decoder& d, const Strings& toks) {
  Strings out;
  for (auto& t : toks) {
    std::vector<std::pair<size_t, char32_t>> cs;  // byte offset, char
    for (size_t i = 0; i < t.size();) {
      int n = std::max(1, utf8::seq_len(t, i));
      cs.push_back({i, utf8::decode_at(t, i, n)});
      i += size_t(n);
    }
    size_t b = 0, e = cs.size();
    for (size_t i = 0; i < d.start && i < cs.size() && cs[i].second == d.strip_char; ++i) b = i + 1;
    for (size_t i = 0; i < d.stop && i < cs.size() && cs[cs.size() - i - 1].second == d.strip_char;
         ++i)
      e = cs.size() - i - 1;
    if (e < b) e = b;
    size_t bb = b < cs.size() ? cs[b].first : t.size();
    size_t eb = e < cs.size() ? cs[e].first : t.size();
    out.push_back(t.substr(bb, eb - bb));
  }
  return out;
}

// The replacement becomes a space, except at the start of the first token when prepending.
Strings decode_metaspace(const Decoder& d, const Strings& toks) {
  Strings out;
  for (size_t i = 0; i < toks.size(); ++i) {
    std::string r;
    const std::string& t = toks[i];
    for (size_t k = 0; k < t.size();) {
      if (t.compare(k, d.content.size(), d.content) == 0) {
        if (!(i == 0 && d.prepend)) r += ' ';
        k += d.content.size();
      } else {
        r += t[k++];
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

Decoder Decoder::parse(const json& j, const std::string& where) {
  Decoder d;
  std::string type = jstr(j, "type", where);
  if (type == "ByteLevel")
    d.kind = ByteLevel;
  else if (type == "Replace") {
    d.kind = Replace;
    d.pattern = Pattern::parse(j.value("pattern", json()), where + ".pattern");
    d.content = jstr(j, "content", where);
  } else if (type == "ByteFallback")
    d.kind = ByteFallback;
  else if (type == "Fuse")
    d.kind = Fuse;
  else if (type == "Strip") {
    d.kind = Strip;
    std::string c = jstr(j, "content", where);
    int n = c.empty() ? 0 : utf8::seq_len(c, 0);
    if (n == 0 || size_t(n) != c.size()) bad_input("{}.content: expected one character", where);
    d.strip_char = utf8::decode_at(c, 0, n);
    d.start = j.value("start", 0);
    d.stop = j.value("stop", 0);
  } else if (type == "Metaspace") {
    d.kind = Metaspace;
    d.content = jstr(j, "replacement", where);
    std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                             ? j["prepend_scheme"].get<std::string>()
                             : (jbool(j, "add_prefix_space", true) ? "always" : "never");
    d.prepend = scheme != "never";
  } else if (type == "Sequence") {
    d.kind = Seq;
    const json& list = j.value("decoders", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      d.children.push_back(parse(list[i], fmt::format("{}.decoders[{}]", where, i)));
  } else {
    bad_input("{}: decoder type '{}' is not supported", where, type);
  }
  return d;
}

std::vector<std::string> Decoder::apply(std::vector<std::string> toks) const {
  std::vector<std::string> out;
  switch (kind) {
    case Seq:
      for (const auto& c : children) toks = c.apply(std::move(toks));
      return toks;
    case ByteLevel:
      return decode_byte_level(toks);
    case Replace:
      for (auto& t : toks) out.push_back(replace_pattern(t, pattern, content));
      return out;
    case ByteFallback:
      return decode_byte_fallback(toks);
    case Fuse: {
      std::string all;
      for (auto& t : toks) all += t;
      out.push_back(std::move(all));
      return out;
    }
    case Strip:
      return decode_strip(*this, toks);
    case Metaspace:
      return decode_metaspace(*this, toks);
  }
  return out;
}

}  // namespace tok

std::string Tokenizer::decode(const std::vector<int32_t>& ids, const DecodeOptions& opt) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id = ids[i];
    if (id < 0 || size_t(id) >= impl_->id_to_tok.size() || impl_->id_to_tok[size_t(id)].empty())
      bad_input("decode: id {} at position {} is not in the vocabulary (size {})", id, i,
                vocab_size());
    if (opt.skip_special && impl_->is_special[size_t(id)]) continue;
    toks.push_back(impl_->id_to_tok[size_t(id)]);
  }
  if (!impl_->decoder.empty())
    toks = impl_->decoder[0].apply(std::move(toks));
  else {
    std::string joined;
    for (size_t i = 0; i < toks.size(); ++i) joined += (i ? " " : "") + toks[i];
    return joined;
  }
  std::string r;
  for (auto& t : toks) r += t;
  return r;
}

}  // namespace rig
