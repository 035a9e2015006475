// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the host emulation, with the
// fragment layouts of the PTX ISA (common.cuh's comment above its mma_bf16): each lane
// posts its fragments, then computes its four outputs from the lanes that hold them.

inline void mma_bf16(float* d, const u32* a, const u32* b) {
    unsigned lane = threadIdx.x % 32;
    for (int i = 0; i < 4; i++) emu::slot(lane)[i] = a[i];
    for (int i = 0; i < 2; i++) emu::slot(lane)[4 + i] = b[i];
    emu::warp_sync();
    auto half = [](u32 pair, int k) { return bf2f((bf16)(k % 2 ? pair >> 16 : pair & 0xffffu)); };
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e / 2), n = 2 * t + e % 2;
        float sum = d[e];
        for (int k = 0; k < 16; k++) {
            // A[row][k] is in lane (row % 8)·4 + (k % 8)/2, register (row ≥ 8) + 2·(k ≥ 8);
            // B[k][n] in lane n·4 + (k % 8)/2, register 4 + (k ≥ 8).
            u32 ar = emu::slot((row % 8) * 4 + (k % 8) / 2)[(row >= 8) + 2 * (k >= 8)];
            u32 br = emu::slot(n * 4 + (k % 8) / 2)[4 + (k >= 8)];
            sum += half(ar, k) * half(br, k);
        }
        d[e] = sum;
    }
    emu::warp_sync();
}

// One E4M3 byte (the host's quant::e4m3_to_f32).
inline float e4m3_value(unsigned b) {
    const unsigned exponent = (b >> 3) & 15, mantissa = b & 7;
    const float mag = exponent == 0 ? std::ldexp((float)mantissa, -9) : std::ldexp((float)(8 + mantissa), (int)exponent - 10);
    return (b & 0x80) ? -mag : mag;
}

// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 with the PTX ISA's 8-bit fragment
// layouts (quant.cu's comment above its mma_e4m3), summed in f32.
inline void mma_e4m3(float* d, const u32* a, const u32* b) {
    unsigned lane = threadIdx.x % 32;
    for (int i = 0; i < 4; i++) emu::slot(lane)[i] = a[i];
    for (int i = 0; i < 2; i++) emu::slot(lane)[4 + i] = b[i];
    emu::warp_sync();
    auto byte = [](u32 word, int k) { return e4m3_value((word >> (8 * (k % 4))) & 0xffu); };
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e / 2), n = 2 * t + e % 2;
        float sum = d[e];
        for (int k = 0; k < 32; k++) {
            // A[row][k] is in lane (row % 8)·4 + (k % 16)/4, register (row ≥ 8) + 2·(k ≥ 16);
            // B[k][n] in lane n·4 + (k % 16)/4, register 4 + (k ≥ 16).
            u32 ar = emu::slot((row % 8) * 4 + (k % 16) / 4)[(row >= 8) + 2 * (k >= 16)];
            u32 br = emu::slot(n * 4 + (k % 16) / 4)[4 + (k >= 16)];
            sum += byte(ar, k) * byte(br, k);
        }
        d[e] = sum;
    }
    emu::warp_sync();
}
