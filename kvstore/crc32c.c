#include "kvstore/crc32c.h"

#include "kvstore/crc32c_math.h"

#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#include <wmmintrin.h>
#define KV_CRC_HAVE_X86 1
#endif

/* crc_table[n] is the CRC register after shifting the byte n through it eight times; generated
 * once from the polynomial and pasted, so the library keeps no mutable state to initialize. */
static const uint32_t crc_table[256] = {
    0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu,
    0x26a1e7e8u, 0xd4ca64ebu, 0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu,
    0x4d43cfd0u, 0xbf284cd3u, 0xac78bf27u, 0x5e133c24u, 0x105ec76fu, 0xe235446cu,
    0xf165b798u, 0x030e349bu, 0xd7c45070u, 0x25afd373u, 0x36ff2087u, 0xc494a384u,
    0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u, 0x5d1d08bfu, 0xaf768bbcu,
    0xbc267848u, 0x4e4dfb4bu, 0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u, 0x33ed7d2au,
    0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u, 0xaa64d611u, 0x580f5512u,
    0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau,
    0x30e349b1u, 0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu,
    0x1642ae59u, 0xe4292d5au, 0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au,
    0x7da08661u, 0x8fcb0562u, 0x9c9bf696u, 0x6ef07595u, 0x417b1dbcu, 0xb3109ebfu,
    0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u, 0x67dafa54u, 0x95b17957u,
    0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu, 0xfe53516fu,
    0xed03a29bu, 0x1f682198u, 0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u,
    0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u, 0xdbfc821cu, 0x2997011fu,
    0x3ac7f2ebu, 0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u,
    0x61c69362u, 0x93ad1061u, 0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu,
    0x4767748au, 0xb50cf789u, 0xeb1fcbadu, 0x197448aeu, 0x0a24bb5au, 0xf84f3859u,
    0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u, 0x7198540du, 0x83f3d70eu,
    0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u, 0xa55230e6u,
    0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu,
    0xdde0eb2au, 0x2f8b6829u, 0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu,
    0x456cac67u, 0xb7072f64u, 0xa457dc90u, 0x563c5f93u, 0x082f63b7u, 0xfa44e0b4u,
    0xe9141340u, 0x1b7f9043u, 0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu,
    0x92a8fc17u, 0x60c37f14u, 0x73938ce0u, 0x81f80fe3u, 0x55326b08u, 0xa759e80bu,
    0xb4091bffu, 0x466298fcu, 0x1871a4d8u, 0xea1a27dbu, 0xf94ad42fu, 0x0b21572cu,
    0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u, 0xa24bb5a6u, 0x502036a5u,
    0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
    0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u,
    0x0e330a81u, 0xfc588982u, 0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du,
    0x758fe5d6u, 0x87e466d5u, 0x94b49521u, 0x66df1622u, 0x38cc2a06u, 0xcaa7a905u,
    0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u, 0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu,
    0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u, 0x0417b1dbu, 0xf67c32d8u,
    0xe52cc12cu, 0x1747422fu, 0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu, 0x5a048dffu,
    0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u, 0xd3d3e1abu, 0x21b862a8u,
    0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u,
    0x590ab964u, 0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u,
    0x7fab5e8cu, 0x8dc0dd8fu, 0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu,
    0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u, 0x37faccf1u, 0x69e9f0d5u, 0x9b8273d6u,
    0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u, 0x4f48173du, 0xbd23943eu,
    0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au, 0xc69f7b69u,
    0xd5cf889du, 0x27a40b9eu, 0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu,
    0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u,
};

uint32_t kv_crc32c_sw(uint32_t crc, const void *data, size_t n)
{
    const uint8_t *p = data;
    uint32_t c = ~crc;
    for (size_t i = 0; i < n; i++)
        c = crc_table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
    return ~c;
}

#ifdef KV_CRC_HAVE_X86
/* Polynomial arithmetic used below, in the reflected convention of the crc32 instruction: a 32-bit
 * register value r stands for R(x) = sum r_i x^(31-i) (bit 31 is x^0), a 64-bit data word w for
 * W(x) = sum w_i x^(63-i), and _mm_crc32_u64(r, w) = (R x^64 + W x^32) mod P. */

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);   /* the instruction consumes the word little-endian, as x86 loads it */
    return w;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *data, size_t n)
{
    const uint8_t *p = data;
    uint64_t c = ~crc;
    while (n >= 8) {
        c = _mm_crc32_u64(c, load64(p));
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--)
        c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}

/* Three-stream path. A block of 3*len bytes D0 D1 D2 is fed as three independent crc32 chains
 * (the instruction has a latency of 3 cycles but a throughput of 1 per cycle): stream 0 starts
 * from the running register, streams 1 and 2 from 0. The CRC register is linear in its starting
 * value, so feeding D0 D1 D2 from r gives
 *     shift(c0, 2*len) ^ shift(c1, len) ^ c2,
 * where shift(c, m) = C x^(8m) mod P is the register after feeding m zero bytes from c.
 *
 * shift with a constant K = x^(8m-33) mod P: the carry-less product of the 32-bit values c and K
 * (63 bits, bit k = xor of c_i K_j with i+j = k) read as a data word is W = x C K, so
 * _mm_crc32_u64(0, clmul(c, K)) = x C K x^32 = C x^(8m) mod P.
 *
 * The constants are x^e mod P, produced by starting from x^0 (0x80000000) and multiplying by x
 * e times (r = r & 1 ? (r >> 1) ^ 0x82F63B78 : r >> 1); tests/test_kvstore_crc.c checks the
 * result end to end against a bitwise reference on lengths that cross both block sizes. */
#define CRC3_LONG 8192u                 /* bytes per stream in a long block (24 KiB a block) */
#define CRC3_LONG_K1 0x54a86326u        /* x^(8*8192-33) mod P */
#define CRC3_LONG_K2 0x1dc403ccu        /* x^(16*8192-33) mod P */
#define CRC3_SHORT 256u                 /* bytes per stream in a short block (768 bytes a block) */
#define CRC3_SHORT_K1 0xb9e02b86u       /* x^(8*256-33) mod P */
#define CRC3_SHORT_K2 0xdd7e3b0cu       /* x^(16*256-33) mod P */

__attribute__((target("sse4.2,pclmul"))) static inline uint64_t crc_shift(uint64_t c, uint32_t k)
{
    __m128i prod = _mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)c),
                                        _mm_cvtsi32_si128((int)k), 0x00);
    return _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(prod));
}

/* Feeds one block of 3*len bytes (len a positive multiple of 8) into register c. */
__attribute__((target("sse4.2,pclmul"))) static inline uint64_t
crc3_block(uint64_t c, const uint8_t *p, size_t len, uint32_t k1, uint32_t k2)
{
    uint64_t c0 = c, c1 = 0, c2 = 0;
    for (size_t i = 0; i < len; i += 8) {
        c0 = _mm_crc32_u64(c0, load64(p + i));
        c1 = _mm_crc32_u64(c1, load64(p + len + i));
        c2 = _mm_crc32_u64(c2, load64(p + 2 * len + i));
    }
    return crc_shift(c0, k2) ^ crc_shift(c1, k1) ^ c2;
}

__attribute__((target("sse4.2,pclmul"))) static uint32_t crc32c_hw3(uint32_t crc, const void *data,
                                                                   size_t n)
{
    const uint8_t *p = data;
    uint64_t c = ~crc;
    /* Align the loads to 8 bytes; only reached with n >= 3 * CRC3_SHORT, so n stays large. */
    while (((uintptr_t)p & 7u) != 0) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    while (n >= 3 * CRC3_LONG) {
        c = crc3_block(c, p, CRC3_LONG, CRC3_LONG_K1, CRC3_LONG_K2);
        p += 3 * CRC3_LONG;
        n -= 3 * CRC3_LONG;
    }
    while (n >= 3 * CRC3_SHORT) {
        c = crc3_block(c, p, CRC3_SHORT, CRC3_SHORT_K1, CRC3_SHORT_K2);
        p += 3 * CRC3_SHORT;
        n -= 3 * CRC3_SHORT;
    }
    return crc32c_hw(~(uint32_t)c, p, n);   /* the tail, single stream */
}
#endif

uint32_t kv_crc32c(uint32_t crc, const void *data, size_t n)
{
#ifdef KV_CRC_HAVE_X86
    if (__builtin_cpu_supports("sse4.2")) {
        if (n >= 3 * CRC3_SHORT + 7 && __builtin_cpu_supports("pclmul"))
            return crc32c_hw3(crc, data, n);
        return crc32c_hw(crc, data, n);
    }
#endif
    return kv_crc32c_sw(crc, data, n);
}

uint32_t kv_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    return kv_crc32c_combine_op(crc_a, crc_b, kv_crc32c_shift_op(len_b));
}
