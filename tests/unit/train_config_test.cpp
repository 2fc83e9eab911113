#include "rig/train/train_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/model/config.h"
#include "test_util.h"

namespace {

using rig::InputError;
using rig::parse_train_config;
using rig::TrainConfig;

const char* kMinimal = R"(
model: /models/llama3-8b
datasets:
  - path: data/alpaca.jsonl
max_steps: 100
)";

// The message of the InputError that parsing `yaml` (with `overrides`) throws.
std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_train_config(yaml, "cfg.yaml", overrides);
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error for:\n" << yaml;
  return "";
}

TEST(TrainConfig, DefaultsFromMinimalFile) {
  TrainConfig c = parse_train_config(kMinimal, "cfg.yaml");
  EXPECT_EQ(c.model, "/models/llama3-8b");
  EXPECT_EQ(c.init, "pretrained");
  EXPECT_EQ(c.method, "full");
  ASSERT_EQ(c.datasets.size(), 1u);
  EXPECT_EQ(c.datasets[0].format, "alpaca");
  EXPECT_EQ(c.datasets[0].template_name, "alpaca");
  EXPECT_EQ(c.max_steps, 100);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-4);
  EXPECT_EQ(c.schedule.name, "cosine");
  EXPECT_EQ(c.save.keep_last, 3);
}

TEST(TrainConfig, NativeKeys) {
  TrainConfig c = parse_train_config(R"(
init: random
architecture: tiny
tokenizer: tok/tokenizer.json
method: lora
lora: {r: 8, alpha: 16, dropout: 0.1, targets: [q_proj, v_proj], rslora: true}
datasets:
  - {path: chat.jsonl, format: chat, template: llama3}
  - {path: corpus.txt, format: text}
sequence_len: 512
packing: false
micro_batch_size: 4
gradient_accumulation_steps: 8
num_epochs: 2
optimizer: {name: adamw, lr: 1e-3, betas: [0.9, 0.95], eps: 1e-6, weight_decay: 0.1,
            no_decay_on_norms_and_biases: false}
schedule: {name: linear, warmup_steps: 10, min_lr_ratio: 0.1}
max_grad_norm: 0.5
precision: fp32
activation_checkpointing: selective
eval: {every: 50, split: 0.05, batches: 4}
save: {every: 100, keep_last: 2}
seed: 7
device: cpu
max_memory: 22GiB
output_dir: runs/x
train_on_inputs: true
)",
                                     "cfg.yaml");
  EXPECT_EQ(c.init, "random");
  EXPECT_EQ(c.architecture_name, "tiny");
  EXPECT_EQ(c.architecture_json()["hidden_size"], 64);
  EXPECT_EQ(c.method, "lora");
  EXPECT_EQ(c.lora.r, 8);
  EXPECT_DOUBLE_EQ(c.lora.alpha, 16);
  EXPECT_TRUE(c.lora.rslora);
  EXPECT_DOUBLE_EQ(c.lora.scale(), 16 / std::sqrt(8.0));
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"q_proj", "v_proj"}));
  ASSERT_EQ(c.datasets.size(), 2u);
  EXPECT_EQ(c.datasets[0].template_name, "llama3");
  EXPECT_EQ(c.datasets[1].format, "text");
  EXPECT_EQ(c.datasets[1].template_name, "");
  EXPECT_FALSE(c.packing);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_DOUBLE_EQ(c.num_epochs, 2);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_FALSE(c.optimizer.no_decay_on_norms_and_biases);
  EXPECT_EQ(c.schedule.warmup_steps, 10);
  EXPECT_EQ(c.activation_checkpointing, "selective");
  EXPECT_EQ(c.eval.batches, 4);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.max_memory, 22ull << 30);
  EXPECT_TRUE(c.train_on_inputs);
}

TEST(TrainConfig, AxolotlSpellings) {
  TrainConfig c = parse_train_config(R"(
base_model: NousResearch/Meta-Llama-3-8B
adapter: lora
load_in_4bit: true
lora_r: 32
lora_alpha: 64
lora_dropout: 0.05
lora_target_modules: [q_proj, k_proj]
lora_target_linear: true
datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
chat_template: llama3
sequence_len: 4096
sample_packing: true
micro_batch_size: 2
gradient_accumulation_steps: 4
num_epochs: 1
optimizer: paged_adamw_8bit
learning_rate: 0.0002
lr_scheduler: cosine
warmup_steps: 10
weight_decay: 0.0
max_grad_norm: 1.0
bf16: true
gradient_checkpointing: true
save_steps: 200
save_total_limit: 2
eval_steps: 100
val_set_size: 0.02
output_dir: ./outputs/lora-out
)",
                                     "axolotl.yaml");
  EXPECT_EQ(c.model, "NousResearch/Meta-Llama-3-8B");
  EXPECT_EQ(c.method, "qlora");  // lora + load_in_4bit
  EXPECT_EQ(c.lora.r, 32);
  EXPECT_EQ(c.lora.targets.size(), 7u);
  EXPECT_EQ(c.datasets[0].template_name, "llama3");
  EXPECT_EQ(c.optimizer.name, "adamw8bit");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-4);
  EXPECT_EQ(c.precision, "bf16");
  EXPECT_EQ(c.activation_checkpointing, "full");
  EXPECT_EQ(c.save.every, 200);
  EXPECT_EQ(c.save.keep_last, 2);
  EXPECT_EQ(c.eval.every, 100);
  EXPECT_DOUBLE_EQ(c.eval.split, 0.02);
}

TEST(TrainConfig, UnknownKeyNamesLineAndSuggests) {
  std::string e = error_of("model: m\ndatasets: [d.jsonl]\nmax_steps: 1\nlearnig_rate: 1e-4\n");
  EXPECT_NE(e.find("cfg.yaml:4"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key 'learnig_rate'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'learning_rate'"), std::string::npos) << e;

  e = error_of("model: m\ndatasets: [d.jsonl]\nmax_steps: 1\nlora:\n  r: 8\n  alpah: 16\n");
  EXPECT_NE(e.find("cfg.yaml:6"), std::string::npos) << e;
  EXPECT_NE(e.find("'lora.alpah'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'lora.alpha'"), std::string::npos) << e;

  e = error_of("model: m\ndatasets:\n  - path: d\n    fromat: chat\nmax_steps: 1\n");
  EXPECT_NE(e.find("'datasets.0.fromat'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'datasets.0.format'"), std::string::npos) << e;
}

TEST(TrainConfig, InvalidUtf8IsNamedByLineAndColumn) {
  // Found by fuzz_train_yaml: a byte that is not UTF-8 inside a string was accepted, and writing
  // the resolved config.json failed with the JSON library's error.
  try {
    parse_train_config(
        "datasets: [d.jsonl]\nmodel: \"m\xb6"
        "del\"\n",
        "cfg.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "cfg.yaml:2:10: not valid UTF-8");
  }
  try {
    parse_train_config(kMinimal, "cfg.yaml", {"model=m\xb6"});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--set"), std::string::npos) << e.what();
  }
}

TEST(TrainConfig, WrongTypesNameTheKey) {
  std::string e = error_of(std::string(kMinimal) + "lora_r: eight\n");
  EXPECT_NE(e.find("cfg.yaml:6"), std::string::npos) << e;
  EXPECT_NE(e.find("'lora_r' must be an integer, found 'eight'"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "packing: maybe\n");
  EXPECT_NE(e.find("'packing' must be true or false"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "learning_rate: [1]\n");
  EXPECT_NE(e.find("'learning_rate' must be a number, found 'a list'"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "lora: 8\n");
  EXPECT_NE(e.find("'lora' must be a mapping"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "method: lorra\n");
  EXPECT_NE(e.find("did you mean 'lora'"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "method: lora\nlora: {targets: [q_prj]}\n");
  EXPECT_NE(e.find("'q_prj' is not a LoRA target"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'q_proj'"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "device: tpu\n");
  EXPECT_NE(e.find("'device' is 'tpu'"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "max_memory: 22 furlongs\n");
  EXPECT_NE(e.find("max_memory"), std::string::npos) << e;
  e = error_of("model: [unclosed\n");
  EXPECT_NE(e.find("YAML syntax error"), std::string::npos) << e;
}

TEST(TrainConfig, RangesAreChecked) {
  auto with = [](const std::string& extra) { return std::string(kMinimal) + extra; };
  EXPECT_NE(error_of(with("learning_rate: 0\n")).find("optimizer.lr"), std::string::npos);
  EXPECT_NE(error_of(with("method: lora\nlora_r: 0\n")).find("lora.r"), std::string::npos);
  EXPECT_NE(error_of(with("method: lora\nlora_dropout: 1.5\n")).find("lora.dropout"),
            std::string::npos);
  EXPECT_NE(error_of(with("micro_batch_size: -1\n")).find("micro_batch_size"), std::string::npos);
  EXPECT_NE(error_of(with("optimizer: {betas: [0.9, 1.0]}\n")).find("beta2"), std::string::npos);
  EXPECT_NE(error_of(with("val_set_size: 200\n")).find("eval.split"), std::string::npos);
  EXPECT_NE(error_of(with("eval_steps: 10\n")).find("nothing is held out"), std::string::npos);
  EXPECT_NE(error_of(with("warmup_steps: 100\n")).find("warmup_steps"), std::string::npos);
  EXPECT_NE(error_of(with("device: cpu\nprecision: bf16\n")).find("CPU backend"),
            std::string::npos);
  EXPECT_NE(error_of("model: m\nmax_steps: 1\n").find("no training data"), std::string::npos);
  EXPECT_NE(error_of("datasets: [d]\nmax_steps: 1\n").find("no model"), std::string::npos);
  EXPECT_NE(error_of("init: random\ndatasets: [d]\nmax_steps: 1\n").find("needs 'architecture'"),
            std::string::npos);
  EXPECT_NE(error_of("init: random\narchitecture: tiny\ndatasets: [d]\nmax_steps: 1\n")
                .find("no tokenizer"),
            std::string::npos);
  EXPECT_NE(error_of("init: random\narchitecture: llama3-9b\n").find("did you mean 'llama3-8b'"),
            std::string::npos);
  // An inline architecture is checked by the model config parser.
  EXPECT_NE(error_of("init: random\narchitecture: {model_type: llama, vocab_size: 10}\n")
                .find("hidden_size"),
            std::string::npos);
  EXPECT_NE(error_of(with("fp16: true\n")).find("fp16"), std::string::npos);
}

TEST(TrainConfig, AliasAndCanonicalTogetherIsAnError) {
  std::string e = error_of(std::string(kMinimal) + "learning_rate: 1e-4\noptimizer: {lr: 2e-4}\n");
  EXPECT_NE(e.find("learning_rate"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer.lr"), std::string::npos) << e;
  EXPECT_NE(e.find("keep one"), std::string::npos) << e;
}

TEST(TrainConfig, OverridesWinAndNest) {
  std::string y = std::string(kMinimal) + "learning_rate: 1e-4\nlora: {r: 4}\nmethod: lora\n";
  TrainConfig c = parse_train_config(
      y, "cfg.yaml",
      {"optimizer.lr=3e-4", "lora.r=8", "lora.targets=[q_proj, o_proj]", "datasets.0.format=chat",
       "datasets.1.path=extra.jsonl", "eval.split=0.1", "seed=1"});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);  // the override beats the file's alias
  EXPECT_EQ(c.lora.r, 8);
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"q_proj", "o_proj"}));
  ASSERT_EQ(c.datasets.size(), 2u);
  EXPECT_EQ(c.datasets[0].format, "chat");
  EXPECT_EQ(c.datasets[1].path, "extra.jsonl");
  EXPECT_DOUBLE_EQ(c.eval.split, 0.1);
  EXPECT_EQ(c.seed, 1u);

  std::string e = error_of(kMinimal, {"lora.rr=3"});
  EXPECT_NE(e.find("--set lora.rr"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'lora.r'"), std::string::npos) << e;
  e = error_of(kMinimal, {"max_steps=many"});
  EXPECT_NE(e.find("--set max_steps"), std::string::npos) << e;
  EXPECT_NE(e.find("must be an integer"), std::string::npos) << e;
  EXPECT_NE(error_of(kMinimal, {"novalue"}).find("expected key=value"), std::string::npos);
  EXPECT_NE(error_of(kMinimal, {"datasets.5.path=x"}).find("not an index"), std::string::npos);
}

TEST(TrainConfig, YamlRoundTripAndStableHash) {
  TrainConfig a = parse_train_config(R"(
init: random
architecture: {model_type: llama, vocab_size: 100, hidden_size: 32, intermediate_size: 64,
               num_hidden_layers: 1, num_attention_heads: 4, rope_theta: 10000.0}
tokenizer: "123"
method: qlora
datasets: [{path: "true", format: chat}]
max_steps: 10
learning_rate: 0.0003
max_memory: 1GiB
)",
                                     "a.yaml");
  std::string y = a.to_yaml();
  TrainConfig b = parse_train_config(y, "resolved.yaml");
  EXPECT_EQ(a.to_json(), b.to_json()) << y;
  EXPECT_EQ(a.config_hash(), b.config_hash());
  EXPECT_EQ(b.tokenizer, "123");
  EXPECT_EQ(b.datasets[0].path, "true");
  EXPECT_EQ(b.architecture["rope_theta"], 10000.0);
  EXPECT_EQ(a.config_hash().size(), 16u);

  // The hash changes with what is computed, not with where it is saved.
  TrainConfig c = parse_train_config(y, "resolved.yaml", {"output_dir=elsewhere", "save.every=5"});
  EXPECT_EQ(a.config_hash(), c.config_hash());
  TrainConfig d = parse_train_config(y, "resolved.yaml", {"learning_rate=0.0004"});
  EXPECT_NE(a.config_hash(), d.config_hash());
}

TEST(TrainConfig, ScheduleMatchesHuggingFace) {
  rig::ScheduleSettings s;
  s.name = "cosine";
  s.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(s.lr_at(0, 110, 1.0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(5, 110, 1.0), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(10, 110, 1.0), 1.0);
  EXPECT_NEAR(s.lr_at(60, 110, 1.0), 0.5, 1e-12);
  EXPECT_NEAR(s.lr_at(110, 110, 1.0), 0.0, 1e-12);
  s.min_lr_ratio = 0.1;
  EXPECT_NEAR(s.lr_at(110, 110, 1.0), 0.1, 1e-12);
  s.name = "linear";
  s.min_lr_ratio = 0;
  EXPECT_NEAR(s.lr_at(60, 110, 2.0), 1.0, 1e-12);
  s.name = "constant";
  EXPECT_DOUBLE_EQ(s.lr_at(100, 110, 2.0), 2.0);
}

TEST(TrainConfig, BuiltinArchitecturesParse) {
  for (const auto& name : rig::builtin_architecture_names()) {
    auto j = rig::builtin_architecture(name);
    ASSERT_TRUE(j.has_value());
    EXPECT_NO_THROW(rig::ModelConfig::from_json(*j, name)) << name;
  }
  auto l8 = rig::ModelConfig::from_json(*rig::builtin_architecture("llama3-8b"), "llama3-8b");
  EXPECT_NEAR(double(l8.num_parameters()), 8.03e9, 0.01e9);
}

TEST(TrainConfig, EveryRecipeLoads) {
  namespace fs = std::filesystem;
  int n = 0;
  for (const auto& e : fs::directory_iterator(fs::path(RIG_SOURCE_DIR) / "configs")) {
    if (e.path().extension() != ".yaml") continue;
    ++n;
    EXPECT_NO_THROW({
      try {
        TrainConfig c = rig::load_train_config(e.path().string());
        // The resolved config reads back the same.
        EXPECT_EQ(parse_train_config(c.to_yaml(), "x").to_json(), c.to_json());
      } catch (const std::exception& ex) {
        ADD_FAILURE() << ex.what();
        throw;
      }
    }) << e.path();
  }
  EXPECT_GE(n, 4);
}

TEST(TrainConfig, MissingFileNamesIt) {
  try {
    rig::load_train_config("/nonexistent/cfg.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/cfg.yaml"), std::string::npos);
  }
}

TEST(TrainConfig, EditDistance) {
  EXPECT_EQ(rig::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(rig::closest_match("micro_batch", {"micro_batch_size", "seed"}), "micro_batch_size");
  EXPECT_EQ(rig::closest_match("zzzzzz", {"seed", "model"}), "");
}

}  // namespace

namespace {

void flatten(const nlohmann::json& j, const std::string& prefix, std::vector<std::string>& out) {
  if (j.is_object() && prefix != "architecture") {
    for (auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
  } else if (j.is_array() && !j.empty() && j[0].is_object()) {
    out.push_back(prefix);
    flatten(j[0], prefix + ".N", out);
  } else {
    out.push_back(prefix);
  }
}

// Every key of the resolved config is documented in docs/config-reference.md.
TEST(TrainConfig, ReferenceDocumentsEveryKey) {
  TrainConfig c = parse_train_config(kMinimal, "cfg.yaml");
  std::vector<std::string> keys;
  flatten(c.to_json(), "", keys);
  std::string doc = rig::read_file(std::string(RIG_SOURCE_DIR) + "/docs/config-reference.md");
  for (const auto& k : keys) EXPECT_NE(doc.find("`" + k + "`"), std::string::npos) << k;
  EXPECT_GE(keys.size(), 30u);
}

TEST(TrainConfig, SaveRunConfigWritesBothForms) {
  std::string run = rig::test::temp_dir("run_config");
  TrainConfig c = parse_train_config(kMinimal, "cfg.yaml");
  rig::save_run_config(c, run);
  TrainConfig back = rig::load_train_config(run + "/config.yaml");
  EXPECT_EQ(back.config_hash(), c.config_hash());
  auto j = nlohmann::json::parse(rig::read_file(run + "/config.json"));
  EXPECT_EQ(j["config_hash"], c.config_hash());
  EXPECT_EQ(j["model"], "/models/llama3-8b");
}

}  // namespace

TEST(TrainConfig, ChatDatasetsDefaultToTheModelsOwnTemplate) {
  TrainConfig c = parse_train_config(R"(
model: m
datasets:
  - {path: chat.jsonl, format: chat}
  - {path: chat2.jsonl, format: chat, template: auto}
  - {path: alpaca.jsonl}
)",
                                     "c.yaml");
  EXPECT_EQ(c.datasets[0].template_name, "auto");
  EXPECT_EQ(c.datasets[1].template_name, "auto");
  EXPECT_EQ(c.datasets[2].template_name, "alpaca");
  EXPECT_THROW(parse_train_config(R"(
model: m
datasets:
  - {path: chat.jsonl, format: chat, template: mistral}
)",
                                  "c.yaml"),
               InputError);
}
