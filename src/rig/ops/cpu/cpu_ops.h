// float32 CPU implementations behind ops.h: one function per row of op_table.inc.
#pragma once
#include "rig/ops/ops.h"

namespace rig::ops::cpu {
#define RIG_OP(ret, name, category, device_of, params, args) ret name params;
#define RIG_OP_CUSTOM(ret, name, params) ret name params;
#define RIG_BACKEND(ret, name, params) ret name params;
#include "rig/ops/op_table.inc"
}  // namespace rig::ops::cpu
