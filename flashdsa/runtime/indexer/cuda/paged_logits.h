// The paged indexer logits kernel's arguments and host entry points (paged_logits.cu), shared with
// its torch op (paged_logits_op.cpp), which compiles without the CUDA headers.
#pragma once

#include <cstdint>

namespace flashdsa {

struct PagedLogitsArgs {
  const uint8_t* q;          // [B, n, heads, 128] e4m3
  const float* weights;      // [B * n, heads]
  const uint8_t* cache;      // [num_blocks, 64, 132]: 64 keys of 128 bytes, then their 64 fp32 scales
  const int* context_lens;   // [B]
  const int* block_tables;   // [B, table_stride >= blocks used]
  float* out;                // [B * n, max_context_len]
  int64_t table_stride, max_context_len, num_blocks;
  int batch, n, heads, blocks_per_cta;
  bool fill_past_context;    // false: blocks past a request's context are not written
};

int paged_logits_max_blocks_per_cta();
// The kernel's wgmma N for n queries of `heads` heads a request; 0 when they do not fit one wgmma.
int paged_logits_columns(int n, int heads);
// Launches on `stream` of `device`; nullptr or the error.
const char* launch_paged_logits(const PagedLogitsArgs& args, int device, void* stream);

}  // namespace flashdsa
