/* What a built library says about itself: its ABI, its tier, its structs' sizes. */
#include "tern_kernels.h"

int tern_abi_version(void) { return 16; }

const char *tern_compiled_tier(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return "amx";
#elif defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "baseline";
#endif
}

void tern_struct_sizes(int64_t *sizes) {
    sizes[0] = (int64_t)sizeof(TernLinear);
    sizes[1] = (int64_t)sizeof(TernDecodeLayer);
    sizes[2] = (int64_t)sizeof(TernDecodeStep);
}
