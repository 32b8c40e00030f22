#include "engine/kv_tier_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <list>
#include <map>
#include <new>
#include <unordered_map>

#include "common/logging.h"

namespace pdserve {
namespace {

constexpr uint64_t kSlabMagic = 0x31424c53564b4450ull;  // "PDKVSLB1", little-endian
constexpr uint32_t kSlabVersion = 1;
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kSlotAlign = 4096;

// A disk slot's header, little-endian on every host this runs on (x86-64,
// aarch64); the last field checks the ones before it.
struct SlotHeader {
  uint64_t magic = kSlabMagic;
  uint32_t version = kSlabVersion;
  uint32_t reserved = 0;
  uint64_t layout_hash = 0;
  uint64_t block_hash = 0;
  uint64_t generation = 0;
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;
  uint64_t header_checksum = 0;

  uint64_t Checksum() const { return XXH3_64bits(this, offsetof(SlotHeader, header_checksum)); }
};
static_assert(sizeof(SlotHeader) == kHeaderBytes);

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string Errno(const std::string& what, int err = errno) {
  return what + ": " + std::strerror(err);
}

constexpr const char* kSlabName = "kv-tier.slab";

// The whole of an iovec array, however many calls it takes: a regular file
// may take a write (or give a read) in parts, and errno says nothing about
// a short one. Returns 0, or the errno of the call that failed (ENOSPC for
// a write that made no progress without one).
template <typename Io>
int AllOf(Io io, iovec* iov, int count, off_t offset, bool write) {
  while (count > 0) {
    const ssize_t n = io(iov, count, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return write ? ENOSPC : EIO;  // no progress: a full device, or past the end
    offset += n;
    for (size_t left = static_cast<size_t>(n); left > 0;) {
      const size_t take = std::min(left, iov->iov_len);
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + take;
      iov->iov_len -= take;
      left -= take;
      if (iov->iov_len == 0) {
        ++iov;
        --count;
      }
    }
    while (count > 0 && iov->iov_len == 0) {
      ++iov;
      --count;
    }
  }
  return 0;
}

std::string Bytes(int64_t n) {
  char buf[32];
  if (n >= (1ll << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(n) / (1ll << 30));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(n) / (1ll << 20));
  }
  return buf;
}

}  // namespace

struct KvTierStore::Slot {
  enum class State { kFree, kHeld, kBusy };
  State state = State::kFree;
  BlockHash hash = 0;
  uint64_t generation = 0;
  bool write_queued = false;         // host slot: waiting for its write-through copy
  std::list<int64_t>::iterator lru;  // valid while held or busy
};

// One tier's bookkeeping: slots, the index by hash and the LRU order
// (front = least recently used).
struct KvTierStore::Tier {
  KvTier kind;
  std::vector<Slot> slots;
  std::unordered_map<BlockHash, int64_t> index;
  std::list<int64_t> lru;
  std::vector<int64_t> free;
  int64_t hits = 0, bytes_written = 0, bytes_read = 0;

  Tier(KvTier k, int64_t n) : kind(k), slots(static_cast<size_t>(n)) {
    for (int64_t i = n - 1; i >= 0; --i) free.push_back(i);
  }
  void Touch(int64_t s) { lru.splice(lru.end(), lru, slots[s].lru); }
  void Hold(int64_t s, BlockHash hash, uint64_t generation) {
    Slot& slot = slots[s];
    slot.state = Slot::State::kHeld;
    slot.hash = hash;
    slot.generation = generation;
    slot.lru = lru.insert(lru.end(), s);
    index[hash] = s;
  }
  void Release(int64_t s) {
    Slot& slot = slots[s];
    if (slot.state != Slot::State::kFree) lru.erase(slot.lru);
    auto it = index.find(slot.hash);
    if (it != index.end() && it->second == s) index.erase(it);
    slot = Slot{};
    free.push_back(s);
  }
  // The least recently used slot not busy with I/O, or -1.
  int64_t Victim() const {
    for (int64_t s : lru) {
      if (slots[s].state == Slot::State::kHeld) return s;
    }
    return -1;
  }
};

std::optional<KvDiskWrite> ParseKvDiskWrite(std::string_view name) {
  if (name == "through") return KvDiskWrite::kThrough;
  if (name == "back") return KvDiskWrite::kBack;
  return std::nullopt;
}

std::string_view KvDiskWriteName(KvDiskWrite w) {
  return w == KvDiskWrite::kThrough ? "through" : "back";
}

StatusOr<std::unique_ptr<KvTierStore>> KvTierStore::Open(const KvTierOptions& options) {
  if (options.block_bytes <= 0) return Status::InvalidArgument("KV tiers need the block size");
  std::unique_ptr<KvTierStore> s(new KvTierStore());
  s->options_ = options;
  if (options.host_bytes < 0 || options.disk_bytes < 0) {
    return Status::InvalidArgument("KV tier sizes must not be negative");
  }
  if (options.write_queue_blocks <= 0) {
    return Status::InvalidArgument("the disk KV tier's write queue must hold a block");
  }
  s->host_slots_ = options.host_bytes / options.block_bytes;
  if (options.host_bytes > 0 && s->host_slots_ == 0) {
    return Status::InvalidArgument("the host KV tier of " + std::to_string(options.host_bytes) +
                                   " bytes holds no block of " +
                                   std::to_string(options.block_bytes) + " bytes");
  }
  s->slot_stride_ = (kHeaderBytes + options.block_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  if (!options.disk_dir.empty()) {
    s->disk_slots_ = options.disk_bytes / s->slot_stride_;
    if (s->disk_slots_ == 0) {
      return Status::InvalidArgument("the disk KV tier of " + std::to_string(options.disk_bytes) +
                                     " bytes holds no block of " + std::to_string(s->slot_stride_) +
                                     " bytes (with its header)");
    }
  }
  if (s->host_slots_ > 0) {
    const auto bytes = static_cast<size_t>(s->host_slots_ * options.block_bytes);
    s->host_memory_ = static_cast<uint8_t*>(
        options.host_memory_from ? options.host_memory_from->AllocateHost(bytes)
                                 : ::operator new (bytes, std::align_val_t{64}, std::nothrow));
    if (s->host_memory_ == nullptr) {
      return Status::ResourceExhausted("cannot allocate the host KV tier's " +
                                       std::to_string(bytes) + " bytes" +
                                       (options.host_memory_from ? " of page-locked memory" : ""));
    }
  }
  s->host_ = std::make_unique<Tier>(KvTier::kHost, s->host_slots_);
  // The disk tier's bookkeeping comes once its slab has room (OpenDisk).
  s->disk_ = std::make_unique<Tier>(KvTier::kDisk, 0);
  if (s->disk_slots_ > 0) PDSERVE_RETURN_IF_ERROR(s->OpenDisk());
  return s;
}

KvTierStore::~KvTierStore() {
  if (fd_ >= 0) ::close(fd_);
  if (host_memory_ != nullptr) {
    if (options_.host_memory_from) {
      options_.host_memory_from->FreeHost(host_memory_);
    } else {
      ::operator delete (host_memory_, std::align_val_t{64});
    }
  }
}

bool KvTierStore::writes_through() const {
  return has_host() && has_disk() && options_.disk_write == KvDiskWrite::kThrough;
}

Status KvTierStore::OpenDisk() {
  std::error_code ec;
  std::filesystem::create_directories(options_.disk_dir, ec);
  if (ec) {
    return Status::Unavailable("cannot create the disk KV tier's folder " + options_.disk_dir +
                               ": " + ec.message());
  }
  slab_path_ = options_.disk_dir + "/" + kSlabName;
  const std::string& path = slab_path_;
  // O_NOFOLLOW: a link planted at the slab's name would have us resize and
  // overwrite whatever it points at.
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ < 0 && errno == ELOOP) {
    return Status::Unavailable(path +
                               " is a symbolic link: refusing to follow it (the disk KV "
                               "tier resizes and overwrites its slab; remove the link)");
  }
  if (fd_ < 0) return Status::Unavailable(Errno("cannot open " + path));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Status::Unavailable(Errno("cannot stat " + path));
  if (!S_ISREG(st.st_mode)) {
    return Status::Unavailable(path +
                               " is not a regular file: refusing to use it as the disk KV "
                               "tier's slab");
  }
  if (st.st_uid != ::geteuid()) {
    return Status::Unavailable(path + " belongs to user id " + std::to_string(st.st_uid) +
                               ", not to this worker's (" + std::to_string(::geteuid()) +
                               "): refusing to resize and overwrite it");
  }
  if (st.st_nlink > 1) {
    return Status::Unavailable(path + " has " + std::to_string(st.st_nlink) +
                               " hard links: refusing to resize and overwrite a file that is "
                               "also elsewhere");
  }
  // Two workers on one slab would overwrite each other's slots. The lock
  // goes with the process, so a worker that was killed leaves none behind.
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    return Status::Unavailable(
        Errno(path + " is in use by another process (give every worker its own disk tier folder)"));
  }
  // Slabs of earlier releases were named after their layout; they are not
  // read any more and only take space.
  for (const auto& entry : std::filesystem::directory_iterator(options_.disk_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("kv-tier-", 0) == 0 && name.size() > 5 &&
        name.compare(name.size() - 5, 5, ".slab") == 0) {
      PDSERVE_LOG(WARN) << "disk KV tier: " << entry.path().string()
                        << " is a slab of an earlier release and is not used: delete it to free "
                           "its space";
    }
  }
  PDSERVE_RETURN_IF_ERROR(ReserveSlab(path, static_cast<int64_t>(st.st_blocks) * 512));
  disk_ = std::make_unique<Tier>(KvTier::kDisk, disk_slots_);
  // Rebuild the index from the headers: the newest valid copy of each hash.
  std::unordered_map<BlockHash, std::pair<uint64_t, int64_t>> newest;  // hash -> (generation, slot)
  std::vector<int64_t> foreign;
  std::map<std::string, int64_t> resliced;  // by the layout they were written in
  for (int64_t slot = 0; slot < disk_slots_; ++slot) {
    SlotHeader h;
    if (::pread(fd_, &h, sizeof(h), static_cast<off_t>(slot * slot_stride_)) !=
        static_cast<ssize_t>(sizeof(h))) {
      continue;
    }
    if (h.magic != kSlabMagic || h.header_checksum != h.Checksum()) continue;  // empty or torn
    if (h.version == kSlabVersion && h.layout_hash != options_.layout_hash) {
      // Another tensor-parallel size of this model and KV configuration:
      // converted in place, then indexed like this layout's own.
      const KvTierReslice* from = nullptr;
      for (const KvTierReslice& r : options_.reslice_from) {
        if (r.layout_hash == h.layout_hash &&
            h.payload_bytes == static_cast<uint64_t>(r.payload_bytes)) {
          from = &r;
        }
      }
      if (from != nullptr &&
          ResliceDiskSlot(slot, h.generation, h.block_hash, h.payload_checksum, *from)) {
        ++resliced[from->name];
        ++resliced_;
        h.layout_hash = options_.layout_hash;
        h.payload_bytes = static_cast<uint64_t>(options_.block_bytes);
      }
    }
    if (h.version != kSlabVersion || h.layout_hash != options_.layout_hash ||
        h.payload_bytes != static_cast<uint64_t>(options_.block_bytes)) {
      foreign.push_back(slot);
      continue;
    }
    next_generation_ = std::max(next_generation_, h.generation + 1);
    auto [it, inserted] = newest.try_emplace(h.block_hash, h.generation, slot);
    if (!inserted && h.generation > it->second.first) it->second = {h.generation, slot};
  }
  for (const auto& [name, count] : resliced) {
    PDSERVE_LOG(INFO) << "disk KV tier: re-sliced " << count << " cached blocks of " << path
                      << " written at " << name << " into this worker's layout";
  }
  // Another model (other weights, config or tokenizer), KV dtype or scales,
  // or block size wrote these: their KV means nothing to this one. Their
  // headers are cleared so that they are not found again.
  if (!foreign.empty()) {
    for (int64_t slot : foreign) {
      SlotHeader cleared;
      cleared.magic = 0;
      (void)::pwrite(fd_, &cleared, sizeof(cleared), static_cast<off_t>(slot * slot_stride_));
    }
    discarded_ = static_cast<int64_t>(foreign.size());
    PDSERVE_LOG(WARN) << "disk KV tier: discarded " << foreign.size() << " cached blocks of "
                      << path
                      << " written by another model or KV configuration (its weights, config, "
                         "tokenizer, KV dtype or scales or block size differ)";
  }
  std::vector<std::pair<uint64_t, int64_t>> order;  // oldest first: the LRU order
  for (const auto& [hash, gs] : newest) order.push_back(gs);
  std::sort(order.begin(), order.end());
  Tier& d = *disk_;
  d.free.clear();
  std::vector<bool> used(static_cast<size_t>(disk_slots_), false);
  for (const auto& [generation, slot] : order) {
    SlotHeader h;
    (void)::pread(fd_, &h, sizeof(h), static_cast<off_t>(slot * slot_stride_));
    d.Hold(slot, h.block_hash, generation);
    used[static_cast<size_t>(slot)] = true;
  }
  for (int64_t slot = disk_slots_ - 1; slot >= 0; --slot) {
    if (!used[static_cast<size_t>(slot)]) d.free.push_back(slot);
  }
  return Status::Ok();
}

Status KvTierStore::ReserveSlab(const std::string& path, int64_t allocated_bytes) {
  const int64_t want = disk_slots_ * slot_stride_;
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return Status::Unavailable(Errno("cannot stat " + path));
  // A larger slab (an earlier, bigger --kv-disk-cache-bytes) is cut to size;
  // its slots past the new end are lost, the others kept.
  if (st.st_size > want && ::ftruncate(fd_, want) != 0) {
    return Status::Unavailable(Errno("cannot size " + path));
  }
  if (st.st_size == want && allocated_bytes >= want) return Status::Ok();  // reserved before
  // The space the slab still needs must be free now: a sparse slab on a
  // full disk fails its writes later, one block at a time.
  const int64_t needed = std::max<int64_t>(0, want - allocated_bytes);
  struct statvfs vfs {};
  if (::fstatvfs(fd_, &vfs) == 0) {
    const int64_t free_bytes = static_cast<int64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (needed > free_bytes) {
      return Status::ResourceExhausted("the disk KV tier needs " + Bytes(needed) + " more in " +
                                       options_.disk_dir + " for its slab of " + Bytes(want) +
                                       " (--kv-disk-cache-bytes), but only " + Bytes(free_bytes) +
                                       " are free");
    }
  }
  // Reserve it, where the file system can: writes into the slab then never
  // find the disk full.
  if (::fallocate(fd_, 0, 0, want) == 0) return Status::Ok();
  const int err = errno;
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
    return Status::ResourceExhausted(Errno("cannot reserve " + Bytes(want) + " for " + path, err));
  }
  if (::ftruncate(fd_, want) != 0) return Status::Unavailable(Errno("cannot size " + path));
  return Status::Ok();  // no fallocate here (EOPNOTSUPP): a sparse slab
}

Status KvTierStore::WriteDiskSlot(int64_t slot, BlockHash hash, uint64_t generation,
                                  const uint8_t* bytes) {
  SlotHeader h;
  h.layout_hash = options_.layout_hash;
  h.block_hash = hash;
  h.generation = generation;
  h.payload_bytes = static_cast<uint64_t>(options_.block_bytes);
  h.payload_checksum = XXH3_64bits(bytes, static_cast<size_t>(options_.block_bytes));
  h.header_checksum = h.Checksum();
  iovec iov[2] = {{&h, sizeof(h)},
                  {const_cast<uint8_t*>(bytes), static_cast<size_t>(options_.block_bytes)}};
  const off_t at = static_cast<off_t>(slot * slot_stride_);
  const int err = AllOf([this](iovec* v, int n, off_t o) { return ::pwritev(fd_, v, n, o); }, iov,
                        2, at, /*write=*/true);
  if (err != 0) {
    return Status::Unavailable(
        Errno("disk KV tier: writing " + std::to_string(sizeof(h) + options_.block_bytes) +
                  " bytes at offset " + std::to_string(at) + " of " + slab_path_,
              err));
  }
  return Status::Ok();
}

bool KvTierStore::ReadDiskSlot(int64_t slot, BlockHash hash, uint8_t* out) {
  SlotHeader h;
  iovec iov[2] = {{&h, sizeof(h)}, {out, static_cast<size_t>(options_.block_bytes)}};
  if (AllOf([this](iovec* v, int n, off_t o) { return ::preadv(fd_, v, n, o); }, iov, 2,
            static_cast<off_t>(slot * slot_stride_), /*write=*/false) != 0) {
    return false;
  }
  return h.magic == kSlabMagic && h.version == kSlabVersion && h.header_checksum == h.Checksum() &&
         h.layout_hash == options_.layout_hash && h.block_hash == hash &&
         h.payload_bytes == static_cast<uint64_t>(options_.block_bytes) &&
         h.payload_checksum == XXH3_64bits(out, static_cast<size_t>(options_.block_bytes));
}

bool KvTierStore::ResliceDiskSlot(int64_t slot, uint64_t generation, BlockHash hash,
                                  uint64_t payload_checksum, const KvTierReslice& from) {
  std::vector<uint8_t> in(static_cast<size_t>(from.payload_bytes));
  iovec iov{in.data(), in.size()};
  if (AllOf([this](iovec* v, int n, off_t o) { return ::preadv(fd_, v, n, o); }, &iov, 1,
            static_cast<off_t>(slot * slot_stride_ + kHeaderBytes), /*write=*/false) != 0 ||
      XXH3_64bits(in.data(), in.size()) != payload_checksum) {
    return false;
  }
  std::vector<uint8_t> out(static_cast<size_t>(options_.block_bytes));
  from.convert(in.data(), out.data());
  return WriteDiskSlot(slot, hash, generation, out.data()).ok();
}

bool KvTierStore::ReplaceDiskCopyLocked(BlockHash hash, int64_t fresh_slot) {
  Tier& d = *disk_;
  auto old = d.index.find(hash);
  if (old == d.index.end()) return true;
  if (d.slots[old->second].state == Slot::State::kBusy) {
    d.free.push_back(fresh_slot);  // the same bytes: the fresh copy goes
    return false;
  }
  d.Release(old->second);
  return true;
}

void KvTierStore::NoteLocked(std::vector<KvTierChange>* changes, const KvTierChange& change) {
  changes->push_back(change);
  log_.push_back(change);
}

std::vector<KvTierChange> KvTierStore::TakeChanges() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(log_, {});
}

int64_t KvTierStore::TakeDiskSlotLocked(std::vector<KvTierChange>* changes) {
  Tier& d = *disk_;
  if (d.free.empty()) {
    const int64_t victim = d.Victim();
    if (victim < 0) return -1;
    NoteLocked(changes, {d.slots[victim].hash, KvTier::kDisk, false});
    d.Release(victim);
  }
  const int64_t slot = d.free.back();
  d.free.pop_back();
  return slot;
}

void KvTierStore::UnqueueLocked(int64_t slot) {
  Slot& s = host_->slots[slot];
  if (!s.write_queued) return;
  s.write_queued = false;
  --queued_;
}

Status KvTierStore::DemoteLocked(std::unique_lock<std::mutex>& lock,
                                 std::vector<KvTierChange>* changes) {
  Tier& h = *host_;
  Tier& d = *disk_;
  const int64_t victim = h.Victim();
  if (victim < 0) return Status::ResourceExhausted("every host KV tier slot is busy");
  const BlockHash hash = h.slots[victim].hash;
  UnqueueLocked(victim);
  // Written through already: the disk copy stays, nothing to write. It is
  // as recent as a block written now would be.
  if (auto it = d.index.find(hash); it != d.index.end()) {
    d.Touch(it->second);
    NoteLocked(changes, {hash, KvTier::kHost, false});
    h.Release(victim);
    return Status::Ok();
  }
  const int64_t disk_slot = has_disk() ? TakeDiskSlotLocked(changes) : -1;
  if (disk_slot < 0) {  // no disk tier (or every slot busy): the block is gone
    NoteLocked(changes, {hash, KvTier::kHost, false});
    h.Release(victim);
    return Status::Ok();
  }
  // Both slots stay out of use while the block is written; the host copy
  // keeps serving Get meanwhile.
  h.slots[victim].state = Slot::State::kBusy;
  d.slots[disk_slot].state = Slot::State::kBusy;
  const uint64_t generation = next_generation_++;
  const uint8_t* bytes = host_memory_ + victim * options_.block_bytes;
  lock.unlock();
  const Status written = WriteDiskSlot(disk_slot, hash, generation, bytes);
  lock.lock();
  h.Release(victim);
  NoteLocked(changes, {hash, KvTier::kHost, false});
  d.slots[disk_slot].state = Slot::State::kFree;
  if (!written.ok()) {
    ++write_errors_;
    d.free.push_back(disk_slot);
    return written;
  }
  // A copy written meanwhile: the newer one wins, unless the older is being
  // read (Get holds it busy), which then stays.
  if (!ReplaceDiskCopyLocked(hash, disk_slot)) return Status::Ok();
  d.Hold(disk_slot, hash, generation);
  d.bytes_written += options_.block_bytes;
  ++writes_evict_;
  NoteLocked(changes, {hash, KvTier::kDisk, true});
  return Status::Ok();
}

Status KvTierStore::CopyHostToDiskLocked(std::unique_lock<std::mutex>& lock, int64_t slot,
                                         int64_t* counter, std::vector<KvTierChange>* changes) {
  Tier& h = *host_;
  Tier& d = *disk_;
  const int64_t disk_slot = TakeDiskSlotLocked(changes);
  if (disk_slot < 0) return Status::ResourceExhausted("every disk KV tier slot is busy");
  const BlockHash hash = h.slots[slot].hash;
  // The host slot is not reused while its bytes are being written (Get
  // still reads it); the disk slot is nobody's until the write is done.
  h.slots[slot].state = Slot::State::kBusy;
  d.slots[disk_slot].state = Slot::State::kBusy;
  const uint64_t generation = next_generation_++;
  const uint8_t* bytes = host_memory_ + slot * options_.block_bytes;
  lock.unlock();
  const Status written = WriteDiskSlot(disk_slot, hash, generation, bytes);
  lock.lock();
  h.slots[slot].state = Slot::State::kHeld;
  d.slots[disk_slot].state = Slot::State::kFree;
  if (!written.ok()) {
    ++write_errors_;
    d.free.push_back(disk_slot);
    return written;
  }
  if (!ReplaceDiskCopyLocked(hash, disk_slot)) return Status::Ok();
  d.Hold(disk_slot, hash, generation);
  d.bytes_written += options_.block_bytes;
  ++*counter;
  NoteLocked(changes, {hash, KvTier::kDisk, true});
  return Status::Ok();
}

StatusOr<int64_t> KvTierStore::WriteQueued(std::vector<KvTierChange>* changes) {
  std::unique_lock<std::mutex> lock(mu_);
  Tier& h = *host_;
  while (!write_queue_.empty()) {
    const auto [slot, hash] = write_queue_.front();
    write_queue_.pop_front();
    Slot& s = h.slots[slot];
    if (!s.write_queued || s.hash != hash) continue;  // stale: evicted, or queued again later
    UnqueueLocked(slot);
    if (s.state != Slot::State::kHeld || disk_->index.count(hash)) continue;
    PDSERVE_RETURN_IF_ERROR(CopyHostToDiskLocked(lock, slot, &writes_through_, changes));
    return options_.block_bytes;
  }
  return int64_t{0};
}

StatusOr<int64_t> KvTierStore::FlushHostToDisk(std::chrono::steady_clock::time_point deadline,
                                               std::vector<KvTierChange>* changes, int64_t* left) {
  std::unique_lock<std::mutex> lock(mu_);
  if (left != nullptr) *left = 0;
  if (!has_host() || !has_disk()) return int64_t{0};
  Tier& h = *host_;
  // The disk keeps the most recently used host blocks, those with a copy
  // already included: their copies are moved up in the disk's LRU in host
  // order (a host hit does not touch them), so that the writes of the others
  // evict colder blocks, never a hotter block's only copy on disk.
  std::vector<std::pair<int64_t, BlockHash>> hottest;  // (slot, hash), least recent first
  for (int64_t slot : h.lru) {
    const Slot& s = h.slots[slot];
    if (s.state == Slot::State::kHeld) hottest.push_back({slot, s.hash});
  }
  if (static_cast<int64_t>(hottest.size()) > disk_slots_) {
    hottest.erase(hottest.begin(), hottest.end() - disk_slots_);
  }
  std::vector<std::pair<int64_t, BlockHash>> without_disk_copy;
  for (const auto& [slot, hash] : hottest) {
    if (auto copy = disk_->index.find(hash); copy != disk_->index.end()) {
      disk_->Touch(copy->second);
    } else {
      without_disk_copy.push_back({slot, hash});
    }
  }
  int64_t written = 0;
  for (size_t i = 0; i < without_disk_copy.size(); ++i) {
    if (std::chrono::steady_clock::now() >= deadline) {
      if (left != nullptr) *left = static_cast<int64_t>(without_disk_copy.size() - i);
      break;
    }
    const auto [slot, hash] = without_disk_copy[i];
    Slot& s = h.slots[slot];
    // Changed while the lock was released for the previous write.
    if (s.state != Slot::State::kHeld || s.hash != hash || disk_->index.count(hash)) continue;
    UnqueueLocked(slot);
    PDSERVE_RETURN_IF_ERROR(CopyHostToDiskLocked(lock, slot, &writes_flush_, changes));
    ++written;
  }
  return written;
}

Status KvTierStore::Put(BlockHash hash, const uint8_t* bytes, std::vector<KvTierChange>* changes) {
  std::unique_lock<std::mutex> lock(mu_);
  Tier& h = *host_;
  Tier& d = *disk_;
  if (auto it = h.index.find(hash); it != h.index.end()) {
    h.Touch(it->second);
    return Status::Ok();
  }
  if (!has_host()) {
    if (!has_disk()) return Status::Ok();
    if (auto it = d.index.find(hash); it != d.index.end()) {
      d.Touch(it->second);
      return Status::Ok();
    }
    const int64_t slot = TakeDiskSlotLocked(changes);
    if (slot < 0) return Status::ResourceExhausted("every disk KV tier slot is busy");
    d.slots[slot].state = Slot::State::kBusy;
    const uint64_t generation = next_generation_++;
    lock.unlock();
    const Status written = WriteDiskSlot(slot, hash, generation, bytes);
    lock.lock();
    d.slots[slot].state = Slot::State::kFree;
    if (!written.ok()) {
      ++write_errors_;
      d.free.push_back(slot);
      return written;
    }
    d.Hold(slot, hash, generation);
    d.bytes_written += options_.block_bytes;
    ++writes_evict_;
    NoteLocked(changes, {hash, KvTier::kDisk, true});
    return Status::Ok();
  }
  // A failed disk write loses the demoted block but frees its host slot:
  // the new block still goes in, and the error is returned for the caller
  // to log and count.
  Status demoted = Status::Ok();
  while (h.free.empty()) {
    Status st = DemoteLocked(lock, changes);
    if (!st.ok()) {
      if (h.free.empty()) return st;
      demoted = std::move(st);
    }
  }
  if (auto it = h.index.find(hash); it != h.index.end()) {  // put by another thread meanwhile
    h.Touch(it->second);
    return demoted;
  }
  const bool through = writes_through();
  bool on_disk = false;
  if (auto it = d.index.find(hash);
      it != d.index.end() && d.slots[it->second].state == Slot::State::kHeld) {
    if (through) {
      on_disk = true;  // its disk copy stays: nothing to write
    } else {
      // Write-back: one lower tier holds a block at a time.
      NoteLocked(changes, {hash, KvTier::kDisk, false});
      d.Release(it->second);
    }
  }
  const int64_t slot = h.free.back();
  h.free.pop_back();
  std::memcpy(host_memory_ + slot * options_.block_bytes, bytes,
              static_cast<size_t>(options_.block_bytes));
  h.Hold(slot, hash, next_generation_++);
  h.bytes_written += options_.block_bytes;
  NoteLocked(changes, {hash, KvTier::kHost, true});
  if (through && !on_disk) {
    if (queued_ >= options_.write_queue_blocks) {
      ++write_dropped_;  // it reaches the disk when the host tier evicts it
    } else {
      h.slots[slot].write_queued = true;
      ++queued_;
      write_queue_.push_back({slot, hash});
      // Stale entries (blocks evicted before their turn) are dropped once
      // they outnumber the live ones, so the queue stays bounded.
      if (static_cast<int64_t>(write_queue_.size()) > 2 * options_.write_queue_blocks) {
        std::erase_if(write_queue_, [&h](const std::pair<int64_t, BlockHash>& e) {
          const Slot& q = h.slots[e.first];
          return !q.write_queued || q.hash != e.second;
        });
      }
    }
  }
  return demoted;
}

std::optional<KvTier> KvTierStore::Find(BlockHash hash) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_->index.count(hash)) return KvTier::kHost;
  if (disk_->index.count(hash)) return KvTier::kDisk;
  return std::nullopt;
}

Status KvTierStore::Get(BlockHash hash, uint8_t* out, std::vector<KvTierChange>* changes) {
  std::unique_lock<std::mutex> lock(mu_);
  Tier& h = *host_;
  Tier& d = *disk_;
  if (auto it = h.index.find(hash); it != h.index.end()) {
    std::memcpy(out, host_memory_ + it->second * options_.block_bytes,
                static_cast<size_t>(options_.block_bytes));
    if (h.slots[it->second].state == Slot::State::kHeld) h.Touch(it->second);
    ++h.hits;
    h.bytes_read += options_.block_bytes;
    return Status::Ok();
  }
  auto it = d.index.find(hash);
  if (it == d.index.end() || d.slots[it->second].state != Slot::State::kHeld) {
    return Status::NotFound("no lower KV tier holds block " + Hex(hash));
  }
  const int64_t slot = it->second;
  d.slots[slot].state = Slot::State::kBusy;
  lock.unlock();
  const bool ok = ReadDiskSlot(slot, hash, out);
  if (!ok) {
    // Its header is cleared (the slot is still busy, nobody else writes
    // it), so that a restart does not index and announce it again.
    SlotHeader cleared;
    cleared.magic = 0;
    (void)::pwrite(fd_, &cleared, sizeof(cleared), static_cast<off_t>(slot * slot_stride_));
  }
  lock.lock();
  // Busy slots are never released (ReplaceDiskCopyLocked), so the slot is
  // still this block's.
  d.slots[slot].state = Slot::State::kHeld;
  if (!ok) {
    ++corrupt_dropped_;
    NoteLocked(changes, {hash, KvTier::kDisk, false});
    d.Release(slot);
    return Status::NotFound("disk KV tier block " + Hex(hash) +
                            " failed its checksums: dropped, not served");
  }
  d.Touch(slot);
  ++d.hits;
  d.bytes_read += options_.block_bytes;
  return Status::Ok();
}

std::vector<BlockHash> KvTierStore::Blocks(KvTier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Tier& t = tier == KvTier::kDisk ? *disk_ : *host_;
  std::vector<BlockHash> out;
  if (tier == KvTier::kDevice) return out;
  out.reserve(t.index.size());
  for (const auto& [hash, _] : t.index) out.push_back(hash);
  return out;
}

KvTierStats KvTierStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  KvTierStats s;
  auto fill = [](const Tier& t, int64_t capacity, KvTierStats::Tier* out) {
    out->blocks = static_cast<int64_t>(t.index.size());
    out->capacity_blocks = capacity;
    out->hits = t.hits;
    out->bytes_written = t.bytes_written;
    out->bytes_read = t.bytes_read;
  };
  fill(*host_, host_slots_, &s.host);
  fill(*disk_, disk_slots_, &s.disk);
  s.corrupt_dropped = corrupt_dropped_;
  s.disk_writes_through = writes_through_;
  s.disk_writes_evict = writes_evict_;
  s.disk_writes_flush = writes_flush_;
  s.write_queue_blocks = queued_;
  s.write_dropped = write_dropped_;
  s.disk_write_errors = write_errors_;
  s.discarded_at_open = discarded_;
  s.resliced_at_open = resliced_;
  return s;
}

}  // namespace pdserve
