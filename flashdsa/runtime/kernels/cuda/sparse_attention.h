// Arguments of the native sparse MLA attention (sparse_attention.cu): the decode over the FP8 paged
// cache and the forward over bf16 key rows, shared with their torch ops (sparse_decode_op.cpp,
// sparse_fwd_op.cpp). Plain C++: no CUDA or torch header, so both sides compile anywhere.
#pragma once

#include <cstdint>

namespace flashdsa {

// How the gathered key rows are stored.
enum class KeyFormat : int {
  kFp8Cache = 0,  // [num_keys, 656] uint8 FP8 MLA tokens (flashdsa.runtime.cache.layout), d_qk 576
  kBf16 = 1,      // [num_keys, d_qk] bf16 rows, d_qk 512 or 576
};

// One call: rows query rows (b * s_q for the decode, s_q for the forward), each with its own topk
// key ids; h_q = head_blocks * 64.
struct SparseAttentionArgs {
  const void* q;           // [rows, h_q, d_qk] bf16, contiguous, 16-byte aligned
  const void* keys;        // see KeyFormat, 16-byte aligned
  KeyFormat format;
  int d_qk;                // 576, or 512 with bf16 keys
  int64_t num_keys;        // a key id outside [0, num_keys) is invalid
  const int32_t* indices;  // [rows, topk] int32 key ids, contiguous
  int64_t rows;
  int s_q;                 // rows per batch entry (lse is [b, h_q, s_q]; 1 for the forward's [s_q, h_q])
  int h_q;                 // 64 or 128
  int topk;
  int splits;              // >= 1: the top-k list is cut into this many parts of tokens_per_split
  int tokens_per_split;    // a multiple of 64
  float scale_log2;        // sm_scale * log2(e)
  void* out;               // [rows, h_q, 512] bf16
  float* lse;              // [b, h_q, s_q] fp32
  float* max_logits;       // nullptr, or [rows, h_q] fp32 (one split only)
  float* part_out;         // splits > 1: [rows, splits, h_q, 512] fp32 workspace
  float* part_lse;         // splits > 1: [rows, splits, h_q] fp32 workspace
};

constexpr int kSparseHeadsPerCta = 64;
constexpr int kSparseKeysPerTile = 64;
constexpr int kSparseMaxSplits = 128;
constexpr int kSparseMaxTopk = 16384;

// Launches the attention (and, for splits > 1, the combine) on `stream` of `device`.
// Returns nullptr or the CUDA error's text.
const char* launch_sparse_attention(const SparseAttentionArgs& args, int device, void* stream);

}  // namespace flashdsa
