#include "transport/ucx/staging_copier.h"

#include <cstdlib>
#include <cstring>

namespace pdserve::ucx_detail {
namespace {

constexpr size_t kBounceAlignment = 4096;

class HostCopier final : public StagingCopier {
 public:
  std::string_view name() const override { return "memcpy"; }
  StatusOr<void*> AllocBounce(size_t bytes) override {
    const size_t rounded = (bytes + kBounceAlignment - 1) / kBounceAlignment * kBounceAlignment;
    void* p = std::aligned_alloc(kBounceAlignment, rounded);
    if (p == nullptr) {
      return Status::ResourceExhausted("cannot allocate " + std::to_string(bytes) +
                                       " bytes of KV staging buffers");
    }
    return p;
  }
  void FreeBounce(void* p) override { std::free(p); }
  Status Init(size_t /*slots*/) override { return Status::Ok(); }
  Status Start(size_t /*slot*/, const CopySegment* segs, size_t n, bool /*to_pool*/) override {
    for (size_t i = 0; i < n; ++i) std::memcpy(segs[i].dst, segs[i].src, segs[i].bytes);
    return Status::Ok();
  }
  bool Poll(size_t /*slot*/, Status* status) override {
    *status = Status::Ok();
    return true;
  }
  bool asynchronous() const override { return false; }
  void Drain() override {}
};

}  // namespace

std::unique_ptr<StagingCopier> MakeHostCopier() { return std::make_unique<HostCopier>(); }

}  // namespace pdserve::ucx_detail
