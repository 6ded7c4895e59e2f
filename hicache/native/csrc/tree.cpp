// The native radix tree (tree.h): each operation mirrors its Python
// counterpart in hicache/tree/python/ step for step, including where heap entries
// are pushed, so that eviction order and returned page order are identical.
#include "tree.h"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

#include <cstring>
#include <unordered_set>

namespace hicache {
namespace {

void link_last(TreeNode* parent, TreeNode* child) {
  child->prev_sibling = parent->last_child;
  child->next_sibling = nullptr;
  if (parent->last_child != nullptr) {
    parent->last_child->next_sibling = child;
  } else {
    parent->first_child = child;
  }
  parent->last_child = child;
}

void unlink(TreeNode* parent, TreeNode* child) {
  if (child->prev_sibling != nullptr) {
    child->prev_sibling->next_sibling = child->next_sibling;
  } else {
    parent->first_child = child->next_sibling;
  }
  if (child->next_sibling != nullptr) {
    child->next_sibling->prev_sibling = child->prev_sibling;
  } else {
    parent->last_child = child->prev_sibling;
  }
  child->prev_sibling = child->next_sibling = nullptr;
}

// `fresh` takes `old`'s place in the sibling order (a dict value replaced in place).
void replace_link(TreeNode* parent, TreeNode* old, TreeNode* fresh) {
  fresh->prev_sibling = old->prev_sibling;
  fresh->next_sibling = old->next_sibling;
  if (old->prev_sibling != nullptr) {
    old->prev_sibling->next_sibling = fresh;
  } else {
    parent->first_child = fresh;
  }
  if (old->next_sibling != nullptr) {
    old->next_sibling->prev_sibling = fresh;
  } else {
    parent->last_child = fresh;
  }
  old->prev_sibling = old->next_sibling = nullptr;
}

void internal_check(bool ok, const char* what) {
  if (!ok) throw std::logic_error(std::string("hicache native tree invariant violated: ") + what);
}

std::string ns_repr(const std::shared_ptr<const std::string>& ns) {
  return ns ? "'" + *ns + "'" : "None";
}

// glibc malloc: 8 bytes of header, 16-byte granules, 32 bytes at least.
std::size_t malloc_bytes(std::size_t n) {
  return std::max<std::size_t>(32, (n + 8 + 15) & ~std::size_t{15});
}

}  // namespace

RadixTree::RadixTree(std::int64_t page_size, EvictionPolicy policy,
                     std::vector<ComponentKind> components)
    : page_size_(page_size), policy_(policy), comps_(std::move(components)) {
  if (page_size <= 0 || page_size > kMaxPageSize) {
    throw ValueError("page_size: expected an int in [1, 2**24], got " + std::to_string(page_size));
  }
  for (auto& heaps : comp_heaps_) heaps.resize(comps_.size());
  comp_counts_.assign(comps_.size(), {0, 0});
}

void RadixTree::check_reentry(const char* op, bool backup_may) const {
  if (hook_ == Hook::None || (hook_ == Hook::Backup && backup_may)) return;
  if (hook_ == Hook::Split) {
    throw ReentryError(std::string(op) +
                       ": called from inside the on_split hook, which may only read the tree");
  }
  throw ReentryError(std::string(op) +
                     ": called from inside the backup hook, which may only read the tree and "
                     "call host_lock, host_unlock, attach_host, set_io_status and evict_host");
}

// ------------------------------------------------------------------- basics
std::uint32_t RadixTree::namespace_index(const std::optional<std::string>& ns) {
  if (!ns) {
    if (default_ns_) return *default_ns_;
  } else if (auto it = ns_index_.find(std::string_view(*ns)); it != ns_index_.end()) {
    return it->second;
  }
  std::uint32_t k = 0;
  if (!free_ns_.empty()) {
    k = free_ns_.back();
    free_ns_.pop_back();
  } else {
    k = static_cast<std::uint32_t>(roots_.size());
    roots_.emplace_back();
    ns_names_.emplace_back();
  }
  const std::int64_t serial = next_root_serial_++;
  auto root = std::make_unique<TreeNode>(0, -static_cast<NodeHandle>(serial), nullptr, k);
  auto empty = at::empty({0}, at::kLong);
  root->device = IndexRun{empty, 0, 0};
  root->host = IndexRun{empty, 0, 0};
  // Roots are never evicted; a lock taken on the root itself (a request that
  // matched nothing) counts on top, and holds the namespace's root.
  root->lock_ref = 1;
  if (has_components()) make_records(root.get());
  roots_[k] = std::move(root);
  if (ns) {
    auto name = std::make_shared<const std::string>(*ns);
    ns_index_.emplace(std::string_view(*name), k);
    ns_names_[k] = std::move(name);
  } else {
    default_ns_ = k;
  }
  root_order_.emplace(serial, k);
  return k;
}

bool RadixTree::free_if_empty(TreeNode* root) {
  const std::uint32_t k = root->ns;
  if (root->parent != nullptr || (default_ns_ && *default_ns_ == k) || !root->children.empty() ||
      root->lock_ref != 1 || k >= roots_.size() || roots_[k].get() != root) {
    return false;
  }
  ns_index_.erase(std::string_view(*ns_names_[k]));
  root_order_.erase(-root->handle);
  root->lock_ref = 0;  // a freed root: stale from now on
  retire(std::move(roots_[k]));  // (before its name goes: a detached root keeps it)
  ns_names_[k].reset();
  free_ns_.push_back(k);
  return true;
}

std::int64_t RadixTree::prune_namespaces() {
  check_reentry("prune_namespaces");
  OpScope scope(*this);
  std::vector<TreeNode*> empty;
  for (const auto& [serial, k] : root_order_) {
    TreeNode* root = roots_[k].get();
    if (!(default_ns_ && *default_ns_ == k) && root->children.empty() && root->lock_ref == 1) {
      empty.push_back(root);
    }
  }
  for (TreeNode* root : empty) free_if_empty(root);
  return static_cast<std::int64_t>(empty.size());
}

std::vector<std::optional<std::string>> RadixTree::namespaces() const {
  std::vector<std::optional<std::string>> out;
  out.reserve(root_order_.size());
  for (const auto& [serial, k] : root_order_) {
    if (ns_names_[k]) {
      out.emplace_back(*ns_names_[k]);
    } else {
      out.emplace_back(std::nullopt);
    }
  }
  return out;
}

std::shared_ptr<const std::string> RadixTree::node_namespace(const TreeNode* node) const {
  const std::uint32_t k = node->ns;
  const bool live = node->parent != nullptr ? find(node->handle) == node
                                            : k < roots_.size() && roots_[k].get() == node;
  if (live) return ns_names_[k];
  const auto it = detached_ns_.find(node->handle);
  return it == detached_ns_.end() ? nullptr : it->second;
}

std::optional<std::uint32_t> RadixTree::find_namespace(const std::optional<std::string>& ns) const {
  if (!ns) return default_ns_;
  const auto it = ns_index_.find(std::string_view(*ns));
  if (it == ns_index_.end()) return std::nullopt;
  return it->second;
}

TreeNode* RadixTree::find(NodeHandle handle) const {
  if (handle < 0) {
    const auto it = root_order_.find(-handle);
    return it == root_order_.end() ? nullptr : roots_[it->second].get();
  }
  const auto it = by_handle_.find(handle);
  return it == by_handle_.end() ? nullptr : it->second;
}

TreeNode* RadixTree::find_any(NodeHandle handle) const {
  if (TreeNode* node = find(handle); node != nullptr) return node;
  const auto it = detached_.find(handle);
  return it == detached_.end() ? nullptr : it->second.get();
}

std::vector<TreeNode*> RadixTree::nodes() const {
  std::vector<TreeNode*> out;
  out.reserve(static_cast<std::size_t>(std::max<std::int64_t>(num_nodes, 0)));
  std::vector<TreeNode*> stack;
  for (const auto& [serial, k] : root_order_) {
    for (TreeNode* c = roots_[k]->first_child; c != nullptr; c = c->next_sibling) {
      stack.push_back(c);
    }
  }
  while (!stack.empty()) {
    TreeNode* node = stack.back();
    stack.pop_back();
    out.push_back(node);
    for (TreeNode* c = node->first_child; c != nullptr; c = c->next_sibling) stack.push_back(c);
  }
  return out;
}

TreeNode* RadixTree::new_child(TreeNode* parent, TokenRun tokens) {
  const std::int64_t id = next_id_++;
  auto owned = std::make_unique<TreeNode>(id, id, parent, parent->ns);
  TreeNode* node = owned.get();
  node->tokens = std::move(tokens);
  if (stored_ids_valid_ && !ids_valid(node->tokens.data, node->tokens.len)) {
    stored_ids_valid_ = false;
  }
  node->created = clock_;
  if (has_components()) make_records(node);
  by_handle_.emplace(id, node);
  parent->children.emplace(node->first_page(page_size_), std::move(owned));
  link_last(parent, node);
  ++num_nodes;
  return node;
}

// ------------------------------------------------------------ match/split
std::int64_t RadixTree::common_pages(token_span child, token_span rest) const {
  // Whole-run hits are the common case: one vectorized memcmp settles them.
  const std::size_t overlap = std::min(child.size(), rest.size());
  if (std::memcmp(child.data(), rest.data(), overlap * sizeof(token_t)) == 0) {
    return static_cast<std::int64_t>(overlap) / page_size_;
  }
  const auto [in_rest, in_child] = std::ranges::mismatch(rest.first(overlap), child.first(overlap));
  return static_cast<std::int64_t>(in_rest - rest.begin()) / page_size_;
}

void RadixTree::walk(TreeNode* node, token_span key, Walk& w) const {
  const auto ps = static_cast<std::size_t>(page_size_);
  std::size_t off = 0;
  const std::size_t n = key.size();
  while (off < n) {
    const auto it = node->children.find(PageKey{key.data() + off, ps});
    if (it == node->children.end()) break;
    TreeNode* child = it->second.get();
    const std::int64_t pages = common_pages(child->tokens.span(), key.subspan(off));
    w.path.push_back(child);
    if (static_cast<std::size_t>(pages) * ps < child->tokens.len) {
      // The key ends or differs inside child (its first page matched: pages >= 1).
      // After the split there, the prefix's only child starts with the page that
      // differs, so the walk ends here.
      w.split_pages = pages;
      off += static_cast<std::size_t>(pages) * ps;
      break;
    }
    node = child;
    off += child->tokens.len;
  }
  w.matched = off;
}

void RadixTree::check_unchecked(token_span unchecked, std::size_t matched) const {
  if (unchecked.empty()) return;
  const std::size_t from = stored_ids_valid_ ? std::min(matched, unchecked.size()) : 0;
  if (!ids_valid(unchecked.data() + from, unchecked.size() - from)) {
    check_ids(unchecked.data(), unchecked.size());  // raises, naming the smallest of all
  }
}

MatchOut RadixTree::match(token_span key, std::uint32_t ns, token_span unchecked) {
  check_reentry("match");
  OpScope scope(*this);
  TreeNode* node = root(ns);
  // Walk first (read-only), check the caller's ids, then change the tree along
  // the walk: the same changes, in the same order, as one pass would make.
  Walk w;
  walk(node, key, w);
  check_unchecked(unchecked, w.matched);
  const std::int64_t clock = ++clock_;
  std::int64_t device_len = 0;
  std::int64_t host_len = 0;
  TreeNode* last_device = node;
  try {
    for (std::size_t i = 0; i < w.path.size(); ++i) {
      TreeNode* child = w.path[i];
      if (i + 1 == w.path.size() && w.split_pages != 0) child = split(child, w.split_pages);
      if (node->on_host() && node->num_host_children == 0) refresh_inner_host(node);
      node = child;
      const auto len = static_cast<std::int64_t>(node->tokens.len);
      node->hit_count += 1;
      node->last_access = clock;
      if (node->on_device()) {
        device_len += len;
        last_device = node;
      } else {
        host_len += len;
      }
    }
  } catch (...) {
    // An on_split hook raised: the nodes touched so far get their heap entries
    // (as below), so the tree stays consistent.
    refresh(last_device);
    if (node != last_device) refresh(node);
    throw;
  }
  // Besides the inner host candidates refreshed above, only these two can be
  // candidates: every other matched node has a device child on the path and a
  // host child (or no host copy). last_device is inner only above a host-only
  // child, which holds its host copy back.
  refresh(last_device);
  if (node != last_device) refresh(node);
  const MatchOut full{device_len, host_len, last_device, node, device_len + host_len};
  return has_components() ? serve(full, ns) : full;
}

TreeNode* RadixTree::split(TreeNode* node, std::int64_t num_pages) {
  const auto ps = static_cast<std::size_t>(page_size_);
  const auto node_pages = static_cast<std::int64_t>(node->tokens.len / ps);
  internal_check(0 < num_pages && num_pages < node_pages, "split point outside the node");
  const std::size_t cut = static_cast<std::size_t>(num_pages) * ps;
  TreeNode* parent = node->parent;
  const std::int64_t id = next_id_++;
  auto owned_prefix = std::make_unique<TreeNode>(id, id, parent, node->ns);
  TreeNode* prefix = owned_prefix.get();
  prefix->tokens = node->tokens.prefix(cut);
  // The parent's entry keeps its key (a view of the same first page, now the
  // prefix's) and its place in the sibling order; only the value changes.
  const auto it = parent->children.find(node->first_page(ps));
  internal_check(it != parent->children.end() && it->second.get() == node, "split: not a child");
  std::unique_ptr<TreeNode> owned_node = std::move(it->second);
  it->second = std::move(owned_prefix);
  replace_link(parent, node, prefix);
  node->tokens = node->tokens.suffix(cut);
  node->parent = prefix;
  prefix->children.emplace(node->first_page(ps), std::move(owned_node));
  link_last(prefix, node);
  by_handle_.emplace(id, prefix);
  ++num_nodes;
  if (node->on_device()) {
    prefix->device = node->device.slice(0, num_pages).owned();
    node->device = node->device.slice(num_pages, node_pages - num_pages).owned();
    prefix->num_device_children = 1;
  }
  if (node->on_host()) {
    prefix->host = node->host.slice(0, num_pages).owned();
    node->host = node->host.slice(num_pages, node_pages - num_pages).owned();
  }
  prefix->lock_ref = node->lock_ref;
  prefix->host_lock_ref = node->host_lock_ref;
  prefix->io_status = node->io_status;
  prefix->hit_count = node->hit_count;
  prefix->last_access = node->last_access;
  prefix->created = node->created;
  prefix->priority = node->priority;
  // The prefix's only child is node, whose host state and busyness the prefix
  // shares: the parent's counters and host_takeable_tokens do not change.
  if (node->on_host()) {
    prefix->num_host_children = 1;
    prefix->num_busy_host_children = host_busy(node) ? 1 : 0;
  }
  if (has_components()) split_components(prefix, node, num_pages);
  if (on_split) {
    HookScope hook(*this, Hook::Split);
    // A copy: the hook may replace on_split while it runs.
    const SplitHook call = on_split;
    call(prefix, node);
  }
  return prefix;
}

// ------------------------------------------------------------------ insert
InsertOut RadixTree::insert(token_span key, const IndexRun& pages, std::uint32_t ns,
                            token_span unchecked, bool borrowed) {
  check_reentry("insert");
  OpScope scope(*this);
  TreeNode* node = root(ns);
  const auto ps = static_cast<std::size_t>(page_size_);
  const std::size_t n = key.size();
  // Walk first (read-only) and check the caller's ids, as match does.
  Walk w;
  walk(node, key, w);
  check_unchecked(unchecked, w.matched);
  // What the insert keeps of the caller's tokens and pages, taken before any
  // hook runs: the host-only nodes on the path adopt their windows of `pages`,
  // a new leaf takes the rest.
  const auto keep = [&pages, borrowed, ps](std::size_t first_token, std::size_t num_tokens) {
    const IndexRun run = pages.slice(static_cast<std::int64_t>(first_token / ps),
                                     static_cast<std::int64_t>(num_tokens / ps));
    return borrowed ? run.copied() : run.owned();
  };
  c10::SmallVector<IndexRun, 4> adopted;
  std::size_t at = 0;
  for (std::size_t i = 0; i < w.path.size(); ++i) {
    const TreeNode* child = w.path[i];
    const std::size_t len = i + 1 == w.path.size() && w.split_pages != 0
                                ? static_cast<std::size_t>(w.split_pages) * ps
                                : child->tokens.len;
    if (!child->on_device()) adopted.push_back(keep(at, len));
    at += len;
  }
  TokenRun rest_tokens;
  IndexRun rest_pages;
  if (w.matched < n) {
    rest_tokens = TokenRun::copy_of(key.subspan(w.matched));
    rest_pages = keep(w.matched, n - w.matched);
  }
  const std::int64_t clock = ++clock_;
  std::size_t off = 0;
  std::int64_t num_cached = 0;
  std::size_t next_adopted = 0;
  try {
    for (std::size_t i = 0; i < w.path.size(); ++i) {
      TreeNode* child = w.path[i];
      if (i + 1 == w.path.size() && w.split_pages != 0) child = split(child, w.split_pages);
      if (node->on_host() && node->num_host_children == 0) refresh_inner_host(node);
      node = child;
      node->last_access = clock;
      const auto len = static_cast<std::int64_t>(node->tokens.len);
      if (!node->on_device()) {  // host-only: adopt the caller's pages
        attach_device(node, adopted[next_adopted++]);
      } else if (num_cached == static_cast<std::int64_t>(off)) {
        num_cached += len;
      }
      off += node->tokens.len;
    }
  } catch (...) {
    refresh(node);  // an on_split hook raised (see match)
    throw;
  }
  if (off < n) {
    TreeNode* parent = node;
    // Touched above and now above a device-only leaf: an inner host candidate.
    if (parent->on_host() && parent->num_host_children == 0) refresh_inner_host(parent);
    node = new_child(parent, std::move(rest_tokens));
    node->device = std::move(rest_pages);
    parent->num_device_children += 1;
    node->last_access = clock;
    device_evictable_tokens += node->num_tokens();
    if (events_on_) log_event(true, true, node);
  }
  refresh(node);  // the only node on the path that can be a candidate
  maybe_compact();
  return {num_cached, node};
}

InsertOut RadixTree::insert_host(token_span key, const IndexRun& pages, std::uint32_t ns) {
  check_reentry("insert_host");
  OpScope scope(*this);
  TreeNode* node = root(ns);
  TreeNode* last_device = node;
  const std::int64_t clock = ++clock_;
  const auto ps = static_cast<std::size_t>(page_size_);
  std::size_t off = 0;
  const std::size_t n = key.size();
  try {
    while (off < n) {
      const auto it = node->children.find(PageKey{key.data() + off, ps});
      if (it == node->children.end()) break;
      TreeNode* child = it->second.get();
      const std::int64_t common = common_pages(child->tokens.span(), key.subspan(off));
      if (static_cast<std::size_t>(common) * ps < child->tokens.len) child = split(child, common);
      if (node->on_host() && node->num_host_children == 0) refresh_inner_host(node);
      node = child;
      node->last_access = clock;
      if (node->on_device()) last_device = node;
      off += node->tokens.len;
    }
  } catch (...) {
    refresh(last_device);  // an on_split hook raised (see match)
    if (node != last_device) refresh(node);
    throw;
  }
  const auto num_cached = static_cast<std::int64_t>(off);
  if (off < n) {
    node = new_child(node, TokenRun::copy_of(key.subspan(off)));
    node->host = pages
                     .slice(static_cast<std::int64_t>(off / ps),
                            static_cast<std::int64_t>((n - off) / ps))
                     .owned();
    node->last_access = clock;
    host_evictable_tokens += node->num_tokens();
    host_changed(node, false, false);
    if (events_on_) log_event(true, false, node);
  }
  // As in match: only the deepest device node and the last node can be candidates.
  refresh(last_device);
  if (node != last_device) refresh(node);
  maybe_compact();
  return {num_cached, node};
}

std::int64_t RadixTree::probe(token_span key, std::optional<std::uint32_t> ns,
                              std::vector<TreeNode*>* path) const {
  if (!ns) return 0;
  const TreeNode* node = roots_[*ns].get();
  const auto ps = static_cast<std::size_t>(page_size_);
  std::size_t off = 0;
  while (off < key.size()) {
    const auto it = node->children.find(PageKey{key.data() + off, ps});
    if (it == node->children.end()) break;
    TreeNode* child = it->second.get();
    if (path != nullptr) path->push_back(child);
    const std::int64_t common = common_pages(child->tokens.span(), key.subspan(off));
    if (static_cast<std::size_t>(common) * ps < child->tokens.len) {
      return static_cast<std::int64_t>(off) + common * page_size_;
    }
    off += child->tokens.len;
    node = child;
  }
  return static_cast<std::int64_t>(off);
}

// ------------------------------------------------------------------- locks
void RadixTree::lock(TreeNode* node) {
  check_reentry("lock");
  if (!node->on_device()) throw ValueError("lock: expected a device-resident node, got " + node->repr());
  if (node->parent == nullptr) {  // a root: the lock holds its namespace
    node->lock_ref += 1;
    return;
  }
  const bool comps = has_components();
  for (; node->parent != nullptr; node = node->parent) {
    if (node->lock_ref == 0) {
      device_evictable_tokens -= node->num_tokens();
      device_protected_tokens += node->num_tokens();
      if (comps) device_component_evictable_pages -= component_pages_on(node, false);
    }
    node->lock_ref += 1;
  }
}

void RadixTree::unlock(TreeNode* node) {
  check_reentry("unlock");
  OpScope scope(*this);
  if (node->parent == nullptr) {  // a root: its last lock may free its namespace
    if (node->lock_ref > 1) {
      node->lock_ref -= 1;
      free_if_empty(node);
    }
    return;
  }
  for (TreeNode* walk = node; walk->parent != nullptr; walk = walk->parent) {
    if (walk->lock_ref <= 0) {
      throw ValueError("unlock: node " + std::to_string(walk->id) + " on the path is not locked");
    }
  }
  TreeNode* deepest = node;
  std::vector<TreeNode*> unlocked;  // components: nodes whose last lock goes
  for (; node->parent != nullptr; node = node->parent) {
    node->lock_ref -= 1;
    if (node->lock_ref == 0) {
      device_protected_tokens -= node->num_tokens();
      device_evictable_tokens += node->num_tokens();
      if (has_components()) unlocked.push_back(node);
    }
  }
  // Ancestors have a device child on the path: only the deepest can be a candidate.
  refresh(deepest);
  for (TreeNode* n : unlocked) {  // their component data is evictable again
    device_component_evictable_pages += component_pages_on(n, false);
    refresh_records(n);
  }
}

void RadixTree::host_lock(TreeNode* node) {
  check_reentry("host_lock", true);
  if (!node->on_host() || node->parent == nullptr) {
    throw ValueError("host_lock: expected a non-root node with a host copy, got " + node->repr());
  }
  const bool was_busy = host_busy(node);
  const bool was_free = host_free(node);
  if (node->host_lock_ref == 0) {
    host_evictable_tokens -= node->num_tokens();
    host_protected_tokens += node->num_tokens();
  }
  node->host_lock_ref += 1;
  host_changed(node, true, was_busy);
  if (has_components()) host_free_changed(node, was_free);
}

void RadixTree::host_unlock(TreeNode* node) {
  check_reentry("host_unlock", true);
  if (node->host_lock_ref <= 0) {
    throw ValueError("host_unlock: node " + std::to_string(node->id) + " is not host-locked");
  }
  const bool was_busy = host_busy(node);
  const bool was_free = host_free(node);
  node->host_lock_ref -= 1;
  if (node->host_lock_ref == 0) {
    host_protected_tokens -= node->num_tokens();
    host_evictable_tokens += node->num_tokens();
    host_changed(node, true, was_busy);
    refresh(node);
  }
  if (has_components()) host_free_changed(node, was_free);
}

void RadixTree::raise_priority(TreeNode* node, std::int64_t priority) {
  check_reentry("raise_priority");
  OpScope scope(*this);
  const bool refresh_entries = policy_ == EvictionPolicy::Priority;
  for (; node->parent != nullptr; node = node->parent) {
    if (node->priority < priority) {
      node->priority = priority;
      if (refresh_entries) refresh(node);  // its heap entry's key changed
    }
  }
}

// ------------------------------------------------------- tier membership
void RadixTree::set_io_status(TreeNode* node, IOStatus status) {
  check_reentry("set_io_status", true);
  if (status != IOStatus::None && (!node->on_device() || !node->on_host())) {
    throw ValueError("set_io_status: IO in flight needs both copies, got " + node->repr());
  }
  const bool was_busy = host_busy(node);
  const bool was_free = host_free(node);
  node->io_status = status;
  host_changed(node, node->on_host(), was_busy);
  if (status == IOStatus::None) refresh(node);
  if (has_components()) host_free_changed(node, was_free);
}

void RadixTree::attach_device(TreeNode* node, const IndexRun& pages) {
  check_reentry("attach_device");
  if (node->on_device() || node->parent == nullptr) {
    throw ValueError("attach_device: expected a host-only node, got " + node->repr());
  }
  if (!node->parent->on_device()) {
    throw ValueError("attach_device: the parent must be on the device first");
  }
  const auto num_pages = static_cast<std::int64_t>(node->tokens.len) / page_size_;
  if (pages.num_pages != num_pages) {
    throw ValueError("attach_device: expected " + std::to_string(num_pages) + " pages, got " +
                     std::to_string(pages.num_pages));
  }
  node->device = pages.owned();
  node->parent->num_device_children += 1;
  device_evictable_tokens += node->num_tokens();
  if (events_on_) log_event(true, true, node);
  refresh(node);
}

at::Tensor RadixTree::detach_device(TreeNode* node) {
  check_reentry("detach_device");
  if (!node->on_device() || !node->on_host() || node->lock_ref != 0) {
    throw ValueError("detach_device: expected an unlocked node on both tiers, got " + node->repr());
  }
  if (node->num_device_children != 0) {
    throw ValueError("detach_device: a child is still on the device");
  }
  if (events_on_) log_event(false, true, node);
  const bool was_free = host_free(node);
  IndexRun pages = node->device;
  node->device.reset();
  node->parent->num_device_children -= 1;
  const bool was_busy = host_busy(node);
  node->io_status = IOStatus::None;
  host_changed(node, true, was_busy);
  device_evictable_tokens -= node->num_tokens();
  refresh(node);
  refresh(node->parent);
  if (!has_components()) return pages.tensor();
  host_free_changed(node, was_free);  // its IO status went back to none
  std::vector<IndexRun> runs{pages};
  drop_components(node, false, runs);
  return runs.size() == 1 ? pages.tensor() : concat(runs);
}

void RadixTree::attach_host(TreeNode* node, const IndexRun& pages) {
  check_reentry("attach_host", true);
  if (!node->on_device() || node->on_host() || node->parent == nullptr) {
    throw ValueError("attach_host: expected a device-only node, got " + node->repr());
  }
  const auto num_pages = static_cast<std::int64_t>(node->tokens.len) / page_size_;
  if (pages.num_pages != num_pages) {
    throw ValueError("attach_host: expected " + std::to_string(num_pages) + " pages, got " +
                     std::to_string(pages.num_pages));
  }
  node->host = pages.owned();
  host_evictable_tokens += node->num_tokens();
  host_changed(node, false, false);
  if (events_on_) log_event(true, false, node);
  refresh(node);
}

at::Tensor RadixTree::detach_host(TreeNode* node) {
  check_reentry("detach_host");
  if (!node->on_host() || !node->on_device() || node->host_lock_ref != 0) {
    throw ValueError("detach_host: expected a node on both tiers, host-unlocked, got " +
                     node->repr());
  }
  if (events_on_) log_event(false, false, node);
  const bool was_busy = host_busy(node);
  const bool was_free = host_free(node);
  IndexRun pages = node->host;
  node->host.reset();
  node->io_status = IOStatus::None;
  host_evictable_tokens -= node->num_tokens();
  host_changed(node, true, was_busy);
  refresh(node);
  if (!has_components()) return pages.tensor();
  host_free_changed(node, was_free);
  std::vector<IndexRun> runs{pages};
  drop_components(node, true, runs);
  return runs.size() == 1 ? pages.tensor() : concat(runs);
}

void RadixTree::merge_host_chain(TreeNode* node) {
  if (node->on_device() || node->host_lock_ref != 0 || node->io_status != IOStatus::None ||
      node->children.size() != 1) {
    return;
  }
  TreeNode* child = node->first_child;
  if (has_components() &&
      (component_pages_on(node, true) != 0 || component_pages_on(child, true) != 0)) {
    return;  // a window tail or a checkpoint sits at node's end
  }
  if (child->on_device() || child->host_lock_ref != 0 || child->io_status != IOStatus::None) {
    return;
  }
  const auto ps = static_cast<std::size_t>(page_size_);
  TreeNode* parent = node->parent;
  // The parent's key is a view into node's tokens: re-key it if they move to new storage.
  auto entry = parent->children.extract(node->first_page(ps));
  internal_check(!entry.empty() && entry.mapped().get() == node, "merge: not a child");
  node->tokens = TokenRun::join(node->tokens, child->tokens);
  node->host = IndexRun::join(node->host, child->host);
  entry.key() = node->first_page(ps);
  parent->children.insert(std::move(entry));

  auto owned = node->children.extract(node->children.begin());
  node->children = std::move(child->children);
  child->children.clear();
  node->first_child = child->first_child;
  node->last_child = child->last_child;
  child->first_child = child->last_child = nullptr;
  for (TreeNode* c = node->first_child; c != nullptr; c = c->next_sibling) c->parent = node;
  node->num_device_children = child->num_device_children;
  child->num_device_children = 0;
  // Both idle and host-only: node was busy exactly when child was.
  node->num_host_children = child->num_host_children;
  node->num_busy_host_children = child->num_busy_host_children;
  node->hit_count = std::max(node->hit_count, child->hit_count);
  node->last_access = std::max(node->last_access, child->last_access);
  node->created = std::min(node->created, child->created);
  node->priority = std::max(node->priority, child->priority);
  if (has_components()) {  // child's children are node's now (neither holds component data)
    for (std::size_t c = 0; c < comps_.size(); ++c) {
      node->comps[c].dev_children = child->comps[c].dev_children;
      node->comps[c].host_children = child->comps[c].host_children;
    }
  }
  child->parent = nullptr;
  --num_nodes;
  by_handle_.erase(child->handle);
  retire(std::move(owned.mapped()));  // its heap entries just go stale
}

void RadixTree::rehome_tokens(TreeNode* node) {
  TreeNode* parent = node->parent;
  auto entry = parent->children.extract(node->first_page(page_size_));
  internal_check(!entry.empty() && entry.mapped().get() == node, "rehome: not a child");
  node->tokens = TokenRun::copy_of(node->tokens.span());
  entry.key() = node->first_page(page_size_);  // the key is a view of the node's tokens
  parent->children.insert(std::move(entry));
}

void RadixTree::remove(TreeNode* node) {
  TreeNode* parent = node->parent;
  // A leaf evicted in parts leaves its prefix holding the storage of the whole
  // run: give the prefix storage of its own size so the dead tail is freed.
  if (parent->parent != nullptr && parent->tokens.storage == node->tokens.storage) {
    rehome_tokens(parent);
  }
  const auto it = parent->children.find(node->first_page(page_size_));
  internal_check(it != parent->children.end() && it->second.get() == node, "remove: not a child");
  std::unique_ptr<TreeNode> owned = std::move(it->second);
  parent->children.erase(it);
  unlink(parent, node);
  node->parent = nullptr;
  --num_nodes;
  by_handle_.erase(node->handle);
  retire(std::move(owned));
  refresh(parent);
  if (parent->parent == nullptr) free_if_empty(parent);  // a namespace left empty goes
}

void RadixTree::retire(std::unique_ptr<TreeNode> node) {
  if (node->exported) {
    const NodeHandle handle = node->handle;
    // Its namespace's index may be reused once the namespace is freed: keep the name.
    detached_ns_.insert_or_assign(handle, ns_names_[node->ns]);
    detached_.insert_or_assign(handle, std::move(node));
  } else {
    graveyard_.push_back(std::move(node));  // freed when the outermost operation returns
  }
}

void RadixTree::release_detached(const std::vector<NodeHandle>& keep) {
  std::unordered_map<NodeHandle, std::unique_ptr<TreeNode>> kept;
  for (NodeHandle h : keep) {
    if (auto it = detached_.find(h); it != detached_.end()) kept.emplace(h, std::move(it->second));
  }
  // Freed through the graveyard: a release from inside a hook must not free a
  // node an outer operation still points to.
  for (auto& [h, node] : detached_) {
    if (node) graveyard_.push_back(std::move(node));
  }
  detached_ = std::move(kept);
  std::erase_if(detached_ns_, [this](const auto& entry) { return !detached_.contains(entry.first); });
  if (depth_ == 0) graveyard_.clear();
}

// ---------------------------------------------------------------- eviction
int RadixTree::device_rank(const TreeNode* node) const {
  if (!node->on_device() || node->lock_ref != 0 || node->io_status != IOStatus::None ||
      node->parent == nullptr || node->num_device_children != 0) {
    return -1;
  }
  return 0;
}

int RadixTree::host_rank(const TreeNode* node) const {
  // No child with a host copy (children only on the device do not hold it back;
  // a host-only node's children all have host copies, so it must be a leaf).
  if (!node->on_host() || node->host_lock_ref != 0 || node->io_status != IOStatus::None ||
      node->num_host_children != 0 || node->parent == nullptr) {
    return -1;
  }
  return node->on_device() ? 1 : 0;
}

HeapEntry RadixTree::entry(const TreeNode* node, int rank, std::uint64_t seq) const {
  switch (policy_) {
    case EvictionPolicy::LRU: return {rank, node->last_access, 0, seq, node->handle};
    case EvictionPolicy::LFU: return {rank, node->hit_count, node->last_access, seq, node->handle};
    case EvictionPolicy::FIFO: return {rank, node->created, 0, seq, node->handle};
    case EvictionPolicy::MRU: return {rank, -node->last_access, 0, seq, node->handle};
    case EvictionPolicy::FILO: return {rank, -node->created, 0, seq, node->handle};
    case EvictionPolicy::Priority:
      return {rank, node->priority, node->last_access, seq, node->handle};
    case EvictionPolicy::SLRU:
      return {rank, node->hit_count >= kSlruProtectedHits ? 1 : 0, node->last_access, seq,
              node->handle};
  }
  return {rank, node->last_access, 0, seq, node->handle};
}

void RadixTree::push_device(TreeNode* node, int rank) {
  node->dev_seq = device_heap_.next_seq();
  device_heap_.push(entry(node, rank, node->dev_seq));
}

void RadixTree::push_host(TreeNode* node, int rank) {
  node->host_seq = host_heap_.next_seq();
  host_heap_.push(entry(node, rank, node->host_seq));
}

TreeNode* RadixTree::pop_device() {
  while (!device_heap_.empty()) {
    const HeapEntry e = device_heap_.pop();
    TreeNode* node = find(e.node);
    if (node == nullptr || e.seq != node->dev_seq) continue;
    const int rank = device_rank(node);
    if (rank < 0 || entry(node, rank, e.seq).key() != e.key()) continue;
    node->dev_seq = 0;
    return node;
  }
  return nullptr;
}

TreeNode* RadixTree::pop_host() {
  while (!host_heap_.empty()) {
    const HeapEntry e = host_heap_.pop();
    TreeNode* node = find(e.node);
    if (node == nullptr || e.seq != node->host_seq) continue;
    const int rank = host_rank(node);
    if (rank < 0 || entry(node, rank, e.seq).key() != e.key()) continue;
    node->host_seq = 0;
    return node;
  }
  return nullptr;
}

void RadixTree::refresh(TreeNode* node) {
  if (const int rank = device_rank(node); rank >= 0) push_device(node, rank);
  if (const int rank = host_rank(node); rank >= 0) push_host(node, rank);
  if (has_components()) refresh_records(node);
}

void RadixTree::refresh_inner_host(TreeNode* node) {
  if (node->parent == nullptr) return;
  if (const int rank = host_rank(node); rank >= 0) push_host(node, rank);
}

bool RadixTree::host_busy(const TreeNode* node) {
  return node->on_host() && (node->host_lock_ref != 0 || node->io_status != IOStatus::None ||
                             node->num_busy_host_children != 0);
}

void RadixTree::host_changed(TreeNode* node, bool was_on_host, bool was_busy) {
  const bool now_on_host = node->on_host();
  bool now_busy = host_busy(node);
  if (was_on_host && !was_busy) host_takeable_tokens -= node->num_tokens();
  if (now_on_host && !now_busy) host_takeable_tokens += node->num_tokens();
  TreeNode* parent = node->parent;
  if (parent == nullptr || parent->parent == nullptr) return;
  if (was_on_host != now_on_host) {
    parent->num_host_children += now_on_host ? 1 : -1;
    if (parent->num_host_children == 0) refresh(parent);
  }
  // A parent without a host copy is never busy: the walk stops there.
  while (was_busy != now_busy && parent->parent != nullptr) {
    was_busy = host_busy(parent);
    parent->num_busy_host_children += now_busy ? 1 : -1;
    now_busy = host_busy(parent);
    if (parent->on_host() && was_busy != now_busy) {
      host_takeable_tokens += now_busy ? -parent->num_tokens() : parent->num_tokens();
    }
    parent = parent->parent;
  }
}

void RadixTree::maybe_compact() {
  const std::int64_t limit = 4 * num_nodes + 1024;
  bool over = static_cast<std::int64_t>(device_heap_.size()) > limit ||
              static_cast<std::int64_t>(host_heap_.size()) > limit;
  for (const auto& heaps : comp_heaps_) {
    for (const auto& heap : heaps) over = over || static_cast<std::int64_t>(heap.size()) > limit;
  }
  if (over) compact();
}

void RadixTree::compact() {
  const std::vector<TreeNode*> all = nodes();
  std::vector<HeapEntry> fresh;
  for (TreeNode* node : all) {
    if (const int rank = device_rank(node); rank >= 0) {
      node->dev_seq = device_heap_.next_seq();
      fresh.push_back(entry(node, rank, node->dev_seq));
    }
  }
  device_heap_.rebuild(std::move(fresh));
  fresh = {};
  for (TreeNode* node : all) {
    if (const int rank = host_rank(node); rank >= 0) {
      node->host_seq = host_heap_.next_seq();
      fresh.push_back(entry(node, rank, node->host_seq));
    }
  }
  host_heap_.rebuild(std::move(fresh));
  if (has_components()) compact_components(all);
}

// Always a new tensor (one run too): what the tree returns is the caller's, and
// never aliases the index storage it keeps.
at::Tensor RadixTree::concat(const std::vector<IndexRun>& runs) const {
  std::int64_t total = 0;
  for (const auto& r : runs) total += r.num_pages;
  at::Tensor out = new_page_tensor(total);
  auto* dst = static_cast<page_id_t*>(out.data_ptr());
  for (const auto& r : runs) {
    if (r.num_pages == 0) continue;  // an empty tensor's data pointer may be null
    std::memcpy(dst, r.data(), static_cast<std::size_t>(r.num_pages) * sizeof(page_id_t));
    dst += r.num_pages;
  }
  return out;
}

bool RadixTree::call_backup(const BackupHook& backup, TreeNode* node) {
  HookScope hook(*this, Hook::Backup);
  return backup(node);
}

EvictOut RadixTree::evict_device(std::int64_t num_tokens, const BackupHook* backup) {
  check_reentry("evict_device");
  if (num_tokens < 0) throw ValueError("num_tokens: expected >= 0, got " + std::to_string(num_tokens));
  OpScope scope(*this);
  std::int64_t need = num_tokens / page_size_ + (num_tokens % page_size_ != 0);
  if (has_components()) return evict_device_hybrid(need, backup);
  EvictTally tally;
  TreeNode* node = nullptr;
  try {
    while (need > 0) {
      node = pop_device();
      if (node == nullptr) break;
      need -= evict_device_node(node, need, backup, tally);
    }
  } catch (...) {
    // A hook raised: the node it was running for and the skipped ones get
    // their heap entries back, so the tree stays consistent.
    for (TreeNode* n : tally.skipped) refresh(n);
    if (node != nullptr && node->parent != nullptr) refresh(node);
    throw;
  }
  for (TreeNode* n : tally.skipped) push_device(n, 0);
  maybe_compact();
  return tally_result(tally);
}

std::int64_t RadixTree::evict_device_node(TreeNode* node, std::int64_t need,
                                          const BackupHook* backup, EvictTally& tally) {
  if (!node->on_host() && node->first_child != nullptr && backup == nullptr) {
    tally.skipped.push_back(node);
    return 0;
  }
  std::int64_t num_pages = node->device.num_pages;
  if (num_pages > need) {
    split(node, num_pages - need);
    num_pages = need;
  }
  if (node->on_host()) {
    if (events_on_) log_event(false, true, node);
    tally.freed.push_back(node->device);
    node->device.reset();
    node->parent->num_device_children -= 1;
    device_evictable_tokens -= node->num_tokens();
    tally.num_freed += node->num_tokens();
    if (has_components()) num_pages += drop_components(node, false, tally.freed);
    merge_host_chain(node);
    refresh(node);
    refresh(node->parent);
  } else if (backup != nullptr && call_backup(*backup, node)) {
    tally.num_backup += node->num_tokens();
  } else if (node->first_child == nullptr && !node->on_host() &&
             node->io_status == IOStatus::None && node->parent != nullptr) {
    // (A backup hook that declined may have given the node a host copy or IO
    // in flight: then it is skipped like a node with children.)
    if (events_on_) log_event(false, true, node);
    tally.freed.push_back(node->device);
    device_evictable_tokens -= node->num_tokens();
    tally.num_freed += node->num_tokens();
    node->device.reset();
    node->parent->num_device_children -= 1;
    if (has_components()) num_pages += drop_components(node, false, tally.freed);
    remove(node);
  } else {
    tally.skipped.push_back(node);
    return 0;
  }
  return num_pages;
}

EvictOut RadixTree::tally_result(EvictTally& tally) const {
  at::Tensor pages = tally.freed.empty() ? new_page_tensor(0) : concat(tally.freed);
  return {pages, tally.num_freed, tally.num_backup};
}

EvictOut RadixTree::evict_host(std::int64_t num_tokens, bool drop_device_resident) {
  check_reentry("evict_host", true);
  if (num_tokens < 0) throw ValueError("num_tokens: expected >= 0, got " + std::to_string(num_tokens));
  OpScope scope(*this);
  std::int64_t need = num_tokens / page_size_ + (num_tokens % page_size_ != 0);
  if (has_components()) return evict_host_hybrid(need, drop_device_resident);
  EvictTally tally;
  while (need > 0) {
    TreeNode* node = pop_host();
    if (node == nullptr) break;
    if (node->on_device() && !drop_device_resident) {
      push_host(node, 1);
      break;
    }
    need -= evict_host_node(node, need, tally);
  }
  return tally_result(tally);
}

std::int64_t RadixTree::evict_host_node(TreeNode* node, std::int64_t need, EvictTally& tally) {
  std::int64_t num_pages = node->host.num_pages;
  if (num_pages > need) {
    try {
      split(node, num_pages - need);
    } catch (...) {
      refresh(node);  // an on_split hook raised: node keeps its heap entry
      throw;
    }
    num_pages = need;
  }
  if (events_on_) log_event(false, false, node);
  tally.freed.push_back(node->host);
  node->host.reset();
  host_evictable_tokens -= node->num_tokens();
  host_changed(node, true, false);  // a candidate is never busy
  tally.num_freed += node->num_tokens();
  if (has_components()) num_pages += drop_components(node, true, tally.freed);
  if (!node->on_device()) {
    remove(node);
  } else {
    refresh(node);
  }
  return num_pages;
}

// ---------------------------------------------------------------- KV events
std::vector<std::uint64_t> page_hashes(token_span tokens, std::int64_t page_size,
                                       std::uint64_t prev) {
  constexpr std::uint64_t kK = 0x100000001B3ULL;  // FNV-1a's 64-bit prime
  constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
  const auto ps = static_cast<std::size_t>(page_size);
  std::vector<std::uint64_t> out;
  out.reserve(tokens.size() / ps);
  for (std::size_t off = 0; off + ps <= tokens.size(); off += ps) {
    std::uint64_t poly = 0;
    std::uint64_t power = 1;
    for (std::size_t i = 0; i < ps; ++i) {
      power *= kK;
      poly += (static_cast<std::uint64_t>(tokens[off + i]) + 1) * power;
    }
    std::uint64_t z = prev * kGolden + poly + kGolden;  // splitmix64 of prev * golden + poly
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    prev = z ^ (z >> 31);
    out.push_back(prev);
  }
  return out;
}

std::pair<std::optional<std::uint64_t>, std::vector<std::uint64_t>> RadixTree::node_hashes(
    TreeNode* node) {
  // Hashed from the root each time: events are off by default, and a cached hash
  // per node would grow every node for them (the Python tree caches; same values).
  std::vector<const TreeNode*> path;
  for (const TreeNode* n = node->parent; n->parent != nullptr; n = n->parent) path.push_back(n);
  std::optional<std::uint64_t> prev;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    prev = page_hashes((*it)->tokens.span(), page_size_, prev.value_or(0)).back();
  }
  return {prev, page_hashes(node->tokens.span(), page_size_, prev.value_or(0))};
}

void RadixTree::log_event(bool stored, bool device, TreeNode* node) {
  if (node->parent == nullptr) return;  // a root holds no pages
  auto [parent, hashes] = node_hashes(node);
  events_.push_back(
      RawEvent{stored, device, ns_names_[node->ns], parent, std::move(hashes), node->num_tokens()});
}

// ----------------------------------------------------------------- queries
at::Tensor RadixTree::device_indices_of(TreeNode* node, const IndexRun* extra) const {
  // Two walks up the path (it is short): count and check, then fill from the end.
  const std::int64_t num_extra = extra != nullptr ? extra->num_pages : 0;
  std::int64_t total = num_extra;
  for (const TreeNode* n = node; n->parent != nullptr; n = n->parent) {
    if (!n->on_device()) {
      throw ValueError("device_indices_of: node " + std::to_string(n->id) +
                       " is not on the device");
    }
    total += n->device.num_pages;
  }
  at::Tensor out = new_page_tensor(total);
  if (total == 0) return out;  // an empty tensor's data pointer may be null
  page_id_t* end = static_cast<page_id_t*>(out.data_ptr()) + total;
  const auto put = [&end](const IndexRun& run) {
    if (run.num_pages == 0) return;
    end -= run.num_pages;
    std::memcpy(end, run.data(), static_cast<std::size_t>(run.num_pages) * sizeof(page_id_t));
  };
  if (num_extra != 0) put(*extra);
  for (const TreeNode* n = node; n->parent != nullptr; n = n->parent) put(n->device);
  return out;
}

std::vector<TreeNode*> RadixTree::path_missing_host(TreeNode* node,
                                                    std::int64_t min_hit_count) const {
  if (has_components()) return path_missing_host_hybrid(node, min_hit_count);
  std::vector<TreeNode*> path;
  for (; node->parent != nullptr; node = node->parent) {
    if (node->on_device() && !node->on_host() && node->io_status == IOStatus::None &&
        node->hit_count >= min_hit_count) {
      path.push_back(node);
    }
  }
  std::reverse(path.begin(), path.end());
  return path;
}

std::vector<TreeNode*> RadixTree::host_only_path(TreeNode* last,
                                                 const TreeNode* last_device) const {
  std::vector<TreeNode*> path;
  for (TreeNode* n = last; n != last_device; n = n->parent) {
    if (n->parent == nullptr) {
      throw ValueError("host_only_path: last_device_node is not an ancestor of last_node");
    }
    // (a hybrid match's host part may start below device nodes: those are not loaded)
    if (!has_components() || !n->on_device()) path.push_back(n);
  }
  std::reverse(path.begin(), path.end());
  return path;
}

// --------------------------------------------------------------- integrity
std::string RadixTree::check_integrity() const {
  const auto ps = static_cast<std::size_t>(page_size_);
  std::size_t num_roots = 0;
  for (std::size_t k = 0; k < roots_.size(); ++k) {
    const TreeNode* root = roots_[k].get();
    if (root == nullptr) {
      if (ns_names_[k]) return "a free namespace index keeps its name";
      continue;
    }
    ++num_roots;
    const auto it = root_order_.find(-root->handle);
    if (root->ns != k || root->parent != nullptr || root->lock_ref < 1 ||
        it == root_order_.end() || it->second != k) {
      return "root of namespace " + ns_repr(ns_names_[k]) + " corrupted";
    }
    const bool is_default = default_ns_ && *default_ns_ == k;
    if (is_default == static_cast<bool>(ns_names_[k])) {
      return "root of namespace " + ns_repr(ns_names_[k]) + " corrupted";
    }
    if (!is_default) {
      const auto named = ns_index_.find(std::string_view(*ns_names_[k]));
      if (named == ns_index_.end() || named->second != k) {
        return "namespace " + ns_repr(ns_names_[k]) + " is not indexed by its name";
      }
    }
  }
  if (num_roots != root_order_.size() || ns_index_.size() + (default_ns_ ? 1 : 0) != num_roots ||
      num_roots + free_ns_.size() != roots_.size()) {
    return "namespace accounting: " + std::to_string(num_roots) + " roots, " +
           std::to_string(root_order_.size()) + " in order, " + std::to_string(ns_index_.size()) +
           " names, " + std::to_string(free_ns_.size()) + " free of " +
           std::to_string(roots_.size());
  }
  std::unordered_map<std::uint64_t, const HeapEntry*> dev_live;
  std::unordered_map<std::uint64_t, const HeapEntry*> host_live;
  for (const auto& e : device_heap_.entries()) dev_live.emplace(e.seq, &e);
  for (const auto& e : host_heap_.entries()) host_live.emplace(e.seq, &e);
  // device evictable, device protected, host evictable, host protected, host takeable
  std::int64_t sums[5] = {0, 0, 0, 0, 0};
  std::vector<page_id_t> dev_pages;
  std::vector<page_id_t> host_pages;
  std::int64_t count = 0;
  for (const TreeNode* node : nodes()) {
    ++count;
    const std::string where =
        "node " + std::to_string(node->id) + " (" + ns_repr(ns_names_[node->ns]) + ")";
    const TreeNode* parent = node->parent;
    if (node->tokens.len == 0 || node->tokens.len % ps != 0) return where + ": key not whole pages";
    const auto it = parent->children.find(node->first_page(ps));
    if (it == parent->children.end() || it->second.get() != node) {
      return where + ": not keyed by first page";
    }
    if (node->ns != parent->ns) return where + ": namespace differs from parent";
    const auto num_pages = static_cast<std::int64_t>(node->tokens.len / ps);
    for (const auto& [name, idx] : {std::pair<const char*, const IndexRun*>{"device_indices", &node->device},
                                    {"host_indices", &node->host}}) {
      if (!idx->defined()) continue;
      if (idx->base.scalar_type() != at::kLong || idx->base.dim() != 1 ||
          !idx->base.is_contiguous()) {
        return where + ": " + name + " not int64";
      }
      if (idx->num_pages != num_pages) {
        return where + ": " + name + " has " + std::to_string(idx->num_pages) + " entries for " +
               std::to_string(num_pages) + " pages";
      }
      if (idx->offset < 0 || idx->offset + idx->num_pages > idx->base.size(0)) {
        return where + ": " + name + " window outside its tensor";
      }
    }
    if (!node->on_device() && !node->on_host()) return where + ": no copy in any tier";
    if (node->on_device()) {
      if (!parent->on_device()) return where + ": on the device but its parent is not";
      dev_pages.insert(dev_pages.end(), node->device.data(), node->device.data() + num_pages);
      sums[node->lock_ref != 0 ? 1 : 0] += node->num_tokens();
    }
    if (node->on_host()) {
      host_pages.insert(host_pages.end(), node->host.data(), node->host.data() + num_pages);
      sums[node->host_lock_ref != 0 ? 3 : 2] += node->num_tokens();
      if (!host_busy(node)) sums[4] += node->num_tokens();
    }
    if (node->lock_ref < 0 || node->host_lock_ref < 0) return where + ": negative lock";
    if (node->lock_ref != 0 && !node->on_device()) return where + ": locked but not on the device";
    if (parent->parent != nullptr && parent->lock_ref < node->lock_ref) {
      return where + ": locked more than its parent";
    }
    if (node->io_status != IOStatus::None && !(node->on_device() && node->on_host())) {
      return where + ": IO in flight without both copies";
    }
    std::uint32_t on_device_children = 0;
    std::uint32_t on_host_children = 0;
    std::uint32_t busy_children = 0;
    std::size_t num_linked = 0;
    for (const TreeNode* c = node->first_child; c != nullptr; c = c->next_sibling) {
      on_device_children += c->on_device() ? 1 : 0;
      on_host_children += c->on_host() ? 1 : 0;
      busy_children += host_busy(c) ? 1 : 0;
      ++num_linked;
    }
    if (on_host_children != node->num_host_children) {
      return where + ": counts " + std::to_string(node->num_host_children) +
             " children with a host copy, has " + std::to_string(on_host_children);
    }
    if (busy_children != node->num_busy_host_children) {
      return where + ": counts " + std::to_string(node->num_busy_host_children) +
             " busy host children, has " + std::to_string(busy_children);
    }
    if (num_linked != node->children.size()) return where + ": sibling order lost a child";
    if (on_device_children != node->num_device_children) {
      return where + ": device-child count is " + std::to_string(node->num_device_children) +
             ", children on the device " + std::to_string(on_device_children);
    }
    if (const int rank = device_rank(node); rank >= 0) {
      const auto e = dev_live.find(node->dev_seq);
      if (e == dev_live.end() || e->second->key() != entry(node, rank, node->dev_seq).key()) {
        return where + ": device eviction candidate without a current heap entry";
      }
    }
    if (const int rank = host_rank(node); rank >= 0) {
      const auto e = host_live.find(node->host_seq);
      if (e == host_live.end() || e->second->key() != entry(node, rank, node->host_seq).key()) {
        return where + ": host eviction candidate without a current heap entry";
      }
    }
  }
  if (count != num_nodes) {
    return "num_nodes is " + std::to_string(num_nodes) + ", tree has " + std::to_string(count);
  }
  const std::pair<const char*, std::int64_t> counters[5] = {
      {"device_evictable_tokens", device_evictable_tokens},
      {"device_protected_tokens", device_protected_tokens},
      {"host_evictable_tokens", host_evictable_tokens},
      {"host_protected_tokens", host_protected_tokens},
      {"host_takeable_tokens", host_takeable_tokens},
  };
  for (int i = 0; i < 5; ++i) {
    if (counters[i].second != sums[i]) {
      return std::string(counters[i].first) + " is " + std::to_string(counters[i].second) +
             ", nodes sum to " + std::to_string(sums[i]);
    }
  }
  for (auto* pages : {&dev_pages, &host_pages}) {
    std::sort(pages->begin(), pages->end());
    if (std::adjacent_find(pages->begin(), pages->end()) != pages->end()) {
      return std::string("a ") + (pages == &dev_pages ? "device" : "host") + " page is held twice";
    }
  }
  return has_components() ? check_components() : "";
}

std::size_t RadixTree::memory_bytes() const {
  // Hash-map nodes: next pointer + value (+ the cached hash for the child map,
  // whose hasher is not "fast" in libstdc++'s sense).
  const std::size_t child_entry = malloc_bytes(
      sizeof(void*) + sizeof(TreeNode::ChildMap::value_type) + sizeof(std::size_t));
  const std::size_t handle_entry =
      malloc_bytes(sizeof(void*) + sizeof(decltype(by_handle_)::value_type));
  std::size_t total = sizeof(RadixTree) + device_heap_.capacity_bytes() +
                      host_heap_.capacity_bytes() + by_handle_.bucket_count() * sizeof(void*) +
                      by_handle_.size() * handle_entry;
  std::unordered_set<const void*> token_storages;
  std::unordered_set<const void*> index_storages;
  std::unordered_set<const void*> tensor_impls;
  auto count_node = [&](const TreeNode* node) {
    total += malloc_bytes(sizeof(TreeNode));
    if (node->children.bucket_count() > 1) {
      total += malloc_bytes(node->children.bucket_count() * sizeof(void*));
    }
    total += node->children.size() * child_entry;
    if (node->tokens.storage && token_storages.insert(node->tokens.storage.get()).second) {
      total += malloc_bytes(2 * sizeof(void*) + node->tokens.storage_len * sizeof(token_t));
    }
    std::vector<const IndexRun*> runs{&node->device, &node->host};
    if (node->comps) {
      total += malloc_bytes(comps_.size() * sizeof(ComponentRecord));
      for (std::size_t c = 0; c < comps_.size(); ++c) {
        runs.push_back(&node->comps[c].device);
        runs.push_back(&node->comps[c].host);
      }
    }
    for (const IndexRun* idx : runs) {
      if (!idx->defined()) continue;
      if (tensor_impls.insert(idx->base.unsafeGetTensorImpl()).second) {
        total += malloc_bytes(sizeof(c10::TensorImpl));
      }
      const auto& storage = idx->base.storage();
      if (index_storages.insert(storage.unsafeGetStorageImpl()).second) {
        total += malloc_bytes(sizeof(c10::StorageImpl)) + malloc_bytes(storage.nbytes());
      }
    }
  };
  for (const auto& [serial, k] : root_order_) count_node(roots_[k].get());
  for (const auto& [h, node] : detached_) count_node(node.get());
  // Namespaces: the per-index slots, each name once, the name index and the order.
  total += roots_.capacity() * sizeof(roots_[0]) + ns_names_.capacity() * sizeof(ns_names_[0]) +
           free_ns_.capacity() * sizeof(std::uint32_t) + ns_index_.bucket_count() * sizeof(void*) +
           root_order_.size() * malloc_bytes(4 * sizeof(void*) + sizeof(decltype(root_order_)::value_type));
  for (const auto& name : ns_names_) {
    if (name) {
      total += malloc_bytes(2 * sizeof(void*) + sizeof(std::string)) +
               (name->size() > 15 ? malloc_bytes(name->size() + 1) : 0) +
               malloc_bytes(sizeof(void*) + sizeof(decltype(ns_index_)::value_type) + sizeof(std::size_t));
    }
  }
  for (const TreeNode* node : nodes()) count_node(node);
  return total;
}

}  // namespace hicache
