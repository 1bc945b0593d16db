// Which L2 partition each SM of a GPU reads through, found by a latency probe once per device.
//
// H100/H200 split their L2 into two partitions joined by a fabric; a line the SM's own partition
// does not hold crosses it. Where the partition of every SM is known, work that shares data can go
// to the SMs of one side (the fused forward's task tickets, kernels/megakernel/tickets.cuh). The
// hardware reports no such map, so it is measured: one CTA per SM, in turns, reads lines that a
// reference SM has just read; the SMs on the reference's side find all of them in their partition,
// the others find about half across the fabric (~80 cycles slower on average on H200).
#pragma once

#include <cstdint>
#include <vector>

namespace mok::runtime {

// %smid values covered by a map (Hopper has at most 144 SMs; ids are below %nsmid).
inline constexpr int kMaxSmIds = 256;

struct L2PartitionMap {
  // Device memory, kMaxSmIds entries: the partition (0 or 1) of the SM with that %smid; null when
  // the probe found one partition (or could not run), and every SM then counts as partition 0.
  const uint8_t* device_table = nullptr;
  int num_partitions = 1;
  int sms_per_partition[2] = {0, 0};
  std::vector<int> probe_latency;  // mean cycles per probe read, by %smid (-1: the reference)
};

// The map of the current device, probed on first use and kept for the process: a few
// milliseconds, a device synchronisation, and ~40 MB plus twice the L2's size of temporary device
// memory (without that memory, or on a GPU with one partition, the map has one partition).
// Thread-safe; one entry per device.
const L2PartitionMap& l2_partition_map();

// The probe's reading, on the host: CTA c ran on SM smid[c] and measured mean_latency[c] cycles
// (CTA 0, the reference, measured nothing). Two partitions when the widest gap of the sorted
// latencies is at least min_gap cycles and three standard deviations of either side, and each
// side holds at least an eighth of the CTAs; else one (all 0). Returns the partition of each CTA.
std::vector<uint8_t> classify_l2_partitions(const std::vector<double>& mean_latency,
                                            int min_gap_cycles, int* num_partitions);

}  // namespace mok::runtime
