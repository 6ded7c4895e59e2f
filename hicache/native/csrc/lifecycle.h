// HiCache's request lifecycle in bookkeeping-only mode (no KV tensors, every
// transfer complete as it starts), over the native tree and free lists.
//
// The twin of hicache/cache/facade.py for that mode: match with load-back, device
// allocation with eviction (write-back backups included), insert with the
// write policy's backups, release. Each operation makes the same tree and
// free-list calls, in the same order, as the Python methods it stands in
// for, so the tree, the free lists and the counters come out identical
// (tests/test_lifecycle_differential.py). HiCache delegates to it; what it
// does not cover (handles, argument checks, load_back of an unloaded handle,
// transfers with data, the third tier) stays in Python, on the same state.
//
// Knows nothing of Python or of requests: the caller owns the handles and
// checks argument types and counts; insert checks the tokens against the
// prefix and the pages held, as HiCache.insert does, before changing anything.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <vector>

#include "allocator.h"
#include "tree.h"

namespace hicache {

enum class WritePolicy : std::uint8_t { WriteThrough, WriteThroughSelective, WriteBack };

struct LifecycleConfig {
  WritePolicy write_policy = WritePolicy::WriteThrough;
  std::int64_t backup_hit_threshold = 2;   // write_through_selective
  std::int64_t load_threshold_tokens = 0;  // shorter host hits count as misses
  std::int64_t page_nbytes = 0;            // bytes a page of KV would move
  bool has_host_tier = false;
};

// Counters of hicache.cache.CacheStats this lifecycle adds to, in this order.
inline constexpr std::array<const char*, 15> kLifecycleCounterNames = {
    "requests",          "requested_tokens",        "device_hit_tokens",
    "host_hit_tokens",   "host_hit_refused_tokens", "loads_refused_by_threshold",
    "loads_refused_no_space", "loads",              "load_bytes",
    "backups",           "backups_skipped",         "backup_bytes",
    "device_evicted_tokens", "host_evicted_tokens", "inserted_tokens",
};

struct MatchedPrefix {
  TreeNode* lock;           // the locked node: the end of the prefix on the device
  std::int64_t device_len;  // matched on the device
  std::int64_t host_len;    // matched only in host memory
  std::int64_t prefix_len;  // device_len plus what was loaded back
};

struct InsertedPath {
  TreeNode* last;            // the locked node ending at the inserted length
  std::int64_t new_tokens;   // tokens newly cached
  at::Tensor rest;           // the caller's pages past the inserted ones (may be empty)
};

class Lifecycle {
 public:
  Lifecycle(RadixTree& tree, FreeList& device, FreeList& host, LifecycleConfig config);

  // HiCache.match: match and lock `key` (whole pages); with load_back, the
  // host-only part moves to new device pages; the selective policy backs up.
  // num_tokens: the length of the caller's tokens (requested_tokens counts it).
  MatchedPrefix match(token_span key, std::uint32_t ns, std::int64_t num_tokens, bool load_back);

  // HiCache._alloc_device: num_pages device pages, evicting as needed; nullopt
  // (and nothing allocated or evicted) when not enough can be freed.
  std::optional<at::Tensor> alloc_device(std::int64_t num_pages);

  // HiCache.insert: cache `key` (whole pages) over the caller's pages. `lock`
  // ends the caller's prefix of prefix_len tokens, which must equal the first
  // tokens of both `prefix_key` (what the caller matched) and `key`; `owned`
  // (may be null) are the caller's pages after the prefix. Frees the caller's
  // duplicates, moves the lock to the inserted path and runs the write policy.
  // nullopt when `key` adds no page to the prefix; ValueError (nothing
  // changed) when it does not start with the prefix or needs more pages.
  std::optional<InsertedPath> insert(token_span key, std::uint32_t ns, TreeNode* lock,
                                     const IndexRun* owned, token_span prefix_key,
                                     std::int64_t prefix_len);

  // HiCache.release: unlock `lock`'s path and free `owned` (may be null).
  void release(TreeNode* lock, const IndexRun* owned);

  // The counters added since the last call (then zeroed), in kLifecycleCounterNames order.
  std::array<std::int64_t, kLifecycleCounterNames.size()> take_counters();

  RadixTree& tree() { return tree_; }

 private:
  struct Counters {
    std::int64_t requests = 0, requested_tokens = 0, device_hit_tokens = 0, host_hit_tokens = 0,
                 host_hit_refused_tokens = 0, loads_refused_by_threshold = 0,
                 loads_refused_no_space = 0, loads = 0, load_bytes = 0, backups = 0,
                 backups_skipped = 0, backup_bytes = 0, device_evicted_tokens = 0,
                 host_evicted_tokens = 0, inserted_tokens = 0;
  };
  // A write-back backup started by an eviction, applied when the eviction returns.
  struct PendingBackup {
    TreeNode* node;
    std::int64_t nbytes;
  };

  void start_load(MatchedPrefix& m, TreeNode* last);
  void evict_device(std::int64_t num_pages);
  std::optional<at::Tensor> alloc_host(std::int64_t num_pages);
  void backup_path(TreeNode* node);
  bool start_backup(const std::vector<TreeNode*>& nodes, TreeNode* evict);
  void finish_backups();
  void free_device(const at::Tensor& pages);
  void free_host(const at::Tensor& pages);

  RadixTree& tree_;
  FreeList& device_;
  FreeList& host_;
  LifecycleConfig config_;
  Counters c_;
  std::vector<PendingBackup> pending_;
};

}  // namespace hicache
