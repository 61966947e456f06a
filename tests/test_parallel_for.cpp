// locks::parallel_for: every index once, and a body's exception rethrown after the loop (an
// exception leaving an OpenMP region would end the process).
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "locks/parallel_for.h"

namespace locks {
namespace {

TEST(ParallelFor, RunsEveryIndexOnceWithEitherSchedule) {
  for (int chunk : {0, 1, 4})
    for (int n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(size_t(n) + 1);
      parallel_for(
          n, [&](int i) { hits[size_t(i)].fetch_add(1); }, 2, chunk);
      for (int i = 0; i < n; ++i) EXPECT_EQ(hits[size_t(i)].load(), 1) << "n " << n << " chunk " << chunk << " i " << i;
      EXPECT_EQ(hits[size_t(n)].load(), 0);
    }
}

TEST(ParallelFor, RethrowsTheBodysExceptionAfterTheLoop) {
  for (int chunk : {0, 4}) {
    std::atomic<int> ran{0};
    try {
      parallel_for(
          1000,
          [&](int i) {
            ran.fetch_add(1);
            if (i == 500) throw std::invalid_argument("index 500");
          },
          2, chunk);
      FAIL() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_STREQ(e.what(), "index 500");
    }
    EXPECT_GE(ran.load(), 1);
    EXPECT_LE(ran.load(), 1000);
  }
  // Serial (below min_parallel): the same.
  EXPECT_THROW(parallel_for(
                   1, [](int) { throw std::runtime_error("one"); }, 2),
               std::runtime_error);
}

}  // namespace
}  // namespace locks
