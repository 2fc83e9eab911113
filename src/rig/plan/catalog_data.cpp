// Generated from configs/catalog/gpus.yaml (keep them identical; plan_test checks it).
#include "rig/plan/catalog.h"

namespace rig::plan {
const char* builtin_catalog_yaml() {
  // Long on purpose: the catalogue is one YAML literal, the file as it is.
  return R"YAML(# GPU catalog for `rig plan`. Add or override cards with `rig plan --catalog my.yaml`: an entry
# with a known key overrides only the fields it gives; a new key adds a card.
# This file is compiled into rig (src/rig/plan/catalog_data.cpp); plan_test checks they match.
#
# memory_gb: nominal size (used for bit-error rates); memory_mib: total as nvidia-smi reports it.
# bandwidth_gbs: memory bandwidth, GB/s. bf16_tflops: dense tensor-core bf16 with fp32
# accumulate, no sparsity. tdp_w: board power limit. transient: ms-scale power spikes as a
# multiple of TDP. price_usd: typical purchase price (2025; used for 3090). cloud_usd_hour:
# typical on-demand price per GPU-hour at GPU clouds (hyperscalers charge 2-3x more).
# p2p: peer-to-peer over PCIe works with the stock driver. nvlink: none, bridge (2 cards) or
# sxm (all cards); nvlink_gbs: per direction. fit_per_gb: silent memory bit-error rate
# (failures per 10^9 hours per GB) used when the card has no ECC.
gpus:
  rtx3090:
    aliases: [3090]
    name: NVIDIA GeForce RTX 3090
    memory_gb: 24
    memory_mib: 24576
    bandwidth_gbs: 936
    bf16_tflops: 71
    tdp_w: 350
    transient: 2.0
    price_usd: 800
    cloud_usd_hour: 0.43
    pcie_gen: 4
    p2p: false
    nvlink: bridge
    nvlink_gbs: 56.25
    ecc: false
    fit_per_gb: 1500
  rtx4090:
    aliases: [4090]
    name: NVIDIA GeForce RTX 4090
    memory_gb: 24
    memory_mib: 24564
    bandwidth_gbs: 1008
    bf16_tflops: 165.2
    tdp_w: 450
    transient: 1.7
    price_usd: 1600
    cloud_usd_hour: 0.69
    pcie_gen: 4
    p2p: false
    nvlink: none
    nvlink_gbs: 0
    ecc: false
    fit_per_gb: 1500
  rtx5090:
    aliases: [5090]
    name: NVIDIA GeForce RTX 5090
    memory_gb: 32
    memory_mib: 32607
    bandwidth_gbs: 1792
    bf16_tflops: 209.5
    tdp_w: 575
    transient: 1.7
    price_usd: 2000
    cloud_usd_hour: 0.94
    pcie_gen: 5
    p2p: false
    nvlink: none
    nvlink_gbs: 0
    ecc: false
    fit_per_gb: 1500
  a6000:
    aliases: [rtxa6000]
    name: NVIDIA RTX A6000
    memory_gb: 48
    memory_mib: 49140
    bandwidth_gbs: 768
    bf16_tflops: 154.8
    tdp_w: 300
    transient: 1.3
    price_usd: 4650
    cloud_usd_hour: 0.49
    pcie_gen: 4
    p2p: true
    nvlink: bridge
    nvlink_gbs: 56.25
    ecc: true
    fit_per_gb: 1500
  l40s:
    aliases: []
    name: NVIDIA L40S
    memory_gb: 48
    memory_mib: 46068
    bandwidth_gbs: 864
    bf16_tflops: 362.1
    tdp_w: 350
    transient: 1.2
    price_usd: 8000
    cloud_usd_hour: 0.86
    pcie_gen: 4
    p2p: true
    nvlink: none
    nvlink_gbs: 0
    ecc: true
    fit_per_gb: 1500
  a100-40gb:
    aliases: [a100-40, a10040]
    name: NVIDIA A100 40GB SXM4
    memory_gb: 40
    memory_mib: 40960
    bandwidth_gbs: 1555
    bf16_tflops: 312
    tdp_w: 400
    transient: 1.2
    price_usd: 10000
    cloud_usd_hour: 1.29
    pcie_gen: 4
    p2p: true
    nvlink: sxm
    nvlink_gbs: 300
    ecc: true
    fit_per_gb: 1500
  a100-80gb:
    aliases: [a100, a100-80]
    name: NVIDIA A100 80GB SXM4
    memory_gb: 80
    memory_mib: 81920
    bandwidth_gbs: 2039
    bf16_tflops: 312
    tdp_w: 400
    transient: 1.2
    price_usd: 15000
    cloud_usd_hour: 1.79
    pcie_gen: 4
    p2p: true
    nvlink: sxm
    nvlink_gbs: 300
    ecc: true
    fit_per_gb: 1500
  h100:
    aliases: [h100-sxm]
    name: NVIDIA H100 80GB SXM5
    memory_gb: 80
    memory_mib: 81559
    bandwidth_gbs: 3350
    bf16_tflops: 989.4
    tdp_w: 700
    transient: 1.2
    price_usd: 30000
    cloud_usd_hour: 2.99
    pcie_gen: 5
    p2p: true
    nvlink: sxm
    nvlink_gbs: 450
    ecc: true
    fit_per_gb: 1500
  h200:
    aliases: [h200-sxm]
    name: NVIDIA H200 141GB SXM5
    memory_gb: 141
    memory_mib: 143771
    bandwidth_gbs: 4800
    bf16_tflops: 989.4
    tdp_w: 700
    transient: 1.2
    price_usd: 32000
    cloud_usd_hour: 3.79
    pcie_gen: 5
    p2p: true
    nvlink: sxm
    nvlink_gbs: 450
    ecc: true
    fit_per_gb: 1500
)YAML";
}
}  // namespace rig::plan
