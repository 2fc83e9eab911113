// Pre-tokenizers: Split (regex or string, all behaviours), ByteLevel, Metaspace, Whitespace,
// Sequence.
#include <algorithm>

#include "rig/text/tokenizer_internal.h"

namespace rig::tok {

namespace {

const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// HF normalizer.rs `split`: turns (range, is_match) runs into pieces by behaviour.
void split_by(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches,
              bool invert, SplitBehavior beh, Pieces& out) {
  struct Run {
    size_t b, e;
    bool m;
  };
  std::vector<Run> runs;
  size_t last = 0;
  for (auto [b, e] : matches) {
    if (b > last) runs.push_back({last, b, invert});
    runs.push_back({b, e, !invert});
    last = e;
  }
  if (last < s.size()) runs.push_back({last, s.size(), invert});
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> acc;  // range, remove?
  switch (beh) {
    case SplitBehavior::Isolated:
      for (auto& r : runs) acc.push_back({{r.b, r.e}, false});
      break;
    case SplitBehavior::Removed:
      for (auto& r : runs) acc.push_back({{r.b, r.e}, r.m});
      break;
    case SplitBehavior::Contiguous: {
      bool prev = false;
      for (auto& r : runs) {
        if (r.m == prev && !acc.empty())
          acc.back().first.second = r.e;
        else
          acc.push_back({{r.b, r.e}, false});
        prev = r.m;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool prev = false;
      for (auto& r : runs) {
        if (r.m && !prev && !acc.empty())
          acc.back().first.second = r.e;
        else
          acc.push_back({{r.b, r.e}, false});
        prev = r.m;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool prev = false;
      for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
        if (it->m && !prev && !acc.empty())
          acc.back().first.first = it->b;
        else
          acc.push_back({{it->b, it->e}, false});
        prev = it->m;
      }
      std::reverse(acc.begin(), acc.end());
      break;
    }
  }
  for (auto& [r, remove] : acc)
    if (!remove && r.second > r.first) out.emplace_back(s, r.first, r.second - r.first);
}

}  // namespace

PreTokenizer PreTokenizer::parse(const json& j, const std::string& where) {
  PreTokenizer p;
  std::string type = jstr(j, "type", where);
  if (type == "Split") {
    p.kind = Split;
    p.pattern = Pattern::parse(j.value("pattern", json()), where + ".pattern");
    p.invert = jbool(j, "invert", false);
    std::string b = jstr(j, "behavior", where);
    if (b == "Removed")
      p.behavior = SplitBehavior::Removed;
    else if (b == "Isolated")
      p.behavior = SplitBehavior::Isolated;
    else if (b == "MergedWithPrevious")
      p.behavior = SplitBehavior::MergedWithPrevious;
    else if (b == "MergedWithNext")
      p.behavior = SplitBehavior::MergedWithNext;
    else if (b == "Contiguous")
      p.behavior = SplitBehavior::Contiguous;
    else
      bad_input("{}.behavior: unknown value '{}'", where, b);
  } else if (type == "ByteLevel") {
    p.kind = ByteLevel;
    p.add_prefix_space = jbool(j, "add_prefix_space", true);
    if (jbool(j, "use_regex", true)) p.gpt2 = std::make_shared<Regex>(kGpt2Pattern, where);
  } else if (type == "Metaspace") {
    p.kind = Metaspace;
    p.replacement = jstr(j, "replacement", where);
    p.split = jbool(j, "split", true);
    std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                             ? j["prepend_scheme"].get<std::string>()
                             : (jbool(j, "add_prefix_space", true) ? "always" : "never");
    if (scheme == "always")
      p.prepend = Always;
    else if (scheme == "first")
      p.prepend = First;
    else if (scheme == "never")
      p.prepend = Never;
    else
      bad_input("{}.prepend_scheme: unknown value '{}'", where, scheme);
  } else if (type == "Whitespace") {
    p.kind = Whitespace;
    p.pattern.regex = std::make_unique<Regex>("\\w+|[^\\w\\s]+", where);
  } else if (type == "Sequence") {
    p.kind = Seq;
    const json& list = j.value("pretokenizers", json::array());
    for (size_t i = 0; i < list.size(); ++i) {
      p.children.push_back(parse(list[i], fmt::format("{}.pretokenizers[{}]", where, i)));
      if (p.children.back().kind == ByteLevel && i + 1 != list.size())
        bad_input("{}: ByteLevel must be the last pre-tokenizer of a Sequence", where);
    }
  } else {
    bad_input("{}: pre-tokenizer type '{}' is not supported", where, type);
  }
  return p;
}

bool PreTokenizer::byte_level() const {
  if (kind == ByteLevel) return true;
  return kind == Seq && !children.empty() && children.back().byte_level();
}

void PreTokenizer::apply(Pieces& pieces, bool first) const {
  Pieces out;
  std::vector<std::pair<size_t, size_t>> m;
  switch (kind) {
    case Seq:
      for (const auto& c : children) c.apply(pieces, first);
      return;
    case Split:
    case Whitespace:
      for (const auto& s : pieces) {
        m.clear();
        pattern.for_each_match(s, [&](size_t b, size_t e) { m.emplace_back(b, e); });
        if (kind == Whitespace)
          split_by(s, m, false, SplitBehavior::Isolated, out);
        else
          split_by(s, m, invert, behavior, out);
      }
      break;
    case ByteLevel:
      for (auto& s : pieces) {
        if (add_prefix_space && !s.empty() && s[0] != ' ') s.insert(s.begin(), ' ');
        if (!gpt2) {
          out.push_back(std::move(s));
          continue;
        }
        m.clear();
        gpt2->for_each_match(s, [&](size_t b, size_t e) { m.emplace_back(b, e); });
        split_by(s, m, false, SplitBehavior::Isolated, out);
      }
      break;
    case Metaspace:
      for (size_t i = 0; i < pieces.size(); ++i) {
        std::string s = pieces[i];
        replace_all(s, " ", replacement);
        bool pre = prepend == Always || (prepend == First && first && i == 0);
        if (pre && s.compare(0, replacement.size(), replacement) != 0) s = replacement + s;
        if (!split) {
          out.push_back(std::move(s));
          continue;
        }
        m.clear();
        size_t pos = 0, hit;
        while ((hit = s.find(replacement, pos)) != std::string::npos) {
          m.emplace_back(hit, hit + replacement.size());
          pos = hit + replacement.size();
        }
        split_by(s, m, false, SplitBehavior::MergedWithNext, out);
      }
      break;
  }
  pieces.swap(out);
}

}  // namespace rig::tok
