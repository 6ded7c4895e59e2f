/* The CPU row copier behind hicache.memory.copier (PageCopier, copy_rows).

   hc_copy_rows moves rows dst[p] + dst_ids[i] * dst_stride <- src[p] + src_ids[i] * src_stride
   for every plane p in one pass. torch has no single op that gathers and scatters at once:
   gather into staging then scatter reads and writes every byte twice and stays near half
   of a contiguous copy on small machines; this loop moves each byte once.

   `streaming` writes with non-temporal stores: a row of a few KiB is too short for
   memcpy to choose them itself, and without them every destination line is first read
   into the cache (read-for-ownership) and later written back, a third of the traffic of
   a transfer larger than the last-level cache. Only x86-64 has them here (SSE2 is part of
   its base ISA); elsewhere the flag is ignored.

   Compiled at install by setup.py into hicache/memory/_copier*.so; when that library is
   missing or was built from other bytes than this file's, load_native_copier()
   (copier.py) compiles it at run time with the system C compiler into ~/.cache/hicache
   (or $HICACHE_CACHE_DIR), under a name derived from this file's bytes. Both compile
   with the same command (hicache/buildcache.py), which defines HC_SOURCE_DIGEST. */

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#ifndef HC_SOURCE_DIGEST
#define HC_SOURCE_DIGEST ""
#endif

/* The digest of the source bytes this library was compiled from: a loader refuses a
   library whose digest is not the one of the copier.c beside it. */
const char *hc_source_digest(void) { return HC_SOURCE_DIGEST; }

typedef struct {
  int64_t num_planes;
  char *const *dst;
  const char *const *src;
  int64_t dst_stride, src_stride, row_nbytes;
  const int64_t *dst_ids, *src_ids;
  int64_t begin, end, streaming;
} hc_job;

static void hc_row(char *d, const char *s, int64_t n, int64_t streaming) {
#if defined(__x86_64__)
  if (streaming && ((uintptr_t)d & 15) == 0) {
    const int64_t bulk = n & ~(int64_t)63;
    for (int64_t o = 0; o < bulk; o += 64) {
      const __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
      const __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
      const __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
      const __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
      _mm_stream_si128((__m128i *)(d + o), a);
      _mm_stream_si128((__m128i *)(d + o + 16), b);
      _mm_stream_si128((__m128i *)(d + o + 32), c);
      _mm_stream_si128((__m128i *)(d + o + 48), e);
    }
    if (bulk < n) memcpy(d + bulk, s + bulk, (size_t)(n - bulk));
    return;
  }
#endif
  (void)streaming;
  memcpy(d, s, (size_t)n);
}

static void *hc_run(void *arg) {
  const hc_job *j = (const hc_job *)arg;
  for (int64_t i = j->begin; i < j->end; ++i) {
    const int64_t d = j->dst_ids[i] * j->dst_stride, s = j->src_ids[i] * j->src_stride;
    for (int64_t p = 0; p < j->num_planes; ++p)
      hc_row(j->dst[p] + d, j->src[p] + s, j->row_nbytes, j->streaming);
  }
#if defined(__x86_64__)
  /* Streaming stores are weakly ordered: make them visible before reporting done. */
  if (j->streaming) _mm_sfence();
#endif
  return 0;
}

int hc_copy_rows(int64_t num_planes, char *const *dst, const char *const *src,
                 int64_t dst_stride, int64_t src_stride, int64_t row_nbytes,
                 const int64_t *dst_ids, const int64_t *src_ids, int64_t num_rows,
                 int64_t num_threads, int64_t streaming) {
  enum { MAX_THREADS = 64 };
  hc_job jobs[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS];
  if (num_threads > num_rows) num_threads = num_rows;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads < 1) num_threads = 1;
  const int64_t per = (num_rows + num_threads - 1) / num_threads;
  for (int64_t t = 0; t < num_threads; ++t) {
    const int64_t b = t * per, e = b + per < num_rows ? b + per : num_rows;
    hc_job job = {num_planes, dst, src, dst_stride, src_stride, row_nbytes,
                  dst_ids, src_ids, b < e ? b : e, e, streaming};
    jobs[t] = job;
  }
  for (int64_t t = 1; t < num_threads; ++t)
    started[t] = pthread_create(&tids[t], 0, hc_run, &jobs[t]) == 0;
  hc_run(&jobs[0]);
  for (int64_t t = 1; t < num_threads; ++t) {
    if (started[t]) pthread_join(tids[t], 0);
    else hc_run(&jobs[t]);
  }
  return 0;
}
