// HiCache's bookkeeping-only lifecycle (lifecycle.h). Each method follows the
// Python method named in its comment statement by statement: the order of
// tree and free-list calls decides eviction order and page reuse, and the
// differential test holds both to the same results.
#include "lifecycle.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace hicache {

Lifecycle::Lifecycle(RadixTree& tree, FreeList& device, FreeList& host, LifecycleConfig config)
    : tree_(tree), device_(device), host_(host), config_(config) {}

// HiCache.match (bookkeeping: no storage, no load in flight).
MatchedPrefix Lifecycle::match(token_span key, std::uint32_t ns, std::int64_t num_tokens,
                               bool load_back) {
  OpScope scope(tree_);
  const MatchOut r = tree_.match(key, ns);
  tree_.lock(r.last_device);
  c_.requests += 1;
  c_.requested_tokens += num_tokens;
  c_.device_hit_tokens += r.device_len;
  MatchedPrefix m{r.last_device, r.device_len, r.host_len, r.device_len};
  if (load_back && r.host_len != 0) start_load(m, r.last);
  if (config_.write_policy == WritePolicy::WriteThroughSelective) backup_path(m.lock);
  return m;
}

// HiCache._start_load: the load is complete as it starts.
void Lifecycle::start_load(MatchedPrefix& m, TreeNode* last) {
  const std::int64_t ps = tree_.page_size();
  const std::vector<TreeNode*> nodes = tree_.host_only_path(last, m.lock);
  std::int64_t total = 0;
  for (const TreeNode* n : nodes) total += n->num_tokens();
  const std::int64_t num_pages = total / ps;
  const std::int64_t num_tokens = num_pages * ps;
  if (num_tokens < config_.load_threshold_tokens) {
    c_.loads_refused_by_threshold += 1;
    c_.host_hit_refused_tokens += num_tokens;
    return;
  }
  // Pinned while a write-back eviction (which may evict host pages) makes room.
  const bool pin = config_.write_policy == WritePolicy::WriteBack;
  if (pin) {
    for (TreeNode* n : nodes) tree_.host_lock(n);
  }
  const std::optional<at::Tensor> pages = alloc_device(num_pages);
  if (!pages) {
    if (pin) {
      for (TreeNode* n : nodes) tree_.host_unlock(n);
    }
    c_.loads_refused_no_space += 1;
    c_.host_hit_refused_tokens += num_tokens;
    return;
  }
  std::int64_t off = 0;
  for (TreeNode* n : nodes) {
    const std::int64_t k = n->num_tokens() / ps;
    tree_.attach_device(n, IndexRun{*pages, off, k});
    if (pin) tree_.host_unlock(n);
    off += k;
  }
  tree_.lock(nodes.back());
  tree_.unlock(m.lock);
  m.lock = nodes.back();
  m.prefix_len += num_tokens;
  c_.loads += 1;
  c_.host_hit_tokens += num_tokens;
  c_.load_bytes += num_pages * config_.page_nbytes;
}

// HiCache._alloc_device (nothing is ever in flight here: no wait_all). Every
// unlocked device page can be evicted, so the check up front is exact: a
// refused allocation evicts nothing, an accepted one succeeds.
std::optional<at::Tensor> Lifecycle::alloc_device(std::int64_t num_pages) {
  if (num_pages < 0) throw ValueError("num_pages: expected >= 0, got " + std::to_string(num_pages));
  OpScope scope(tree_);
  if (num_pages > device_.num_free()) {
    if (num_pages > device_.num_free() + tree_.device_evictable_tokens / tree_.page_size()) {
      return std::nullopt;
    }
    // Write-back frees a chain leaf by leaf (a parent is a leaf once its child's
    // backup landed): one round per level, until a round frees nothing.
    while (num_pages > device_.num_free()) {
      const std::int64_t before = device_.num_free();
      evict_device(num_pages - before);
      if (device_.num_free() == before) break;
    }
  }
  if (num_pages > device_.num_free()) return std::nullopt;
  at::Tensor pages = new_page_tensor(num_pages);
  device_.alloc(num_pages, pages.data_ptr<page_id_t>());
  return pages;
}

// HiCache._evict_device; the poll that applies write-back backups is finish_backups.
void Lifecycle::evict_device(std::int64_t num_pages) {
  if (num_pages <= 0) return;
  const bool write_back = config_.write_policy == WritePolicy::WriteBack && config_.has_host_tier;
  // The ancestors lacking a host copy are backed up with the node (a host copy
  // implies host copies of every ancestor) and stay on the device.
  const RadixTree::BackupHook hook = [this](TreeNode* node) {
    return start_backup(tree_.path_missing_host(node, 0), node);
  };
  // Whatever happens, no record outlives this call (its nodes could be freed later).
  struct Clear {
    std::vector<PendingBackup>& pending;
    ~Clear() { pending.clear(); }
  } clear{pending_};
  const EvictOut r = tree_.evict_device(num_pages * tree_.page_size(), write_back ? &hook : nullptr);
  if (r.num_evicted_tokens != 0) {
    free_device(r.pages);
    c_.device_evicted_tokens += r.num_evicted_tokens;
  }
  if (r.num_backup_tokens != 0) finish_backups();
}

// HiCache.poll applying completed write-back backups (HiCache._finish_backup).
// Each record holds the one node the eviction handed over: BACKING_UP, it is no
// eviction candidate on either tier, so nothing splits or merges it meanwhile
// (HiCache follows such splits for transfers that really run).
void Lifecycle::finish_backups() {
  for (const PendingBackup& rec : pending_) {
    TreeNode* n = rec.node;
    if (n->io_status != IOStatus::BackingUp || n->parent == nullptr) {
      throw std::logic_error("write-back: the node of a pending backup changed meanwhile");
    }
    tree_.set_io_status(n, IOStatus::None);
    c_.backup_bytes += rec.nbytes;
    if (n->lock_ref == 0 && n->num_device_children == 0) {
      c_.device_evicted_tokens += n->num_tokens();
      free_device(tree_.detach_device(n));
    }
  }
  pending_.clear();
}

// HiCache._alloc_host.
std::optional<at::Tensor> Lifecycle::alloc_host(std::int64_t num_pages) {
  const std::int64_t ps = tree_.page_size();
  const std::int64_t missing = num_pages - host_.num_free();
  // HiCache._host_takeable_pages: a host copy being written (a write-back backup
  // pending in this eviction) or host-locked is not taken, nor are the host
  // copies above it; the tree keeps that figure exact.
  if (missing > tree_.host_takeable_tokens / ps) return std::nullopt;
  if (missing > 0) {
    const EvictOut r = tree_.evict_host(missing * ps, true);
    if (r.num_evicted_tokens != 0) {
      free_host(r.pages);
      c_.host_evicted_tokens += r.num_evicted_tokens;
    }
  }
  if (num_pages > host_.num_free()) return std::nullopt;
  at::Tensor pages = new_page_tensor(num_pages);
  host_.alloc(num_pages, pages.data_ptr<page_id_t>());
  return pages;
}

// HiCache._backup_path.
void Lifecycle::backup_path(TreeNode* node) {
  if (!config_.has_host_tier) return;
  const std::int64_t threshold =
      config_.write_policy == WritePolicy::WriteThroughSelective ? config_.backup_hit_threshold : 0;
  const std::vector<TreeNode*> todo = tree_.path_missing_host(node, threshold);
  if (!todo.empty()) start_backup(todo, nullptr);
}

// HiCache._start_backup: `nodes` is one path, root side first. Stops at the
// first node whose parent has no host copy, or that the host tier
// cannot take. Write-through backups complete as they start; the backup of
// `evict` (write-back) is applied when the eviction returns. True if the
// backup of `evict` started.
bool Lifecycle::start_backup(const std::vector<TreeNode*>& nodes, TreeNode* evict) {
  const std::int64_t ps = tree_.page_size();
  std::vector<TreeNode*> started;
  std::int64_t sync_pages = 0;
  std::int64_t evict_pages = 0;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    TreeNode* n = nodes[i];
    TreeNode* parent = n->parent;
    if (parent->parent != nullptr && !parent->on_host()) break;
    const std::int64_t k = n->num_tokens() / ps;
    // Making room must not take the parent's host copy (a host-eviction candidate
    // while its children have none): n's copy needs it.
    const bool guard = parent->parent != nullptr && k > host_.num_free();
    if (guard) tree_.host_lock(parent);
    std::optional<at::Tensor> pages;
    try {
      pages = alloc_host(k);
    } catch (...) {
      if (guard) tree_.host_unlock(parent);
      throw;
    }
    if (guard) tree_.host_unlock(parent);
    if (!pages) {
      c_.backups_skipped += static_cast<std::int64_t>(nodes.size() - i);
      break;
    }
    tree_.attach_host(n, IndexRun{*pages, 0, k});
    if (n == evict) {
      tree_.set_io_status(n, IOStatus::BackingUp);
      evict_pages = k;
    } else {
      sync_pages += k;
    }
    started.push_back(n);
  }
  if (started.empty()) return false;
  c_.backups += 1;
  c_.backup_bytes += sync_pages * config_.page_nbytes;
  if (evict == nullptr || started.back() != evict) return false;
  pending_.push_back({evict, evict_pages * config_.page_nbytes});
  return true;
}

// HiCache.insert, its checks included (same order, same messages).
std::optional<InsertedPath> Lifecycle::insert(token_span key, std::uint32_t ns, TreeNode* lock,
                                              const IndexRun* owned, token_span prefix_key,
                                              std::int64_t prefix_len) {
  OpScope scope(tree_);
  const std::int64_t ps = tree_.page_size();
  if (prefix_len < 0 || prefix_len > static_cast<std::int64_t>(prefix_key.size())) {
    throw ValueError("insert: prefix_len " + std::to_string(prefix_len) + " outside the prefix key");
  }
  if (static_cast<std::int64_t>(key.size()) < prefix_len ||
      !std::equal(prefix_key.begin(), prefix_key.begin() + prefix_len, key.begin())) {
    throw ValueError("insert: tokens must start with the handle's " + std::to_string(prefix_len) +
                     "-token prefix");
  }
  const auto num_pages = static_cast<std::int64_t>(key.size()) / ps;
  const std::int64_t num_prefix_pages = prefix_len / ps;
  const std::int64_t num_owned = owned != nullptr ? owned->num_pages : 0;
  if (num_pages > num_prefix_pages + num_owned) {
    throw ValueError("insert: " + std::to_string(num_pages) +
                     " whole pages of tokens, but the handle holds only " +
                     std::to_string(num_prefix_pages + num_owned) + " pages (alloc more first)");
  }
  if (num_pages == num_prefix_pages) return std::nullopt;
  const at::Tensor table = tree_.device_indices_of(lock, owned);
  if (table.size(0) != num_prefix_pages + num_owned) {
    throw std::logic_error("insert: the locked path holds " +
                           std::to_string(table.size(0) - num_owned) + " pages, the prefix " +
                           std::to_string(num_prefix_pages));
  }
  const InsertOut r = tree_.insert(key, IndexRun{table, 0, num_pages}, ns);
  const std::int64_t cached_pages = r.num_cached_tokens / ps;
  if (cached_pages > num_prefix_pages) {  // cached meanwhile by someone else: ours are spare
    free_device(table.narrow(0, num_prefix_pages, cached_pages - num_prefix_pages));
  }
  tree_.lock(r.last);
  tree_.unlock(lock);
  const std::int64_t new_tokens = (num_pages - cached_pages) * ps;
  c_.inserted_tokens += new_tokens;
  if (config_.write_policy != WritePolicy::WriteBack) backup_path(r.last);
  return InsertedPath{r.last, new_tokens, table.narrow(0, num_pages, table.size(0) - num_pages)};
}

// HiCache.release for a handle owning at most one run of pages.
void Lifecycle::release(TreeNode* lock, const IndexRun* owned) {
  OpScope scope(tree_);
  tree_.unlock(lock);
  if (owned != nullptr && owned->num_pages != 0) device_.free(owned->data(), owned->num_pages);
}

std::array<std::int64_t, kLifecycleCounterNames.size()> Lifecycle::take_counters() {
  const Counters c = c_;
  c_ = Counters{};
  return {c.requests,
          c.requested_tokens,
          c.device_hit_tokens,
          c.host_hit_tokens,
          c.host_hit_refused_tokens,
          c.loads_refused_by_threshold,
          c.loads_refused_no_space,
          c.loads,
          c.load_bytes,
          c.backups,
          c.backups_skipped,
          c.backup_bytes,
          c.device_evicted_tokens,
          c.host_evicted_tokens,
          c.inserted_tokens};
}

void Lifecycle::free_device(const at::Tensor& pages) {
  device_.free(pages.const_data_ptr<page_id_t>(), pages.size(0));
}

void Lifecycle::free_host(const at::Tensor& pages) {
  host_.free(pages.const_data_ptr<page_id_t>(), pages.size(0));
}

}  // namespace hicache
