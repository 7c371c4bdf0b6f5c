/* nanoBragg's Poisson noise image, draw for draw.

   ran1, gaussdev, poidev and gammln are nanoBragg.c's (Numerical Recipes), translated with the same
   types (single precision where the C has `float`) and expressions, so that built with the same compiler
   and flags they round alike. What the C keeps in static variables (ran1's shuffle table, gaussdev's
   spare deviate, poidev's cached mean) lives in `NoiseState`, passed explicitly. The loop is nanoBragg's
   noise loop: slow rows, then fast pixels, pixels outside the ROI skipped without a draw.
   Built and loaded by nbsim/detector/native.py. */

#include <math.h>

#define IA 16807
#define IM 2147483647
#define AM (1.0/IM)
#define IQ 127773
#define IR 2836
#define NTAB 32
#define NDIV (1+(IM-1)/NTAB)
#define EPS 1.2e-7
#define RNMX (1.0-EPS)

typedef struct {
    long iy;
    long iv[NTAB];
    int iset;
    float gset;
    float sq, alxm, g, oldm;
} NoiseState;

static float ran1(long *idum, NoiseState *s)
{
    int j;
    long k;
    float temp;

    if (*idum <= 0 || !s->iy) {
        if (-(*idum) < 1) *idum = 1;
        else *idum = -(*idum);
        for (j = NTAB + 7; j >= 0; j--) {
            k = (*idum) / IQ;
            *idum = IA * (*idum - k * IQ) - IR * k;
            if (*idum < 0) *idum += IM;
            if (j < NTAB) s->iv[j] = *idum;
        }
        s->iy = s->iv[0];
    }
    k = (*idum) / IQ;
    *idum = IA * (*idum - k * IQ) - IR * k;
    if (*idum < 0) *idum += IM;
    j = s->iy / NDIV;
    s->iy = s->iv[j];
    s->iv[j] = *idum;
    if ((temp = AM * s->iy) > RNMX) return RNMX;
    else return temp;
}

static float gaussdev(long *idum, NoiseState *s)
{
    float fac, rsq, v1, v2;

    if (s->iset == 0) {
        do {
            v1 = 2.0 * ran1(idum, s) - 1.0;
            v2 = 2.0 * ran1(idum, s) - 1.0;
            rsq = v1 * v1 + v2 * v2;
        } while (rsq >= 1.0 || rsq == 0);
        fac = sqrt(-2.0 * log(rsq) / rsq);
        s->gset = v1 * fac;
        s->iset = 1;
        return v2 * fac;
    }
    s->iset = 0;
    return s->gset;
}

static float gammln(float xx)
{
    double x, y, tmp, ser;
    static const double cof[6] = {76.18009172947146, -86.50532032941677, 24.01409824083091,
                                  -1.231739572450155, 0.1208650973866179e-2, -0.5395239384953e-5};
    int j;

    y = x = xx;
    tmp = x + 5.5;
    tmp -= (x + 0.5) * log(tmp);
    ser = 1.000000000190015;
    for (j = 0; j <= 5; ++j) ser += cof[j] / ++y;
    return -tmp + log(2.5066282746310005 * ser / x);
}

static float poidev(float xm, long *idum, NoiseState *s)
{
    float em, t, y;

    if (xm > 1.0e6) {
        return xm + sqrt(xm) * gaussdev(idum, s);
    }
    if (xm < 12.0) {
        if (xm != s->oldm) {
            s->oldm = xm;
            s->g = exp(-xm);
        }
        em = -1;
        t = 1.0;
        do {
            ++em;
            t *= ran1(idum, s);
        } while (t > s->g);
    } else {
        if (xm != s->oldm) {
            s->oldm = xm;
            s->sq = sqrt(2.0 * xm);
            s->alxm = log(xm);
            s->g = xm * s->alxm - gammln(xm + 1.0);
        }
        do {
            do {
                y = tan(M_PI * ran1(idum, s));
                em = s->sq * y + xm;
            } while (em < 0.0);
            em = floor(em);
            t = 0.9 * (1.0 + y * y) * exp(em * s->alxm - gammln(em + 1.0) - s->g);
        } while (ran1(idum, s) > t);
    }
    return em;
}

/* Poisson photon counts of `image` (spixels rows of fpixels) inside the ROI [xmin, xmax] x [ymin, ymax],
   written to `photons` (pixels outside are left as they are). `seed` is nanoBragg's noise seed (minus the
   -seed value); `table` holds ran1's iy then its NTAB shuffle entries, in and out (all zero: a fresh
   process). Returns the sum of the counts, added in pixel order in double precision as the C does, and
   writes their maximum to `maximum` (0 for an empty ROI). */
double nanobragg_noise(const float *image, double *photons, long fpixels, long spixels, long xmin, long xmax,
                       long ymin, long ymax, long seed, long *table, double *maximum)
{
    NoiseState s;
    long fpixel, spixel, imgidx = 0, j;
    double sum = 0.0, test, largest = 0.0;
    int first = 1;

    s.iy = table[0];
    for (j = 0; j < NTAB; ++j) s.iv[j] = table[1 + j];
    s.iset = 0;
    s.gset = 0.0f;
    s.sq = s.alxm = s.g = 0.0f;
    s.oldm = -1.0f;
    for (spixel = 0; spixel < spixels; ++spixel) {
        for (fpixel = 0; fpixel < fpixels; ++fpixel) {
            if (fpixel < xmin || fpixel > xmax || spixel < ymin || spixel > ymax) {
                ++imgidx;
                continue;
            }
            test = poidev(image[imgidx], &seed, &s);
            sum += test;
            photons[imgidx] = test;
            if (first || test > largest) largest = test;
            first = 0;
            ++imgidx;
        }
    }
    table[0] = s.iy;
    for (j = 0; j < NTAB; ++j) table[1 + j] = s.iv[j];
    *maximum = largest;
    return sum;
}
