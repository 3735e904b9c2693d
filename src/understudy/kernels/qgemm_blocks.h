/* qgemm.c's block formats, included by qgemm.c: every kernel type's GGUF block unpacked into
 * one form (block_t), and the panel layouts the kernels read (layout_t, pack_block, and
 * panel_decode, the portable path's reader of a panel-block).
 *
 * One form for every type: value e of a block is
 *     (d * sc[e / width]) * v(code[e]) - dm * mn[e / width]
 * with code[e] the unsigned quant as stored, v(code) = kvalues[code] (IQ4) or code - offset,
 * sc and mn integer sub-block scales and mins, d and dm float16. A type without sub-block
 * scales has sc = 1 (one sub-block); one without mins mn = 0, dm = 0; Q4_1 and Q5_1, whose
 * value is d * q + m, have mn = -1 and dm = m. gguf's dequantizers compute each type's value
 * in float32 in exactly this order (the products d * sc and dm * mn rounded first), so
 * understudy_qdequant_rows gives their bits.
 */
#include <stdint.h>
#include <string.h>

/* ggml's type ids */
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
#define T_COUNT 31

#define PANEL 16 /* columns side by side */

/* IQ4_NL's and IQ4_XS's 16 values, indexed by the 4-bit code */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

/* ---- the panel layouts --------------------------------------------------------------------
 * A panel-block holds 16 columns' block b. Column c's float16 d at 2c, its dm (where the
 * type has one) at dm + 2c. Its codes in one to three parts, each in 64-byte groups whose
 * byte 4c + i holds values of column c with e % 4 = i, so one 512-bit load gives 4 values
 * of each of the 16 columns (a 256-bit load: 8 columns):
 *   LOW 4 bits, "pairs": group e / 8, the low nibble value e (e % 8 < 4), the high one
 *     value e (e % 8 >= 4);
 *   LOW 2 bits, "quads": group e / 16, at bits 2 (e % 16 / 4);
 *   LOW 8 bits (Q8_0): group e / 4, the byte;
 *   HIGH bits, the code's bits above the low ones: BITS, one bit, group e / 32 at bit
 *     e % 32 / 4 (a 16-bit shift brings any bit of every byte to the one its low part
 *     lacks); QUAD, two bits, as the quads; MASK (Q5_0's, in the AVX-512 build), group
 *     e / 4 of 8 bytes: bit 4c + i of its 64.
 * Sub-block scales: PAIRS [subs / 2][16][2] (int8): at sc + 32 (j / 2) + 2c + j % 2, the
 * scales of sub-blocks 2p and 2p + 1 in one 16-bit pair (so one vpmaddwd weighs a row's two
 * sub-block sums); NIBBLES: as PAIRS, sc in the low nibble and mn in the high one (Q2_K's);
 * K6 (Q4_K's and Q5_K's 6-bit scales and mins, 12 bytes a column, as many as the file's):
 * their low 4 bits as NIBBLES at sc, their top 2 bits at top, sc's at bits 0-1 and mn's at
 * bits 2-3 of a nibble of byte top + 32 (j / 4) + 2c + j % 2, the low nibble for sub-blocks
 * 4q + h, the high one for 4q + 2 + h (a pair of sub-blocks reads one 16-bit pair there as
 * at sc); S6 (Q3_K's and IQ4_XS's signed 6-bit scales, as 0..63 for -32..31, as many bytes
 * as the file's): their low 4 bits in nibbles as K6's top bits (at sc), their top 2 bits at
 * bits 2 (j / 2 % 4) of byte top + 32 (j / 8) + 2c + j % 2. Mins: NIBBLES; K6; ONE (mn = -1:
 * Q4_1, Q5_1, whose dm is m). So a panel holds the file's bytes, rearranged. */
enum { SC_ONE, SC_PAIRS, SC_NIBBLES, SC_K6, SC_S6 };
enum { MN_NONE, MN_NIBBLES, MN_ONE, MN_K6 };
enum { HI_NONE, HI_BITS, HI_QUAD, HI_MASK };

typedef struct {
    short values, width;         /* values a block, a sub-block */
    short gguf_bytes, bytes;     /* a GGUF block, a panel-block */
    short dm;                    /* offset of dm [16] (0: none) */
    short sc, sc_form, top;      /* the scales; K6's and S6's top bits at top */
    short mn_form;               /* the mins: where a type has them (MN_*) */
    short lo, lo_bits, hi, hi_form;
    short offset, table;         /* v(code) = code - offset, or KVALUES[code] where table */
} layout_t;

#if QG_AVX512 /* its Q5_0 kernel reads the fifth bits as byte masks */
#define Q5_0_HIGH HI_MASK
#else /* the others shift each to its place */
#define Q5_0_HIGH HI_BITS
#endif

/* values, width, gguf bytes, bytes, dm, sc, form, top, mins, lo, bits, hi, form, offset, table */
static const layout_t LAYOUTS[T_COUNT] = {
    [T_Q4_0] = {32, 32, 18, 288, 0, 0, SC_ONE, 0, MN_NONE, 32, 4, 0, HI_NONE, 8, 0},
    [T_Q4_1] = {32, 32, 20, 320, 32, 0, SC_ONE, 0, MN_ONE, 64, 4, 0, HI_NONE, 0, 0},
    [T_Q5_0] = {32, 32, 22, 352, 0, 0, SC_ONE, 0, MN_NONE, 32, 4, 288, Q5_0_HIGH, 16, 0},
    [T_Q5_1] = {32, 32, 24, 384, 32, 0, SC_ONE, 0, MN_ONE, 64, 4, 320, HI_BITS, 0, 0},
    [T_Q8_0] = {32, 32, 34, 544, 0, 0, SC_ONE, 0, MN_NONE, 32, 8, 0, HI_NONE, 128, 0},
    [T_IQ4_NL] = {32, 32, 18, 288, 0, 0, SC_ONE, 0, MN_NONE, 32, 4, 0, HI_NONE, 0, 1},
    [T_Q2_K] = {256, 16, 84, 1344, 32, 64, SC_NIBBLES, 0, MN_NIBBLES, 320, 2, 0, HI_NONE, 0, 0},
    [T_Q3_K] = {256, 16, 110, 1760, 0, 32, SC_S6, 160, MN_NONE, 224, 2, 1248, HI_BITS, 4, 0},
    [T_Q4_K] = {256, 32, 144, 2304, 32, 64, SC_K6, 192, MN_K6, 256, 4, 0, HI_NONE, 0, 0},
    [T_Q5_K] = {256, 32, 176, 2816, 32, 64, SC_K6, 192, MN_K6, 256, 4, 2304, HI_BITS, 0, 0},
    [T_Q6_K] = {256, 16, 210, 3360, 0, 32, SC_PAIRS, 0, MN_NONE, 288, 4, 2336, HI_QUAD, 32, 0},
    [T_IQ4_XS] = {256, 32, 136, 2176, 0, 32, SC_S6, 96, MN_NONE, 128, 4, 0, HI_NONE, 0, 1},
};

/* the layout of a kernel type with blocks; NULL for any other */
static const layout_t *layout_of(int type) {
    return type >= 0 && type < T_COUNT && LAYOUTS[type].bytes ? &LAYOUTS[type] : NULL;
}

/* one GGUF block in the header's form (code[e] for e < the type's values) */
typedef struct {
    uint8_t code[256];
    int16_t sc[16], mn[16];
    uint16_t d, dm;
} block_t;

static uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do {
                man <<= 1;
                ++e;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins */
static void unpack_scales_k(const uint8_t *s, block_t *u) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            u->sc[j] = s[j] & 63;
            u->mn[j] = s[j + 4] & 63;
        } else {
            u->sc[j] = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
            u->mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

/* code[n k + l] |= field k of byte src[l] (fields of `width` bits from bit 0), shifted to bit
 * `to`, for l < n, k < count: gguf's packing of quants, a run of n bytes a field at a time */
static void unpack_fields(const uint8_t *src, int n, int count, int width, int to, uint8_t *code) {
    for (int k = 0; k < count; ++k)
        for (int l = 0; l < n; ++l) code[n * k + l] |= (uint8_t)(((src[l] >> (width * k)) & ((1 << width) - 1)) << to);
}

/* One GGUF block of `type` (a kernel type with blocks) into u: gguf's formats */
static void unpack_gguf(int type, const uint8_t *blk, block_t *u) {
    memset(u->code, 0, (size_t)LAYOUTS[type].values);
    memset(u->sc, 0, sizeof(u->sc));
    memset(u->mn, 0, sizeof(u->mn));
    u->dm = 0;
    u->d = read_u16(blk);
    u->sc[0] = 1;
    switch (type) {
    case T_Q4_0: unpack_fields(blk + 2, 16, 2, 4, 0, u->code); break; /* nibbles: 0..15, 16..31 */
    case T_IQ4_NL: unpack_fields(blk + 2, 16, 2, 4, 0, u->code); break;
    case T_Q4_1:
        u->dm = read_u16(blk + 2), u->mn[0] = -1;
        unpack_fields(blk + 4, 16, 2, 4, 0, u->code);
        break;
    case T_Q5_0:
    case T_Q5_1: {
        const int at = type == T_Q5_1 ? 4 : 2; /* the fifth bits' 4 bytes, then 16 of nibbles */
        if (type == T_Q5_1) u->dm = read_u16(blk + 2), u->mn[0] = -1;
        unpack_fields(blk + at + 4, 16, 2, 4, 0, u->code);
        for (int i = 0; i < 32; ++i) u->code[i] |= ((blk[at + i / 8] >> (i % 8)) & 1) << 4;
        break;
    }
    case T_Q8_0:
        for (int i = 0; i < 32; ++i) u->code[i] = blk[2 + i] ^ 0x80; /* int8 w as w + 128 */
        break;
    case T_Q2_K: /* scales[16] (scale | min << 4), qs[64], d, dmin */
        u->d = read_u16(blk + 80), u->dm = read_u16(blk + 82);
        for (int j = 0; j < 16; ++j) u->sc[j] = blk[j] & 0xf, u->mn[j] = blk[j] >> 4;
        for (int h = 0; h < 2; ++h) unpack_fields(blk + 16 + 32 * h, 32, 4, 2, 0, u->code + 128 * h);
        break;
    case T_Q3_K: { /* hmask[32], qs[64], scales[12] (6 bits each, less 32), d */
        const uint8_t *s = blk + 96;
        u->d = read_u16(blk + 108);
        for (int j = 0; j < 16; ++j)
            u->sc[j] = (int16_t)((((j < 8 ? s[j] : s[j - 8] >> 4) & 0xf) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        for (int h = 0; h < 2; ++h) unpack_fields(blk + 32 + 32 * h, 32, 4, 2, 0, u->code + 128 * h);
        unpack_fields(blk, 32, 8, 1, 2, u->code); /* value 32k + l: bit k of hmask[l] */
        break;
    }
    case T_Q4_K:
    case T_Q5_K: { /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128] */
        const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
        u->dm = read_u16(blk + 2);
        unpack_scales_k(blk + 4, u);
        for (int c = 0; c < 4; ++c) unpack_fields(qs + 32 * c, 32, 2, 4, 0, u->code + 64 * c);
        if (type == T_Q5_K) unpack_fields(blk + 16, 32, 8, 1, 4, u->code); /* value 32k + l: bit k of qh[l] */
        break;
    }
    case T_Q6_K: /* ql[128], qh[64], scales[16] (int8), d */
        u->d = read_u16(blk + 208);
        for (int j = 0; j < 16; ++j) u->sc[j] = (int8_t)blk[192 + j];
        for (int h = 0; h < 2; ++h) { /* each half: 64 bytes of nibbles, 32 of 2-bit tops */
            unpack_fields(blk + 64 * h, 64, 2, 4, 0, u->code + 128 * h);
            unpack_fields(blk + 128 + 32 * h, 32, 4, 2, 4, u->code + 128 * h);
        }
        break;
    case T_IQ4_XS: { /* d, scales_h (u16), scales_l[4], qs[128] */
        const uint16_t sh = read_u16(blk + 2);
        for (int j = 0; j < 8; ++j)
            u->sc[j] = (int16_t)((((blk[4 + j / 2] >> (4 * (j % 2))) & 0xf) | (((sh >> (2 * j)) & 3) << 4)) - 32);
        for (int j = 0; j < 8; ++j) unpack_fields(blk + 8 + 16 * j, 16, 2, 4, 0, u->code + 32 * j);
        break;
    }
    default: break;
    }
}

#define AIB static inline __attribute__((always_inline))

/* byte offsets inside a part (see the layout comment) of column c's value e, its bit shift */
AIB long lo_at(int bits, int c, int e, int *shift) {
    *shift = bits == 4 ? 4 * (e % 8 / 4) : bits == 2 ? 2 * (e % 16 / 4) : 0;
    return 64 * (e / (bits == 4 ? 8 : bits == 2 ? 16 : 4)) + 4 * c + e % 4;
}

AIB long hi_at(int form, int c, int e, int *shift) {
    const int i = 4 * c + e % 4;
    if (form == HI_MASK) return *shift = i % 8, 8 * (e / 4) + i / 8;
    if (form == HI_QUAD) return *shift = 2 * (e % 16 / 4), 64 * (e / 16) + i;
    return *shift = e % 32 / 4, 64 * (e / 32) + i;
}

AIB long pair_at(int c, int j) { return 32 * (j / 2) + 2 * c + j % 2; }

/* K6's byte (from top) of column c's sub-block j's top bits, and their nibble's shift; S6's
 * byte (from sc) of its low bits, the same */
AIB long k6_top_at(int c, int j, int *shift) {
    *shift = 4 * (j / 2 % 2);
    return 32 * (j / 4) + 2 * c + j % 2;
}

/* S6's byte (from top) of column c's sub-block j's top 2 bits, and their shift */
AIB long s6_top_at(int c, int j, int *shift) {
    *shift = 2 * (j / 2 % 4);
    return 32 * (j / 8) + 2 * c + j % 2;
}

/* codes q[c][e] (16 columns, `values` each) into their parts: the low `bits` of each at
 * low, the bits above them at high in `form` (the layout comment); each byte composed from
 * its values (packing runs once a load, over every weight of the model) */
AIB void pack_codes(const uint8_t q[PANEL][256], int values, int bits, int form, uint8_t *low,
                    uint8_t *high) {
    const int per = bits == 8 ? 1 : 8 / bits, mask = bits == 8 ? 0xff : (1 << bits) - 1;
    for (int g = 0; g < values / (4 * per); ++g) /* a group: 4 per values of each column */
        for (int c = 0; c < PANEL; ++c)
            for (int i = 0; i < 4; ++i) {
                int byte = 0;
                for (int k = 0; k < per; ++k) byte |= (q[c][4 * per * g + 4 * k + i] & mask) << (bits * k);
                low[64 * g + 4 * c + i] = (uint8_t)byte;
            }
    if (form == HI_BITS || form == HI_QUAD) {
        const int hb = form == HI_BITS ? 1 : 2, hper = 8 / hb;
        for (int g = 0; g < values / (4 * hper); ++g)
            for (int c = 0; c < PANEL; ++c)
                for (int i = 0; i < 4; ++i) {
                    int byte = 0;
                    for (int k = 0; k < hper; ++k) byte |= (q[c][4 * hper * g + 4 * k + i] >> bits) << (hb * k);
                    high[64 * g + 4 * c + i] = (uint8_t)byte;
                }
    }
    if (form == HI_MASK) /* group g: 8 bytes, bit 4c + i that of value 4g + i of column c */
        for (int g = 0; g < values / 4; ++g)
            for (int b = 0; b < 8; ++b) {
                int byte = 0;
                for (int bit = 0; bit < 8; ++bit) byte |= (q[(8 * b + bit) / 4][4 * g + bit % 4] >> bits) << bit;
                high[8 * g + b] = (uint8_t)byte;
            }
}

/* The 16 GGUF blocks blk[c] (NULL: a padding column, all zero) of `type` into one
 * panel-block at out (L->bytes); `type` a constant in each of pack_block's calls, so the
 * layout's fields fold into the loops (read from the table, they made packing ~30x slower) */
AIB void pack_block_typed(const int type, const uint8_t *const blk[PANEL], uint8_t *out) {
    const layout_t *L = &LAYOUTS[type];
    const int subs = L->values / L->width;
    uint8_t q[PANEL][256];
    memset(out, 0, (size_t)L->bytes);
    for (int c = 0; c < PANEL; ++c) {
        if (!blk[c]) {
            memset(q[c], 0, sizeof(q[c]));
            continue;
        }
        block_t u;
        unpack_gguf(type, blk[c], &u);
        memcpy(q[c], u.code, sizeof(q[c]));
        memcpy(out + 2 * c, &u.d, 2);
        if (L->dm) memcpy(out + L->dm + 2 * c, &u.dm, 2);
        for (int j = 0; j < subs; ++j) {
            if (L->sc_form == SC_PAIRS) out[L->sc + pair_at(c, j)] = (uint8_t)u.sc[j];
            if (L->sc_form == SC_NIBBLES) out[L->sc + pair_at(c, j)] = (uint8_t)(u.sc[j] | (u.mn[j] << 4));
            if (L->sc_form == SC_K6) {
                int shift;
                out[L->sc + pair_at(c, j)] = (uint8_t)((u.sc[j] & 0xf) | ((u.mn[j] & 0xf) << 4));
                out[L->top + k6_top_at(c, j, &shift)] |= (uint8_t)(((u.sc[j] >> 4) | ((u.mn[j] >> 4) << 2)) << shift);
            }
            if (L->sc_form == SC_S6) {
                const int code = u.sc[j] + 32; /* -32..31 -> 0..63 */
                int shift;
                const long at = k6_top_at(c, j, &shift);
                out[L->sc + at] |= (uint8_t)((code & 0xf) << shift);
                out[L->top + s6_top_at(c, j, &shift)] |= (uint8_t)((code >> 4) << shift);
            }
        }
    }
    pack_codes(q, L->values, L->lo_bits, L->hi_form, out + L->lo, out + L->hi);
}

static void pack_block(int type, const uint8_t *const blk[PANEL], uint8_t *out) {
#define CASE(T) \
    case T_##T: pack_block_typed(T_##T, blk, out); break;
    switch (type) {
        CASE(Q4_K) CASE(Q5_K) CASE(Q6_K) CASE(Q3_K) CASE(Q2_K) CASE(IQ4_XS)
        CASE(Q8_0) CASE(Q5_0) CASE(Q5_1) CASE(Q4_0) CASE(Q4_1) CASE(IQ4_NL)
    default: break;
    }
#undef CASE
}

/* A panel-block, decoded: value e of column c (v(code)), sub-block j's scale and min, and
 * the float scales. What the portable path multiplies. */
typedef struct {
    int8_t v[256][PANEL];
    int16_t sc[16][PANEL], mn[16][PANEL];
    float d[PANEL], dm[PANEL];
} panel_block_t;

/* pack_block's inverse: a panel-block of `type` at blk into P */
QG_UNUSED_IN_SIMD static void panel_decode(int type, const uint8_t *blk, panel_block_t *P) {
    const layout_t *L = layout_of(type);
    const int subs = L->values / L->width;
    for (int c = 0; c < PANEL; ++c) {
        P->d[c] = half_to_float(read_u16(blk + 2 * c));
        P->dm[c] = L->dm ? half_to_float(read_u16(blk + L->dm + 2 * c)) : 0.0f;
        for (int j = 0; j < subs; ++j) {
            const long p = pair_at(c, j);
            const int form = L->sc_form;
            int shift = 0, s6_shift = 0;
            const int top = form == SC_K6 ? blk[L->top + k6_top_at(c, j, &shift)] >> shift : 0;
            const long s6_low = k6_top_at(c, j, &s6_shift);
            const int s6_low_bits = (blk[L->sc + s6_low] >> s6_shift) & 0xf;
            const int s6_top = (blk[L->top + s6_top_at(c, j, &s6_shift)] >> s6_shift) & 3;
            P->sc[j][c] = form == SC_PAIRS ? (int8_t)blk[L->sc + p]
                          : form == SC_NIBBLES ? blk[L->sc + p] & 0xf
                          : form == SC_K6 ? (blk[L->sc + p] & 0xf) | ((top & 3) << 4)
                          : form == SC_S6 ? (s6_low_bits | (s6_top << 4)) - 32 : 1;
            P->mn[j][c] = L->mn_form == MN_NIBBLES ? blk[L->sc + p] >> 4
                          : L->mn_form == MN_K6 ? (blk[L->sc + p] >> 4) | ((top >> 2 & 3) << 4)
                          : L->mn_form == MN_ONE ? -1 : 0;
        }
    }
    for (int e = 0; e < L->values; ++e)
        for (int c = 0; c < PANEL; ++c) {
            int shift;
            const long at = lo_at(L->lo_bits, c, e, &shift);
            int code = L->lo_bits == 8 ? blk[L->lo + at] : (blk[L->lo + at] >> shift) & ((1 << L->lo_bits) - 1);
            if (L->hi_form != HI_NONE) {
                const long hat = hi_at(L->hi_form, c, e, &shift);
                code |= ((blk[L->hi + hat] >> shift) & (L->hi_form == HI_QUAD ? 3 : 1)) << L->lo_bits;
            }
            P->v[e][c] = (int8_t)(L->table ? KVALUES[code] : code - L->offset);
        }
}
