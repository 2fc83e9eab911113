// Post-processors: TemplateProcessing (single-sequence template), ByteLevel (no change to ids),
// Sequence. Used only when EncodeOptions::add_special is set.
#include "rig/text/tokenizer_internal.h"

namespace rig::tok {

void PostProcessor::parse(const json& j, const std::string& path) {
  if (j.is_null()) return;
  std::string type = j.value("type", "");
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    for (const auto& c : j.value("processors", json::array())) parse(c, path);
    return;
  }
  if (type != "TemplateProcessing") {
    unsupported = type;
    return;
  }
  const json& specials = j.value("special_tokens", json::object());
  bool seen_a = false;
  for (const auto& item : j.value("single", json::array())) {
    if (item.contains("Sequence")) {
      seen_a = true;
    } else if (item.contains("SpecialToken")) {
      std::string id = item["SpecialToken"].value("id", "");
      if (!specials.contains(id))
        bad_input("{}: post_processor: special token '{}' not listed", path, id);
      for (const auto& v : specials[id].value("ids", json::array()))
        (seen_a ? suffix : prefix).push_back(v.get<int32_t>());
    }
  }
}

void PostProcessor::apply(std::vector<int32_t>& ids, const std::string& path) const {
  if (!unsupported.empty())
    bad_input("{}: post_processor type '{}' is not supported", path, unsupported);
  ids.insert(ids.begin(), prefix.begin(), prefix.end());
  ids.insert(ids.end(), suffix.begin(), suffix.end());
}

}  // namespace rig::tok
