// PrepareKernelLoadingFor (kernels/backend_factory.h): CUDA's eager kernel
// loading is asked for exactly when a --devices list puts two ranks on one
// GPU, and overrides a lazy setting then.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kernels/backend_factory.h"

namespace pdserve::kernels {
namespace {

std::string Loading() {
  const char* v = std::getenv("CUDA_MODULE_LOADING");
  return v == nullptr ? "(unset)" : v;
}

TEST(KernelLoadingTest, EagerOnlyWhenAGpuIsNamedTwice) {
  for (const char* distinct : {"", "cpu", "cpu,cpu", "cuda:0", "cuda:0,cuda:1", "cuda,cuda:1",
                               "cuda:0,cpu,cuda:1", "cudax,cudax", "cuda:,cuda:"}) {
    unsetenv("CUDA_MODULE_LOADING");
    PrepareKernelLoadingFor(distinct);
    EXPECT_EQ(Loading(), "(unset)") << distinct;
  }
  for (const char* shared :
       {"cuda:0,cuda:0", "cuda,cuda:0", "cuda:1,cuda:2,cuda:1", "cuda:3,cuda:3,cuda:3,cuda:3"}) {
    unsetenv("CUDA_MODULE_LOADING");
    PrepareKernelLoadingFor(shared);
    EXPECT_EQ(Loading(), "EAGER") << shared;
  }
}

TEST(KernelLoadingTest, ALazySettingGivesWayForASharedGpu) {
  setenv("CUDA_MODULE_LOADING", "LAZY", 1);
  PrepareKernelLoadingFor("cuda:0,cuda:1");
  EXPECT_EQ(Loading(), "LAZY");  // a GPU each: the user's choice stands
  PrepareKernelLoadingFor("cuda:0,cuda:0");
  EXPECT_EQ(Loading(), "EAGER");
}

}  // namespace
}  // namespace pdserve::kernels
