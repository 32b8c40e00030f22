#include "engine/kv_tier_mover.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/logging.h"

namespace pdserve {

namespace {
constexpr auto kFailureLogInterval = std::chrono::seconds(10);
}  // namespace

KvTierMover::KvTierMover(KvTierStore* store, HostBlockBuffers* buffers,
                         std::function<void()> on_ready, int64_t write_bytes_per_second,
                         int64_t max_onload_blocks)
    : store_(store),
      buffers_(buffers),
      on_ready_(std::move(on_ready)),
      write_bytes_per_second_(write_bytes_per_second),
      max_onload_blocks_(static_cast<size_t>(std::max<int64_t>(0, max_onload_blocks))),
      thread_([this] { Run(); }) {
  if (store_->writes_through()) writer_ = std::thread([this] { WriteLoop(); });
}

KvTierMover::~KvTierMover() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_cv_.notify_all();
  thread_.join();
  if (writer_.joinable()) writer_.join();
}

void KvTierMover::NoteFailureLocked(const Status& st) {
  ++offload_failures_;
  const auto now = std::chrono::steady_clock::now();
  if (last_failure_log_ != std::chrono::steady_clock::time_point{} &&
      now - last_failure_log_ < kFailureLogInterval) {
    ++failures_unlogged_;
    return;
  }
  PDSERVE_LOG(WARN) << "KV tiers: a block could not be kept: " << st.message()
                    << (failures_unlogged_ > 0 ? " (and " + std::to_string(failures_unlogged_) +
                                                     " more failures since the last report)"
                                               : std::string());
  failures_unlogged_ = 0;
  last_failure_log_ = now;
}

void KvTierMover::WriteLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  auto next = std::chrono::steady_clock::now();
  for (;;) {
    writer_cv_.wait(lock, [this] { return stop_ || write_pending_; });
    if (stop_) return;
    if (write_bytes_per_second_ > 0) {
      writer_cv_.wait_until(lock, next, [this] { return stop_; });
      if (stop_) return;
    }
    // Cleared before the write: a Put meanwhile sets it again.
    write_pending_ = false;
    lock.unlock();
    std::vector<KvTierChange> changes;
    const StatusOr<int64_t> n = store_->WriteQueued(&changes);
    lock.lock();
    if (!n.ok()) {
      NoteFailureLocked(n.status());
      write_pending_ = true;  // the next queued block may fare better
    } else if (*n > 0) {
      write_pending_ = true;
      if (write_bytes_per_second_ > 0) {
        next = std::max(next, std::chrono::steady_clock::now()) +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(static_cast<double>(*n) /
                                                 static_cast<double>(write_bytes_per_second_)));
      }
    }
  }
}

StatusOr<KvTierMover::FlushResult> KvTierMover::Flush(
    std::chrono::steady_clock::time_point deadline) {
  FlushResult r;
  {
    std::unique_lock<std::mutex> lock(mu_);
    settled_cv_.wait_until(lock, deadline, [this] { return queued_.empty(); });
    r.left = static_cast<int64_t>(queued_.size());
  }
  std::vector<KvTierChange> changes;
  int64_t left = 0;
  const StatusOr<int64_t> written = store_->FlushHostToDisk(deadline, &changes, &left);
  std::lock_guard<std::mutex> lock(mu_);
  if (!written.ok()) return written.status();
  r.written = *written;
  r.left += left;
  return r;
}

bool KvTierMover::Offload(BlockHash hash, HostBlockBuffers::Buffer bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // One queued copy per hash: a block evicted again before its first copy
    // landed holds the same KV.
    if (!queued_.emplace(hash, std::make_shared<const HostBlockBuffers::Buffer>(std::move(bytes)))
             .second) {
      return false;
    }
    Job job;
    job.hash = hash;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

bool KvTierMover::Holds(BlockHash hash) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queued_.count(hash)) return true;
  }
  return store_->Find(hash).has_value();
}

void KvTierMover::Onload(uint64_t ticket, std::vector<BlockHash> hashes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Job job;
    job.onload = true;
    job.ticket = ticket;
    job.hashes = std::move(hashes);
    job.asked = std::chrono::steady_clock::now();
    // Ahead of queued offloads (a request is waiting for these), behind the
    // onloads queued before it: requests are served in turn.
    auto first_offload =
        std::find_if(jobs_.begin(), jobs_.end(), [](const Job& j) { return !j.onload; });
    jobs_.insert(first_offload, std::move(job));
    ++onloads_in_flight_;
  }
  cv_.notify_one();
}

void KvTierMover::Abandon(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  if (parked_ && parked_->ticket == ticket) {
    parked_.reset();
    --onloads_in_flight_;
  }
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (it->onload && it->ticket == ticket) {
      it = jobs_.erase(it);
      --onloads_in_flight_;
    } else {
      ++it;
    }
  }
  std::erase_if(loaded_, [&](const Loaded& l) { return l.ticket == ticket; });
  if (reading_ == ticket) reading_abandoned_ = true;
  cv_.notify_all();  // loaded_ may be empty now: a parked onload goes on
}

std::vector<KvTierMover::Loaded> KvTierMover::TakeLoaded() {
  std::vector<Loaded> taken;
  bool resume = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    taken = std::exchange(loaded_, {});
    resume = parked_.has_value();
  }
  if (resume) cv_.notify_all();  // a parked onload's next part
  return taken;
}

std::optional<KvTierMover::Job> KvTierMover::NextJobLocked() {
  if (parked_ && loaded_.empty()) return std::exchange(parked_, std::nullopt);
  auto it = jobs_.begin();
  if (parked_) {
    it = std::find_if(jobs_.begin(), jobs_.end(), [](const Job& j) { return !j.onload; });
  }
  if (it == jobs_.end()) return std::nullopt;
  Job job = std::move(*it);
  jobs_.erase(it);
  return job;
}

std::vector<KvTierChange> KvTierMover::TakeChanges() { return store_->TakeChanges(); }

KvTierMover::Counters KvTierMover::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  Counters c;
  c.offloads_queued = static_cast<int64_t>(queued_.size());
  c.onloads_in_flight = onloads_in_flight_;
  c.onloads_ready = static_cast<int64_t>(loaded_.size());
  c.offload_failures = offload_failures_;
  return c;
}

void KvTierMover::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::optional<Job> next;
    cv_.wait(lock, [&] { return (next = NextJobLocked()).has_value() || stop_; });
    if (!next) {  // stopping, and every queued offload is done
      if (parked_) --onloads_in_flight_;
      parked_.reset();
      return;
    }
    Job job = std::move(*next);
    if (job.onload && stop_) {
      // Stopping: nobody takes the blocks any more, and on_ready_'s owner
      // may be partly destroyed already. Queued offloads still land.
      --onloads_in_flight_;
      continue;
    }
    std::vector<KvTierChange> changes;
    if (!job.onload) {
      const std::shared_ptr<const HostBlockBuffers::Buffer> bytes = queued_.at(job.hash);
      lock.unlock();
      const Status st = store_->Put(job.hash, bytes->data(), &changes);
      lock.lock();
      queued_.erase(job.hash);
      if (!st.ok()) NoteFailureLocked(st);
      if (store_->writes_through()) {
        write_pending_ = true;
        writer_cv_.notify_one();
      }
      if (queued_.empty()) settled_cv_.notify_all();
    } else {
      Loaded out;
      out.ticket = job.ticket;
      out.first = job.next;
      bool parked = false;
      reading_ = job.ticket;
      reading_abandoned_ = false;
      for (; job.next < job.hashes.size() && !reading_abandoned_; ++job.next) {
        const BlockHash hash = job.hashes[job.next];
        if (max_onload_blocks_ > 0 && out.blocks.size() == max_onload_blocks_) {
          // A part is full: reported, and the rest read once the engine has
          // taken it (its buffers go back as the engine copies it in).
          out.last = false;
          parked = true;
          break;
        }
        lock.unlock();
        HostBlockBuffers::Buffer block = buffers_->Take();
        lock.lock();
        if (!block) break;  // no host memory left: the rest is computed
        if (auto q = queued_.find(hash); q != queued_.end()) {
          // Still on its way down.
          std::memcpy(block.data(), q->second->data(), block.size());
          out.tiers.push_back(KvTier::kHost);
        } else {
          lock.unlock();
          const std::optional<KvTier> tier = store_->Find(hash);
          const Status st =
              tier ? store_->Get(hash, block.data(), &changes) : Status::NotFound("gone");
          lock.lock();
          if (!st.ok()) break;
          out.tiers.push_back(*tier);
        }
        out.blocks.push_back(std::move(block));
      }
      out.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - job.asked).count();
      reading_.reset();
      if (reading_abandoned_) {
        --onloads_in_flight_;  // nobody wants it: dropped, the rest not read
      } else {
        loaded_.push_back(std::move(out));
        if (parked) {
          parked_ = job;
        } else {
          --onloads_in_flight_;
        }
      }
    }
    if (job.onload && on_ready_ && !stop_) {
      lock.unlock();
      on_ready_();
      lock.lock();
    }
  }
}

}  // namespace pdserve
