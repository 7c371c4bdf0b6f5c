/* Philox4x32-10 (Salmon, Moraes, Dror and Shaw, SC'11), the counter-based generator of
   nbsim/detector/philox.py, for the CPU: the same 32-bit words as that module's torch operations
   (tests/test_detector.py checks it), many times faster than them on a processor. */

#include <stdint.h>

static void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    int round;
    for (round = 0; round < 10; ++round) {
        uint64_t p0, p1;
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        p0 = (uint64_t) 0xD2511F53u * c[0];
        p1 = (uint64_t) 0xCD9E8D57u * c[2];
        c[0] = (uint32_t) (p1 >> 32) ^ c[1] ^ k0;
        c[1] = (uint32_t) p1;
        c[2] = (uint32_t) (p0 >> 32) ^ c[3] ^ k1;
        c[3] = (uint32_t) p0;
    }
}

/* For each of the n elements `index[i]`: word index[i] % 4 of Philox4x32-10 of the counter
   (block lo, block hi, draw, stream), block = index[i] / 4, under the 64-bit key `seed`; as int64. */
void philox_words(uint64_t seed, uint32_t stream, uint32_t draw, const int64_t *index, int64_t n, int64_t *out)
{
    int64_t i, last = -1;
    uint32_t c[4] = {0, 0, 0, 0};
    for (i = 0; i < n; ++i) {
        int64_t block = index[i] >> 2;
        if (block != last) {
            c[0] = (uint32_t) block;
            c[1] = (uint32_t) ((uint64_t) block >> 32);
            c[2] = draw;
            c[3] = stream;
            philox4x32_10(c, (uint32_t) seed, (uint32_t) (seed >> 32));
            last = block;
        }
        out[i] = c[index[i] & 3];
    }
}
