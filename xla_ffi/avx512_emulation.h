// Scalar stand-ins for the AVX-512 intrinsics that cpu_row_kernels_avx512.cc
// uses, for a test build only (CMake option QMOE_EMULATE_AVX512, run by
// .ci/asan_fuzz). They let a machine without AVX-512 run the AVX-512
// row kernels' logic: lane selection, masks, permute indices, position
// lists. They are not the hardware: they check what the code asks the
// instructions to do (as Intel's intrinsics guide defines each one), not how
// the compiler encodes it; only an AVX-512 CPU tests that
// (benchmarks/gpu_check.sh runs the same tests on its host).
//
// Each function follows the guide's operation for its intrinsic; loads and
// stores go through memcpy (the kernels cast byte and int pointers to vector
// pointers), and a masked load reads only its selected lanes, as the
// hardware does, so AddressSanitizer holds these to the same bounds.
// Included instead of <immintrin.h>, inside no namespace of the kernels: the
// names live in qmoe::cpu, where the kernels' unqualified calls find them.
#pragma once

#ifndef QMOE_EMULATE_AVX512
#error "avx512_emulation.h is for the QMOE_EMULATE_AVX512 test build only"
#endif

#include <cstdint>
#include <cstring>

namespace qmoe::cpu {

using __mmask16 = uint16_t;

struct __m128i {
  uint8_t bytes[16];
};
struct __m256i {
  uint32_t lanes[8];
};
struct __m512 {
  float lanes[16];
};
struct __m512i {
  uint32_t lanes[16];
};

inline bool LaneSelected(__mmask16 mask, int lane) { return (mask >> lane) & 1u; }

inline __m128i _mm_loadu_si128(const __m128i* source) {
  __m128i v;
  std::memcpy(v.bytes, source, sizeof(v.bytes));
  return v;
}

inline void _mm256_storeu_si256(__m256i* target, __m256i v) {
  std::memcpy(target, v.lanes, sizeof(v.lanes));
}

inline __m512 _mm512_setzero_ps() { return __m512{}; }

inline __m512i _mm512_set1_epi32(int value) {
  __m512i v;
  for (uint32_t& lane : v.lanes) lane = static_cast<uint32_t>(value);
  return v;
}

inline __m512 _mm512_loadu_ps(const float* source) {
  __m512 v;
  std::memcpy(v.lanes, source, sizeof(v.lanes));
  return v;
}

// Lanes not in `mask` are zero and their memory is not read.
inline __m512 _mm512_maskz_loadu_ps(__mmask16 mask, const float* source) {
  __m512 v{};
  for (int i = 0; i < 16; ++i) {
    if (LaneSelected(mask, i)) std::memcpy(&v.lanes[i], source + i, sizeof(float));
  }
  return v;
}

inline void _mm512_storeu_ps(float* target, __m512 v) {
  std::memcpy(target, v.lanes, sizeof(v.lanes));
}

// Zero-extends 16 bytes to 16 32-bit lanes.
inline __m512i _mm512_cvtepu8_epi32(__m128i v) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.lanes[i] = v.bytes[i];
  return r;
}

// Lane i from a (index bit 4 clear) or b (set) at the index's low 4 bits;
// higher index bits are ignored.
inline __m512 _mm512_permutex2var_ps(__m512 a, __m512i index, __m512 b) {
  __m512 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t j = index.lanes[i] & 31u;
    r.lanes[i] = j < 16 ? a.lanes[j] : b.lanes[j - 16];
  }
  return r;
}

inline __m512 _mm512_add_ps(__m512 a, __m512 b) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.lanes[i] = a.lanes[i] + b.lanes[i];
  return r;
}

// a + b in the lanes of `mask`, src's lanes elsewhere.
inline __m512 _mm512_mask_add_ps(__m512 src, __mmask16 mask, __m512 a, __m512 b) {
  __m512 r;
  for (int i = 0; i < 16; ++i)
    r.lanes[i] = LaneSelected(mask, i) ? a.lanes[i] + b.lanes[i] : src.lanes[i];
  return r;
}

// The sum of the lanes in `mask` (others count as 0), halving as GCC's
// implementation does: lanes i and i + 8, then i and i + 4, i and i + 2, 0 and 1.
inline float _mm512_mask_reduce_add_ps(__mmask16 mask, __m512 a) {
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = LaneSelected(mask, i) ? a.lanes[i] : 0.0f;
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) v[i] = v[i] + v[i + width];
  }
  return v[0];
}

inline __m512i _mm512_and_si512(__m512i a, __m512i b) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.lanes[i] = a.lanes[i] & b.lanes[i];
  return r;
}

// Lanewise 32-bit addition, wrapping.
inline __m512i _mm512_add_epi32(__m512i a, __m512i b) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.lanes[i] = a.lanes[i] + b.lanes[i];
  return r;
}

// Bit i set where a's lane i is below b's, as unsigned 32-bit integers.
inline __mmask16 _mm512_cmplt_epu32_mask(__m512i a, __m512i b) {
  uint32_t mask = 0;
  for (int i = 0; i < 16; ++i) mask |= static_cast<uint32_t>(a.lanes[i] < b.lanes[i]) << i;
  return static_cast<__mmask16>(mask);
}

inline uint32_t _cvtmask16_u32(__mmask16 mask) { return mask; }

// The low 256 bits (lanes 0..7).
inline __m256i _mm512_castsi512_si256(__m512i v) {
  __m256i r;
  std::memcpy(r.lanes, v.lanes, sizeof(r.lanes));
  return r;
}

// 256-bit half `half` (0: lanes 0..7, 1: lanes 8..15); the hardware reads
// only the immediate's low bit.
inline __m256i _mm512_extracti64x4_epi64(__m512i v, int half) {
  __m256i r;
  std::memcpy(r.lanes, v.lanes + 8 * (half & 1), sizeof(r.lanes));
  return r;
}

}  // namespace qmoe::cpu
