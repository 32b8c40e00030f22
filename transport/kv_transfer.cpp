#include "transport/kv_transfer.h"

#include <algorithm>
#include <unordered_set>

namespace pdserve {

StatusOr<std::vector<BlockRun>> CoalesceBlockRuns(std::vector<BlockCopy> copies,
                                                  size_t local_blocks, size_t remote_blocks) {
  std::unordered_set<BlockId> targets;
  targets.reserve(copies.size());
  for (const auto& c : copies) {
    if (c.local >= local_blocks) {
      return Status::InvalidArgument("local block " + std::to_string(c.local) +
                                     " is out of range (pool has " + std::to_string(local_blocks) +
                                     " blocks)");
    }
    if (c.remote >= remote_blocks) {
      return Status::InvalidArgument("remote block " + std::to_string(c.remote) +
                                     " is out of range (peer pool has " +
                                     std::to_string(remote_blocks) + " blocks)");
    }
    if (!targets.insert(c.remote).second) {
      return Status::InvalidArgument("remote block " + std::to_string(c.remote) +
                                     " is targeted more than once");
    }
  }
  // A run lies on one diagonal (remote - local constant) with consecutive
  // local ids, so group by diagonal first: sorting by local id alone would
  // split runs whenever a local block is copied to several targets.
  auto diagonal = [](const BlockCopy& c) {
    return static_cast<int64_t>(c.remote) - static_cast<int64_t>(c.local);
  };
  std::sort(copies.begin(), copies.end(), [&](const BlockCopy& a, const BlockCopy& b) {
    return diagonal(a) != diagonal(b) ? diagonal(a) < diagonal(b) : a.local < b.local;
  });
  std::vector<BlockRun> runs;
  for (const auto& c : copies) {
    if (!runs.empty()) {
      BlockRun& last = runs.back();
      if (c.local == last.local + last.count && c.remote == last.remote + last.count) {
        ++last.count;
        continue;
      }
    }
    runs.push_back({c.local, c.remote, 1});
  }
  // Local order: sequential reads of the source pool.
  std::sort(runs.begin(), runs.end(), [](const BlockRun& a, const BlockRun& b) {
    return a.local != b.local ? a.local < b.local : a.remote < b.remote;
  });
  return runs;
}

StatusOr<KvTransfer::Connection> KvTransfer::ConnectSlices(std::string_view,
                                                           std::vector<BlockSlice>) {
  return Status::Unsupported("the " + std::string(backend()) +
                             " KV transfer moves whole blocks only: a hand-off between workers of "
                             "different tensor-parallel sizes needs ucx or nccl");
}

StatusOr<PeerId> KvTransfer::AcceptSlices(std::string_view) {
  return Status::Unsupported("the " + std::string(backend()) +
                             " KV transfer moves whole blocks only: a hand-off between workers of "
                             "different tensor-parallel sizes needs ucx or nccl");
}

}  // namespace pdserve
