#pragma once
// The job a training config describes, as the planner sees it: `rig plan --config` and the
// trainer's own prediction at the start of a run.
#include "rig/model/config.h"
#include "rig/plan/memory.h"
#include "rig/train/train_config.h"

namespace rig::plan {

// Method, LoRA, sequence, batch, checkpointing, optimizer, strategy and precision (bf16 unless
// the config asks for fp32 or runs on the CPU); world_size 1: the caller sets the ranks.
TrainSetup train_setup_of(const TrainConfig& c);
// The model it trains: its inline or built-in architecture, its model folder, or the catalogue
// shape whose Hugging Face id `model:` names (a recipe's meta-llama/Meta-Llama-3-70B).
ModelConfig model_of(const TrainConfig& c);

}  // namespace rig::plan
