// Model dimensions as compile-time constants: NVRTC compiles every kernel with the
// checkpoint's config.json values passed as -D options, so one source specialises to every
// dense Qwen3 size. This header is the contract between the host code and the kernels.
#pragma once

#ifndef QW_HIDDEN
#error "QW_HIDDEN (hidden_size) must be defined by the host compile options"
#endif
#ifndef QW_INTERMEDIATE
#error "QW_INTERMEDIATE (intermediate_size) must be defined"
#endif
#ifndef QW_HEADS
#error "QW_HEADS (num_attention_heads) must be defined"
#endif
#ifndef QW_KV_HEADS
#error "QW_KV_HEADS (num_key_value_heads) must be defined"
#endif
#ifndef QW_HEAD_DIM
#error "QW_HEAD_DIM (head_dim) must be defined"
#endif
#ifndef QW_VOCAB
#error "QW_VOCAB (vocab_size) must be defined"
#endif

namespace qw {
constexpr int hidden = QW_HIDDEN;
constexpr int intermediate = QW_INTERMEDIATE;
constexpr int heads = QW_HEADS;
constexpr int kv_heads = QW_KV_HEADS;
constexpr int head_dim = QW_HEAD_DIM;
constexpr int vocab = QW_VOCAB;
constexpr int q_size = heads * head_dim;
constexpr int kv_size = kv_heads * head_dim;
constexpr int group = heads / kv_heads;

static_assert(heads % kv_heads == 0, "query heads must be a multiple of key/value heads");
static_assert(head_dim % 16 == 0 && head_dim <= 256 && (256 % head_dim) == 0,
              "the CUDA kernels need head_dim in {16, 32, 64, 128, 256}");
static_assert(hidden % 8 == 0 && intermediate % 8 == 0,
              "16-byte weight loads need hidden and intermediate sizes that are multiples of 8");
}  // namespace qw
