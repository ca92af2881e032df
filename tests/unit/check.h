/* A minimal test harness: CHECK records a failure and goes on; the test's
 * main returns check_summary(), which prints "N passed, N failed". */
#ifndef PS_TESTS_CHECK_H
#define PS_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>

static int check_passed_, check_failed_;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (cond) {                                                              \
      check_passed_++;                                                       \
    } else {                                                                 \
      check_failed_++;                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                        \
  } while (0)

#define CHECK_MSG(cond, ...)                                                 \
  do {                                                                       \
    if (cond) {                                                              \
      check_passed_++;                                                       \
    } else {                                                                 \
      check_failed_++;                                                       \
      fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                          \
      fputc('\n', stderr);                                                   \
    }                                                                        \
  } while (0)

/* |a - b| <= atol + rtol*|b| */
#define CHECK_NEAR(a, b, atol, rtol)                                              \
  do {                                                                            \
    double a_ = (a), b_ = (b);                                                    \
    CHECK_MSG(fabs(a_ - b_) <= (atol) + (rtol)*fabs(b_), "%s = %.9g, %s = %.9g", #a, \
              a_, #b, b_);                                                        \
  } while (0)

#define RUN(test_fn)                          \
  do {                                        \
    int f0_ = check_failed_;                  \
    test_fn();                                \
    fprintf(stderr, "%-40s %s\n", #test_fn,   \
            check_failed_ == f0_ ? "ok" : "FAILED"); \
  } while (0)

static inline int check_summary(void) {
  printf("%d passed, %d failed\n", check_passed_, check_failed_);
  return check_failed_ ? 1 : 0;
}

#endif
