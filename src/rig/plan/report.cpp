// Plan::to_json and Plan::to_text: every number in JSON, a readable summary in text.
#include <fmt/format.h>

#include "rig/core/allocator.h"
#include "rig/plan/planner.h"

namespace rig::plan {

nlohmann::json Plan::to_json() const {
  // Long on purpose: a flat list of fields, one per number the plan holds.
  using json = nlohmann::json;
  const TrainSetup& s = in.setup;
  json j;
  j["model"] = {{"name", in.model_name},
                {"parameters", memory.params.total()},
                {"layers", in.model.num_layers},
                {"hidden_size", in.model.hidden_size},
                {"intermediate_size", in.model.intermediate_size},
                {"heads", in.model.num_heads},
                {"kv_heads", in.model.num_kv_heads},
                {"head_dim", in.model.head_dim},
                {"vocab_size", in.model.vocab_size}};
  j["setup"] = {{"method", to_string(s.method)},
                {"lora_rank", s.lora_rank},
                {"lora_targets", lora_targets_string(s.lora_targets)},
                {"lora_parameters", memory.params.lora_total()},
                {"seq_len", s.seq_len},
                {"micro_batch", s.micro_batch},
                {"grad_accum", s.grad_accum},
                {"checkpointing", to_string(s.checkpointing)},
                {"optimizer", to_string(s.optimizer)},
                {"strategy", to_string(s.strategy)},
                {"precision", to_string(s.precision)},
                {"world_size", world},
                {"nodes", in.nodes},
                {"global_batch_tokens", tokens_per_step}};
  json terms = json::object();
  for (auto& [k, v] : memory.terms()) terms[k] = v;
  j["memory"] = {{"per_gpu_bytes", terms},
                 {"allocator_peak", memory.allocator_peak()},
                 {"total", memory.total()},
                 {"per_layer_activation_bytes",
                  {{"none", memory.per_layer.saved_none},
                   {"selective", memory.per_layer.saved_selective},
                   {"full", memory.per_layer.saved_full},
                   {"backward_work", memory.per_layer.backward_work}}},
                 {"nf4_bits_per_weight", nf4_bits_per_weight()},
                 {"fits", fits},
                 {"max_micro_batch", max_micro_batch},
                 {"max_seq_len", max_seq_len}};
  json gs = json::array();
  for (auto& g : groups) {
    json links = json::array();
    for (auto& l : g.links) links.push_back(l.str());
    gs.push_back({{"gpu", g.gpu->key},
                  {"name", g.gpu->name},
                  {"count_per_node", g.count},
                  {"memory_bytes", g.gpu->memory_bytes()},
                  {"budget_bytes", g.budget},
                  {"fits", g.fits},
                  {"bf16_tflops", g.gpu->bf16_tflops},
                  {"efficiency", g.efficiency},
                  {"efficiency_source", g.efficiency_source},
                  {"efficiency_estimate", g.efficiency_estimate},
                  {"effective_tflops", g.tflops},
                  {"tokens_per_s_per_gpu", g.tokens_per_s},
                  {"pcie", links}});
  }
  j["gpus"] = gs;
  // The card that sets the step (the slowest): its efficiency and where that came from.
  const GroupPlan* slowest = nullptr;
  for (auto& g : groups)
    if (!slowest || g.tokens_per_s < slowest->tokens_per_s) slowest = &g;
  j["speed"] = {{"efficiency", slowest ? slowest->efficiency : in.efficiency},
                {"efficiency_source", slowest ? slowest->efficiency_source : ""},
                {"flops_per_token",
                 {{"matmul", flops.matmul},
                  {"lora", flops.lora},
                  {"attention", flops.attention},
                  {"recompute", flops.recompute},
                  {"total", flops.per_token()}}},
                {"step_compute_s", step_compute_s},
                {"comm_kind", comm_kind},
                {"comm_path", comm_path},
                {"comm_bytes_per_step", comm_bytes},
                {"busbw_gbs", busbw_gbs},
                {"comm_s", comm_s},
                {"comm_share", comm_share},
                {"overlap", in.overlap},
                {"step_s", step_s},
                {"tokens_per_step", tokens_per_step},
                {"tokens_per_s", tokens_per_s},
                {"tokens", in.tokens},
                {"job_hours", job_hours}};
  j["power"] = {{"sustained_w", sustained_w},
                {"transient_w", transient_w},
                {"psu_recommended_w", psu_recommended_w},
                {"psu_w", in.psu_w},
                {"full_load_cards", full_load_cards},
                {"power_limit_w", in.power_limit_w},
                {"power_saving_w", power_saving_w},
                {"system_w", in.system_w}};
  j["reliability"] = {{"fit_total", fit_total},
                      {"bit_error_mtbf_hours", mtbf_hours},
                      {"expected_bit_errors", expected_bit_errors},
                      {"p_at_least_one", p_bit_error},
                      {"checkpoint_bytes", checkpoint_bytes},
                      {"checkpoint_write_s", checkpoint_s},
                      {"failure_mtbf_hours", failure_mtbf_hours},
                      {"checkpoint_interval_s", young_daly_s},
                      {"checkpoint_interval_steps", step_s > 0 ? young_daly_s / step_s : 0}};
  j["cost"] = {{"currency", in.currency},
               {"hardware", hardware},
               {"resale", resale},
               {"energy_kwh", energy_kwh},
               {"electricity", electricity},
               {"buy_total", buy_total},
               {"cloud_gpu", in.cloud_gpu},
               {"cloud_price_per_gpu_hour", cloud_price},
               {"cloud_tokens_per_s", cloud_tokens_per_s},
               {"cloud_hours", cloud_hours},
               {"cloud_total", cloud_total},
               {"break_even_hours", break_even_hours}};
  j["warnings"] = warnings;
  return j;
}

namespace {
std::string hours_str(double h) {
  if (h < 0) return "never";
  if (h < 48) return fmt::format("{:.1f} h", h);
  return fmt::format("{:.1f} days", h / 24);
}
}  // namespace

std::string Plan::to_text() const {
  // Long on purpose: the report's lines, in the order they are printed.
  const TrainSetup& s = in.setup;
  std::string o;
#define LINE(...) o += fmt::format(__VA_ARGS__) + "\n"
  std::string cards;
  for (auto& g : groups)
    cards += fmt::format("{}{}x{}", cards.empty() ? "" : ",", g.count, g.gpu->key);
  LINE(
      "{} ({:.2f}B params), {} {}{}, seq {} x micro-batch {} x accum {} x {} rank(s) ({} node(s) "
      "of {})",
      in.model_name, memory.params.total() / 1e9, to_string(s.method),
      s.method == Method::full
          ? ""
          : fmt::format("r={} {} ", s.lora_rank, lora_targets_string(s.lora_targets)),
      to_string(s.strategy), s.seq_len, s.micro_batch, s.grad_accum, world, in.nodes, cards);
  LINE("checkpointing {}, optimizer {}, precision {}", to_string(s.checkpointing),
       to_string(s.optimizer), to_string(s.precision));
  o += "\n";
  LINE("Memory per GPU");
  for (auto& [k, v] : memory.terms()) LINE("  {:<14} {:>12}", k, format_bytes(v));
  LINE("  {:<14} {:>12}   (peak counts the larger of layer_peak and logits)", "total",
       format_bytes(memory.total()));
  for (auto& g : groups)
    LINE("  {:<14} {:>12}   {}", g.gpu->key, format_bytes(g.budget),
         g.fits ? "fits" : "DOES NOT FIT");
  LINE("  largest micro-batch at seq {}: {}; largest seq at micro-batch {}: {}", s.seq_len,
       max_micro_batch, s.micro_batch, max_seq_len);
  o += "\n";
  LINE("Speed");
  LINE("  FLOPs/token    {:.3g} (matmul {:.3g}, attention {:.3g}, recompute {:.3g}, lora {:.3g})",
       flops.per_token(), flops.matmul, flops.attention, flops.recompute, flops.lora);
  for (auto& g : groups) {
    std::string links;
    for (auto& l : g.links) links += (links.empty() ? "" : ", ") + l.str();
    LINE("  {:<14} {:.1f} TFLOP/s effective, {:.0f} tokens/s per card, PCIe {}", g.gpu->key,
         g.tflops, g.tokens_per_s, links);
    LINE("  {:<14} efficiency {:.1f}% of dense bf16 ({})", "", 100 * g.efficiency,
         g.efficiency_source);
  }
  if (world > 1)
    LINE(
        "  comm           {} of {} per step over {} at {:.1f} GB/s bus bandwidth: {:.3f} s "
        "({:.1f}% of the step)",
        comm_kind, format_bytes(comm_bytes), comm_path, busbw_gbs, comm_s, 100 * comm_share);
  LINE("  step           {:.3f} s for {:.0f} tokens -> {:.0f} tokens/s; {:.3g} tokens in {}",
       step_s, tokens_per_step, tokens_per_s, in.tokens, hours_str(job_hours));
  o += "\n";
  LINE("Power per node");
  LINE(
      "  sustained {:.0f} W (GPUs + {:.0f} W system), transients to {:.0f} W, recommended PSU "
      "{:.0f} W",
      sustained_w, in.system_w, transient_w, psu_recommended_w);
  if (in.power_limit_w > 0)
    LINE("  power limit {:.0f} W per card saves {:.0f} W", in.power_limit_w, power_saving_w);
  o += "\n";
  LINE("Reliability");
  if (fit_total > 0)
    LINE(
        "  {:.0f} FIT of non-ECC memory: one bit error per {:.0f} h; {:.3f} expected over the run "
        "({:.1f}% chance of one)",
        fit_total, mtbf_hours, expected_bit_errors, 100 * p_bit_error);
  else
    LINE("  ECC memory: bit errors are corrected");
  if (young_daly_s > 0)
    LINE(
        "  checkpoint {} written in {:.1f} s; Young/Daly interval sqrt(2*C*MTBF) = {:.1f} h "
        "({:.0f} steps)",
        format_bytes(checkpoint_bytes), checkpoint_s, young_daly_s / 3600,
        step_s > 0 ? young_daly_s / step_s : 0);
  o += "\n";
  LINE("Cost ({})", in.currency);
  LINE("  buy:   hardware {:.0f} - resale {:.0f} + electricity {:.0f} ({:.0f} kWh) = {:.0f}",
       hardware, resale, electricity, energy_kwh, buy_total);
  LINE("  cloud: {:.1f} h on {} at {:.2f}/GPU-h = {:.0f}", cloud_hours, in.cloud_gpu, cloud_price,
       cloud_total);
  LINE("  buying pays off after {} of own-hardware work", hours_str(break_even_hours));
  if (!warnings.empty()) {
    o += "\n";
    for (auto& w : warnings) LINE("warning: {}", w);
  }
#undef LINE
  return o;
}

}  // namespace rig::plan
