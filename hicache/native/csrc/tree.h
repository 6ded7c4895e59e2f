// The native radix tree: the same contract as hicache/tree/python/ (read its package
// docstring), operation for operation, so that matches, evictions and their
// page order come out identical. Heap entries are pushed at exactly the points
// where the Python tree calls _refresh, and ties are broken by the same seqs.
//
// Hooks (on_split, the backup hook of evict_device) run in the middle of an
// operation. They may read the tree; the backup hook may also make the calls a
// write-back backup needs (host_lock, host_unlock, attach_host, set_io_status,
// evict_host); every other tree-changing call from inside a hook raises
// ReentryError (check_reentry), before it changes anything, exactly as the
// Python tree does. Nodes removed by an operation are still parked in a
// graveyard until the outermost operation returns, so that no pointer an outer
// loop holds dangles. Removed nodes whose handles reached Python are detached
// instead: readable (like a removed Python node) until released.
//
// One tree is used by one thread at a time: the binding takes op_mutex() (a
// recursive mutex: hooks re-enter on the same thread) around every call.
//
// Knows nothing of Python: callbacks are std::function, errors are the
// ValueError / TypeError types of common.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.h"
#include "components.h"
#include "heap.h"
#include "node.h"

namespace hicache {

struct MatchOut {
  std::int64_t device_len;  // leading tokens whose KV is on the device
  std::int64_t host_len;    // tokens after those whose KV is only in host memory
  TreeNode* last_device;    // deepest matched node on the device (a root if none)
  TreeNode* last;           // deepest matched node
  std::int64_t full_len;    // the full-attention match (more than the two above: components)
};

struct InsertOut {
  std::int64_t num_cached_tokens;  // leading tokens already on the device
  TreeNode* last;                  // node ending at the inserted length
};

struct EvictOut {
  at::Tensor pages;  // (num_pages,) int64: pages given up, in eviction order
  std::int64_t num_evicted_tokens;
  std::int64_t num_backup_tokens;
};

// One KV event (hicache/events.py): a node's pages entering or leaving a tier.
struct RawEvent {
  bool stored;                        // true: entered the tier; false: left it
  bool device;                        // the tier: device (true) or host (false)
  // the namespace's name (null: the default one), kept past the namespace's root
  std::shared_ptr<const std::string> ns;
  std::optional<std::uint64_t> parent;  // hash of the page before the first (none at a root)
  std::vector<std::uint64_t> hashes;  // chained hash of each page
  std::int64_t num_tokens;
};

// Chained page hashes of `tokens` (whole pages) after `prev`: hicache/events.py page_hashes.
std::vector<std::uint64_t> page_hashes(token_span tokens, std::int64_t page_size,
                                       std::uint64_t prev);

class RadixTree {
 public:
  using SplitHook = std::function<void(TreeNode* prefix, TreeNode* suffix)>;
  using BackupHook = std::function<bool(TreeNode*)>;
  // The hook running now, if any (the innermost one).
  enum class Hook : std::uint8_t { None, Split, Backup };

  // `components`: a hybrid tree's components (components.h), empty for a single-kind tree.
  RadixTree(std::int64_t page_size, EvictionPolicy policy,
            std::vector<ComponentKind> components = {});
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  std::int64_t page_size() const { return page_size_; }

  // Raise ReentryError when `op` (a tree-changing call) is made from inside a
  // hook that may not make it: on_split may make none, the backup hook only
  // those with `backup_may` (see the header comment). The words are those of
  // hicache/tree/guards.py reentry_message.
  void check_reentry(const char* op, bool backup_may = false) const;
  bool in_hook() const { return hook_ != Hook::None; }
  // Held by the binding around every call (see the header comment).
  std::recursive_mutex& op_mutex() const { return op_mutex_; }

  // Namespaces: index of a namespace (nullopt = the default one), its root
  // created on first use; roots keep creation order, like the Python dict. A
  // namespace's root (and its name) is freed once it holds no node and no lock
  // taken on the root itself (hicache/tree/python/state.py): when its last child
  // is removed, when that last lock goes, or by prune_namespaces. Its index is
  // then reused; its root's handle never is. The default namespace's root stays.
  std::uint32_t namespace_index(const std::optional<std::string>& ns);
  std::optional<std::uint32_t> find_namespace(const std::optional<std::string>& ns) const;
  TreeNode* root(std::uint32_t ns) { return roots_[ns].get(); }
  // The name of a live node's namespace (null: the default one).
  const std::shared_ptr<const std::string>& namespace_name(std::uint32_t ns) const {
    return ns_names_[ns];
  }
  // The namespace name of a live or detached node (null: the default one).
  std::shared_ptr<const std::string> node_namespace(const TreeNode* node) const;
  // The namespaces that have a root (nullopt: the default one), oldest root first.
  std::vector<std::optional<std::string>> namespaces() const;
  // Free every namespace root that holds no node and no lock; how many.
  std::int64_t prune_namespaces();

  // The live node of a handle, or nullptr if it was removed (or never existed).
  TreeNode* find(NodeHandle handle) const;
  // A live node, or a removed one still readable from Python (detached), or nullptr.
  TreeNode* find_any(NodeHandle handle) const;
  // Free every detached node except those in `keep` (Python still holds their proxies).
  void release_detached(const std::vector<NodeHandle>& keep);
  std::size_t num_detached() const { return detached_.size(); }

  // `unchecked` (match, insert): the caller's whole token array (the key, then
  // any partial page) when its ids were not checked yet; the call checks them
  // (ValueError, check_ids) after walking the tree and before changing anything,
  // and skips the matched prefix when every token the tree stores is a valid id
  // (that prefix equals stored tokens): the matched tokens are read once.
  MatchOut match(token_span key, std::uint32_t ns, token_span unchecked = {});
  // `borrowed`: `pages` is the caller's tensor, which the tree must not keep
  // (the windows it keeps are copied, before any hook runs); else the tree
  // keeps windows of it (IndexRun::owned).
  InsertOut insert(token_span key, const IndexRun& pages, std::uint32_t ns,
                   token_span unchecked = {}, bool borrowed = false);
  // Pages that arrive only in host memory (a third tier): the uncached rest
  // becomes one host-only leaf; num_cached_tokens counts both tiers.
  InsertOut insert_host(token_span key, const IndexRun& pages, std::uint32_t ns);
  // Tokens of key cached in any tier: no split, no hit, no access time changed.
  // With `path`, also the nodes holding them, root side first (the last may
  // hold more than the key).
  std::int64_t probe(token_span key, std::optional<std::uint32_t> ns,
                     std::vector<TreeNode*>* path = nullptr) const;

  void lock(TreeNode* node);
  void unlock(TreeNode* node);
  void host_lock(TreeNode* node);
  void host_unlock(TreeNode* node);
  // Raise node's and its ancestors' priority to at least `priority` (never lowers).
  void raise_priority(TreeNode* node, std::int64_t priority);

  void set_io_status(TreeNode* node, IOStatus status);
  void attach_device(TreeNode* node, const IndexRun& pages);
  at::Tensor detach_device(TreeNode* node);
  void attach_host(TreeNode* node, const IndexRun& pages);
  at::Tensor detach_host(TreeNode* node);

  EvictOut evict_device(std::int64_t num_tokens, const BackupHook* backup);
  EvictOut evict_host(std::int64_t num_tokens, bool drop_device_resident);

  // The path's device pages, then `extra` (if any): one request's page table.
  at::Tensor device_indices_of(TreeNode* node, const IndexRun* extra = nullptr) const;
  // Nodes on node's path (root side first) a backup would copy: on the device,
  // no host copy, no IO in flight, at least min_hit_count hits.
  std::vector<TreeNode*> path_missing_host(TreeNode* node, std::int64_t min_hit_count) const;
  // The host-only nodes of a match (below last_device down to last), root side first.
  std::vector<TreeNode*> host_only_path(TreeNode* last, const TreeNode* last_device) const;
  std::vector<TreeNode*> nodes() const;  // non-root nodes, parents before children

  // KV events: off until enabled; take_events drains the log in order.
  void enable_events() { events_on_ = true; }
  std::vector<RawEvent> take_events() { return std::exchange(events_, {}); }
  // (parent hash, page hashes) of a node's pages (hashed from the root).
  std::pair<std::optional<std::uint64_t>, std::vector<std::uint64_t>> node_hashes(TreeNode* node);

  // --- Components (components.cpp; hicache/tree/python/hybrid*.py, the reference).
  const std::vector<ComponentKind>& components() const { return comps_; }
  bool has_components() const { return !comps_.empty(); }
  // insert / insert_host, then each component keeps the given ids at the hit ends
  // (one run per component, undefined: none given, -1: a page not given); returns
  // the given ids not taken.
  std::pair<InsertOut, at::Tensor> insert_components(token_span key, const IndexRun& pages,
                                                     std::uint32_t ns,
                                                     const std::vector<IndexRun>& given);
  std::pair<InsertOut, at::Tensor> insert_host_components(token_span key, const IndexRun& pages,
                                                          std::uint32_t ns,
                                                          const std::vector<IndexRun>& given);
  // Tokens of key a match would serve, read-only.
  std::int64_t probe_hit(token_span key, std::optional<std::uint32_t> ns) const;
  void attach_component(TreeNode* node, std::size_t c, bool host, const IndexRun& pages);
  at::Tensor detach_component(TreeNode* node, std::size_t c, bool host);
  // Component c's data only, in its heap's order, until num_pages ids are freed.
  EvictOut evict_component(std::size_t c, bool host, std::int64_t num_pages);
  // Component c's ids in a tier along the path root..node, per token page (-1: none).
  at::Tensor component_table(TreeNode* node, std::size_t c, bool host) const;
  std::int64_t num_component_pages(std::size_t c, bool host) const {
    return comp_counts_[c][host ? 1 : 0];
  }

  // "" if every invariant holds, else the first violation (Python asserts on it).
  std::string check_integrity() const;
  // Bytes the tree holds: nodes, maps, heaps, token storage and index storage
  // (every storage counted once, however many nodes share it).
  std::size_t memory_bytes() const;

  // Counters (plain fields so that corruption tests can overwrite them).
  std::int64_t num_nodes = 0;
  std::int64_t device_evictable_tokens = 0;  // on device, lock_ref == 0
  std::int64_t device_protected_tokens = 0;  // on device, lock_ref > 0
  std::int64_t host_evictable_tokens = 0;    // on host, host_lock_ref == 0
  std::int64_t host_protected_tokens = 0;    // on host, host_lock_ref > 0
  // On host and not busy (TreeNode::num_busy_host_children): exactly the host
  // tokens evict_host can take, leaf by leaf, while nothing else changes.
  std::int64_t host_takeable_tokens = 0;
  // Component page ids on unlocked device nodes; those evict_host can take now.
  std::int64_t device_component_evictable_pages = 0;
  std::int64_t host_component_takeable_pages = 0;

  SplitHook on_split;

 private:
  friend struct OpScope;
  friend struct HookScope;

  TreeNode* new_child(TreeNode* parent, TokenRun tokens);
  bool call_backup(const BackupHook& backup, TreeNode* node);  // under Hook::Backup
  TreeNode* split(TreeNode* node, std::int64_t num_pages);
  void remove(TreeNode* node);
  void retire(std::unique_ptr<TreeNode> node);
  // Free `root` (its namespace's state) if it holds no node and no lock; true if freed.
  bool free_if_empty(TreeNode* root);
  void rehome_tokens(TreeNode* node);  // copy a node's tokens into storage of their own size
  // Absorb node's only child when both are idle and host-only
  // (hicache/tree/python/eviction.py _merge_host_chain): a reload of an evicted
  // conversation chain is one node.
  void merge_host_chain(TreeNode* node);
  std::int64_t common_pages(token_span child, token_span rest) const;
  // Where a key's walk down from `from` ends, read-only: the nodes it enters
  // (root side first) and the tokens it matches. When the key ends or differs
  // inside the last node, split_pages > 0: where match and insert split it
  // (nothing below it can match then).
  struct Walk {
    c10::SmallVector<TreeNode*, 64> path;
    std::int64_t split_pages = 0;
    std::size_t matched = 0;
  };
  void walk(TreeNode* from, token_span key, Walk& w) const;
  // match's and insert's check of their `unchecked` ids (see match).
  void check_unchecked(token_span unchecked, std::size_t matched) const;

  int device_rank(const TreeNode* node) const;
  int host_rank(const TreeNode* node) const;
  HeapEntry entry(const TreeNode* node, int rank, std::uint64_t seq) const;
  void push_device(TreeNode* node, int rank);
  void push_host(TreeNode* node, int rank);
  TreeNode* pop_device();
  TreeNode* pop_host();
  void refresh(TreeNode* node);
  // Re-key a host candidate inside a matched or inserted path (on both tiers,
  // children only on the device): its access time changed.
  void refresh_inner_host(TreeNode* node);
  // True if host eviction can never take node's host copy as things stand.
  static bool host_busy(const TreeNode* node);
  // Account a change of node's host copy, host lock or IO status (its state
  // before: was_on_host, was_busy): the parent's num_host_children, the
  // ancestors' num_busy_host_children and host_takeable_tokens; a parent left
  // without host children is refreshed.
  void host_changed(TreeNode* node, bool was_on_host, bool was_busy);
  void maybe_compact();
  void compact();

  at::Tensor concat(const std::vector<IndexRun>& runs) const;
  void log_event(bool stored, bool device, TreeNode* node);
  std::string check_components() const;  // the components' invariants (components.cpp)

  // What one eviction call gave up so far (hicache/tree/python/eviction.py EvictTally).
  struct EvictTally {
    std::vector<IndexRun> freed;
    std::int64_t num_freed = 0;
    std::int64_t num_backup = 0;
    std::vector<TreeNode*> skipped;
  };
  // One eviction step on a popped candidate; the pages it counts against `need`.
  std::int64_t evict_device_node(TreeNode* node, std::int64_t need, const BackupHook* backup,
                                 EvictTally& tally);
  std::int64_t evict_host_node(TreeNode* node, std::int64_t need, EvictTally& tally);
  EvictOut tally_result(EvictTally& tally) const;

  // --- Components' bookkeeping (components.cpp).
  struct PathStep {
    TreeNode* node;
    std::int64_t num_pages;  // its pages on the path
    bool inside;             // the path ends inside it (the prefix of a split there)
  };
  void make_records(TreeNode* node);
  void set_data(TreeNode* node, std::size_t c, bool host, IndexRun ids);
  // Cascade: the node's full copy left a tier; its component data goes too (appended).
  std::int64_t drop_components(TreeNode* node, bool host, std::vector<IndexRun>& freed);
  std::int64_t component_pages_on(const TreeNode* node, bool host) const;
  void split_components(TreeNode* prefix, TreeNode* suffix, std::int64_t num_pages);
  int record_rank(const TreeNode* node, std::size_t c, bool host) const;
  bool unusable(const TreeNode* node, std::size_t c, bool host) const;
  HeapEntry record_entry(const TreeNode* node, std::size_t c, int rank, std::uint64_t seq) const;
  void push_record(TreeNode* node, std::size_t c, bool host);
  void refresh_records(TreeNode* node);
  void touch(TreeNode* node, std::size_t c);
  static bool host_free(const TreeNode* node) {
    return node->host_lock_ref == 0 && node->io_status == IOStatus::None;
  }
  void host_free_changed(TreeNode* node, bool was_free);
  std::pair<int, int> servable(const std::vector<PathStep>& path, std::size_t num_device) const;
  MatchOut serve(const MatchOut& full, std::uint32_t ns);
  void touch_hit(const std::vector<PathStep>& path, int i);
  at::Tensor adopt(TreeNode* last, const std::vector<IndexRun>& given, bool host);
  std::vector<TreeNode*> path_of(TreeNode* node) const;  // non-root nodes, root side first
  // The heaps' tops: the best live candidate, stale entries above it dropped.
  std::optional<HeapEntry> peek_device();
  std::optional<HeapEntry> peek_host();
  std::optional<std::pair<HeapEntry, std::size_t>> best_component(bool host);
  bool peek_record(std::size_t c, bool host);  // drops stale tops; true if a candidate is left
  std::int64_t evict_record(std::size_t c, bool host, EvictTally& tally);
  EvictOut evict_device_hybrid(std::int64_t need, const BackupHook* backup);
  EvictOut evict_host_hybrid(std::int64_t need, bool drop_device_resident);
  std::vector<TreeNode*> path_missing_host_hybrid(TreeNode* node,
                                                  std::int64_t min_hit_count) const;
  void compact_components(const std::vector<TreeNode*>& all);

  std::int64_t page_size_;
  EvictionPolicy policy_;
  // Per namespace index: its root (null: a free index) and its name (null: the
  // default namespace, or a free index). The name is held once: ns_index_'s keys
  // view it, and events and detached nodes share it.
  std::vector<std::unique_ptr<TreeNode>> roots_;
  std::vector<std::shared_ptr<const std::string>> ns_names_;
  std::vector<std::uint32_t> free_ns_;  // free indices
  // Live roots in creation order: serial (its root's handle is -serial) -> index.
  std::map<std::int64_t, std::uint32_t> root_order_;
  std::int64_t next_root_serial_ = 1;
  std::optional<std::uint32_t> default_ns_;
  std::unordered_map<std::string_view, std::uint32_t> ns_index_;
  // The namespace names of detached nodes (their index may have been reused).
  std::unordered_map<NodeHandle, std::shared_ptr<const std::string>> detached_ns_;
  std::unordered_map<NodeHandle, TreeNode*> by_handle_;  // live non-root nodes
  std::int64_t next_id_ = 1;
  std::int64_t clock_ = 0;
  CandidateHeap device_heap_;
  CandidateHeap host_heap_;
  int depth_ = 0;  // operations in progress (re-entrant through hooks)
  Hook hook_ = Hook::None;
  mutable std::recursive_mutex op_mutex_;
  std::vector<std::unique_ptr<TreeNode>> graveyard_;
  // Removed nodes whose handles reached Python: like a removed Python TreeNode, they
  // stay readable (parent None) until the wrapper releases them.
  std::unordered_map<NodeHandle, std::unique_ptr<TreeNode>> detached_;
  at::Tensor empty_roots_indices_;
  bool events_on_ = false;
  std::vector<RawEvent> events_;
  std::vector<ComponentKind> comps_;  // empty: a single-kind tree
  // False once a stored token is not a valid id (a key given as bytes is stored
  // unchecked, as the Python tree stores it): check_unchecked then checks all.
  bool stored_ids_valid_ = true;
  std::vector<CandidateHeap> comp_heaps_[2];  // per tier (device, host), per component
  std::vector<std::array<std::int64_t, 2>> comp_counts_;  // page ids held: device, host
};

// Marks a hook running (restores the outer state however the hook returns).
struct HookScope {
  HookScope(RadixTree& t, RadixTree::Hook h) : tree(t), prev(t.hook_) { tree.hook_ = h; }
  ~HookScope() { tree.hook_ = prev; }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;
  RadixTree& tree;
  RadixTree::Hook prev;
};

// Marks an operation in progress; the outermost one frees the graveyard.
struct OpScope {
  explicit OpScope(RadixTree& t) : tree(t) { ++tree.depth_; }
  ~OpScope() {
    if (--tree.depth_ == 0) tree.graveyard_.clear();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;
  RadixTree& tree;
};

}  // namespace hicache
