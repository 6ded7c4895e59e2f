// The native tree's components (hybrid models): records, counters, heap entries,
// serving a match, what an insert keeps, and eviction over full and component
// heaps. Each function mirrors its Python counterpart in hicache/tree/python/
// (hybrid_records.py, hybrid_paths.py, hybrid_eviction.py, hybrid.py) step for
// step, heap pushes included, so that both trees agree on every component.
#include <ATen/ops/empty.h>

#include <climits>
#include <cstring>
#include <unordered_set>

#include "tree.h"

namespace hicache {

// ------------------------------------------------------------------ records
void RadixTree::make_records(TreeNode* node) {
  node->comps = std::make_unique<ComponentRecord[]>(comps_.size());
}

std::int64_t RadixTree::component_pages_on(const TreeNode* node, bool host) const {
  if (!node->comps) return 0;
  std::int64_t total = 0;
  for (std::size_t c = 0; c < comps_.size(); ++c) total += node->comps[c].in(host).num_pages;
  return total;
}

void RadixTree::set_data(TreeNode* node, std::size_t c, bool host, IndexRun ids) {
  ComponentRecord& rec = node->comps[c];
  IndexRun& slot = rec.in(host);
  const bool had = slot.defined();
  const bool has = ids.defined();
  const std::int64_t delta = (has ? ids.num_pages : 0) - (had ? slot.num_pages : 0);
  const bool fresh = has && !rec.device.defined() && !rec.host.defined();
  slot = std::move(ids);
  comp_counts_[c][host ? 1 : 0] += delta;
  if (!host && node->lock_ref == 0) device_component_evictable_pages += delta;
  if (host && host_free(node)) host_component_takeable_pages += delta;
  if (fresh) rec.created = rec.last_access = clock_;  // new data: its eviction order starts now
  if (had == has) return;
  const ComponentKind& kind = comps_[c];
  TreeNode* parent = node->parent;
  if (kind.window && parent != nullptr && parent->parent != nullptr) {
    std::uint32_t& count = host ? parent->comps[c].host_children : parent->comps[c].dev_children;
    count = has ? count + 1 : count - 1;
    push_record(parent, c, host);
  }
  // The node's other records: whether a hit can end here changed with this one.
  for (std::size_t i = 0; i < comps_.size(); ++i) push_record(node, i, host);
  if (kind.window) {  // short children read this node's window pages for their hits
    for (TreeNode* child = node->first_child; child != nullptr; child = child->next_sibling) {
      if (kind.reads_parent(child->num_tokens() / page_size_)) push_record(child, c, host);
    }
  }
}

std::int64_t RadixTree::drop_components(TreeNode* node, bool host, std::vector<IndexRun>& freed) {
  std::int64_t total = 0;
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    const IndexRun ids = node->comps[c].in(host);
    if (!ids.defined()) continue;
    freed.push_back(ids);
    total += ids.num_pages;
    set_data(node, c, host, IndexRun{});
  }
  return total;
}

void RadixTree::split_components(TreeNode* prefix, TreeNode* suffix, std::int64_t num_pages) {
  make_records(prefix);
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    const ComponentKind& kind = comps_[c];
    ComponentRecord& pre = prefix->comps[c];
    ComponentRecord& suf = suffix->comps[c];
    for (const bool host : {false, true}) {
      IndexRun& ids = suf.in(host);
      if (!ids.defined()) continue;
      if (kind.window) {
        const std::int64_t cut = num_pages * kind.width;
        pre.in(host) = ids.slice(0, cut).owned();
        ids = ids.slice(cut, ids.num_pages - cut).owned();
      }
    }
    if (pre.device.defined() || pre.host.defined()) {
      pre.last_access = suf.last_access;
      pre.hit_count = suf.hit_count;
      pre.created = suf.created;
    }
    if (kind.window) {  // the prefix's only child is the suffix
      pre.dev_children = suf.device.defined() ? 1 : 0;
      pre.host_children = suf.host.defined() ? 1 : 0;
    }
  }
  // Same locks, same pages: the counters stand; ranks may move.
  refresh_records(prefix);
  refresh_records(suffix);
}

// --------------------------------------------------------------- candidates
bool RadixTree::unusable(const TreeNode* node, std::size_t c, bool host) const {
  bool dead = false;
  for (std::size_t i = 0; i < comps_.size(); ++i) {
    if (i != c && !node->comps[i].in(host).defined()) dead = true;
  }
  const ComponentKind& kind = comps_[c];
  if (!dead && kind.reads_parent(node->num_tokens() / page_size_)) {
    const TreeNode* parent = node->parent;
    dead = parent->parent != nullptr && !parent->comps[c].in(host).defined();
  }
  if (!dead) return false;
  if (kind.window) {
    const ComponentRecord& rec = node->comps[c];
    return (host ? rec.host_children : rec.dev_children) == 0;
  }
  return true;
}

int RadixTree::record_rank(const TreeNode* node, std::size_t c, bool host) const {
  // INT_MIN: not a candidate (rank -1 is a candidate's: data no hit can use).
  if (node->parent == nullptr || node->io_status != IOStatus::None) return INT_MIN;
  const ComponentRecord& rec = node->comps[c];
  if (!host) {
    if (!rec.device.defined() || node->lock_ref != 0) return INT_MIN;
    return unusable(node, c, false) ? -1 : 0;
  }
  if (!rec.host.defined() || node->host_lock_ref != 0) return INT_MIN;
  if (unusable(node, c, true)) return -1;
  return node->on_device() ? 1 : 0;
}

HeapEntry RadixTree::record_entry(const TreeNode* node, std::size_t c, int rank,
                                  std::uint64_t seq) const {
  const ComponentRecord& r = node->comps[c];
  switch (policy_) {
    case EvictionPolicy::LRU: return {rank, r.last_access, 0, seq, node->handle};
    case EvictionPolicy::LFU: return {rank, r.hit_count, r.last_access, seq, node->handle};
    case EvictionPolicy::FIFO: return {rank, r.created, 0, seq, node->handle};
    case EvictionPolicy::MRU: return {rank, -r.last_access, 0, seq, node->handle};
    case EvictionPolicy::FILO: return {rank, -r.created, 0, seq, node->handle};
    case EvictionPolicy::Priority: return {rank, node->priority, r.last_access, seq, node->handle};
    case EvictionPolicy::SLRU:
      return {rank, r.hit_count >= kSlruProtectedHits ? 1 : 0, r.last_access, seq, node->handle};
  }
  return {rank, r.last_access, 0, seq, node->handle};
}

void RadixTree::push_record(TreeNode* node, std::size_t c, bool host) {
  const int rank = record_rank(node, c, host);
  if (rank == INT_MIN) return;
  CandidateHeap& heap = comp_heaps_[host ? 1 : 0][c];
  std::uint64_t& seq = host ? node->comps[c].host_seq : node->comps[c].dev_seq;
  seq = heap.next_seq();
  heap.push(record_entry(node, c, rank, seq));
}

void RadixTree::refresh_records(TreeNode* node) {
  if (node->parent == nullptr || !node->comps || node->io_status != IOStatus::None) return;
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    if (node->comps[c].device.defined()) push_record(node, c, false);
    if (node->comps[c].host.defined()) push_record(node, c, true);
  }
}

void RadixTree::touch(TreeNode* node, std::size_t c) {
  ComponentRecord& rec = node->comps[c];
  rec.last_access = clock_;
  rec.hit_count += 1;
  if (rec.device.defined()) push_record(node, c, false);
  if (rec.host.defined()) push_record(node, c, true);
}

void RadixTree::host_free_changed(TreeNode* node, bool was_free) {
  const bool now_free = host_free(node);
  if (was_free != now_free) {
    const std::int64_t pages = component_pages_on(node, true);
    host_component_takeable_pages += now_free ? pages : -pages;
  }
  refresh_records(node);
}

void RadixTree::compact_components(const std::vector<TreeNode*>& all) {
  for (const bool host : {false, true}) {
    for (std::size_t c = 0; c < comps_.size(); ++c) {
      CandidateHeap& heap = comp_heaps_[host ? 1 : 0][c];
      std::vector<HeapEntry> fresh;
      for (TreeNode* node : all) {
        const int rank = record_rank(node, c, host);
        if (rank == INT_MIN) continue;
        std::uint64_t& seq = host ? node->comps[c].host_seq : node->comps[c].dev_seq;
        seq = heap.next_seq();
        fresh.push_back(record_entry(node, c, rank, seq));
      }
      heap.rebuild(std::move(fresh));
    }
  }
}

// ------------------------------------------------------------------ serving
std::vector<TreeNode*> RadixTree::path_of(TreeNode* node) const {
  std::vector<TreeNode*> path;
  for (; node->parent != nullptr; node = node->parent) path.push_back(node);
  std::reverse(path.begin(), path.end());
  return path;
}

std::pair<int, int> RadixTree::servable(const std::vector<PathStep>& path,
                                        std::size_t num_device) const {
  std::vector<std::int64_t> carry_device(comps_.size(), 0);
  std::vector<std::int64_t> carry_view(comps_.size(), 0);
  std::int64_t depth = 0;
  int best_device = -1;
  int best_host = -1;
  for (std::size_t i = 0; i < path.size(); ++i) {
    const PathStep& step = path[i];
    depth += step.num_pages;
    const bool on_device = i < num_device;
    bool ok_device = on_device;
    bool ok_view = true;
    for (std::size_t c = 0; c < comps_.size(); ++c) {
      const ComponentKind& kind = comps_[c];
      const ComponentRecord& rec = step.node->comps[c];
      bool held = rec.device.defined();
      bool viewed = on_device ? held : rec.host.defined();
      if (step.inside) {  // the prefix of a split there
        held = kind.split_prefix_holds(held);
        viewed = kind.split_prefix_holds(viewed);
      }
      ok_device = kind.serves(carry_device[c], held, step.num_pages, depth) && ok_device;
      ok_view = kind.serves(carry_view[c], viewed, step.num_pages, depth) && ok_view;
    }
    if (ok_device) {
      best_device = static_cast<int>(i);
    } else if (!on_device && ok_view) {
      best_host = static_cast<int>(i);
    }
  }
  return {best_device, std::max(best_device, best_host)};
}

void RadixTree::touch_hit(const std::vector<PathStep>& path, int i) {
  if (i < 0) return;
  std::int64_t depth = 0;
  for (int j = 0; j <= i; ++j) depth += path[static_cast<std::size_t>(j)].num_pages;
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    const ComponentKind& kind = comps_[c];
    std::int64_t need = kind.window ? std::min(kind.window_pages, depth) : 1;
    for (int j = i; need > 0 && j >= 0; --j) {
      const PathStep& step = path[static_cast<std::size_t>(j)];
      touch(step.node, c);
      need -= step.num_pages;
    }
  }
}

MatchOut RadixTree::serve(const MatchOut& full, std::uint32_t ns) {
  if (full.full_len == 0) return full;
  std::vector<PathStep> path;
  std::size_t num_device = 0;
  for (TreeNode* node : path_of(full.last)) {
    path.push_back({node, node->num_tokens() / page_size_, false});
    if (node->on_device()) ++num_device;
  }
  const auto [i_device, i_hit] = servable(path, num_device);
  touch_hit(path, i_hit);
  TreeNode* root_node = root(ns);
  std::int64_t device_pages = 0;
  std::int64_t hit_pages = 0;
  for (int j = 0; j <= i_hit; ++j) {
    const std::int64_t n = path[static_cast<std::size_t>(j)].num_pages;
    hit_pages += n;
    if (j <= i_device) device_pages += n;
  }
  return {device_pages * page_size_, (hit_pages - device_pages) * page_size_,
          i_device >= 0 ? path[static_cast<std::size_t>(i_device)].node : root_node,
          i_hit >= 0 ? path[static_cast<std::size_t>(i_hit)].node : root_node, full.full_len};
}

std::int64_t RadixTree::probe_hit(token_span key, std::optional<std::uint32_t> ns) const {
  std::vector<TreeNode*> nodes;
  std::int64_t left = probe(key, ns, &nodes) / page_size_;
  std::vector<PathStep> path;
  std::size_t num_device = 0;
  for (TreeNode* node : nodes) {
    const std::int64_t n = node->num_tokens() / page_size_;
    if (left <= 0) break;
    path.push_back({node, std::min(n, left), n > left});
    if (node->on_device()) ++num_device;
    left -= n;
  }
  const int i_hit = servable(path, num_device).second;
  std::int64_t pages = 0;
  for (int j = 0; j <= i_hit; ++j) pages += path[static_cast<std::size_t>(j)].num_pages;
  return pages * page_size_;
}

// ---------------------------------------------------------------- inserting
std::pair<InsertOut, at::Tensor> RadixTree::insert_components(token_span key,
                                                               const IndexRun& pages,
                                                               std::uint32_t ns,
                                                               const std::vector<IndexRun>& given) {
  OpScope scope(*this);
  const InsertOut r = insert(key, pages, ns);
  return {r, adopt(r.last, given, false)};
}

std::pair<InsertOut, at::Tensor> RadixTree::insert_host_components(
    token_span key, const IndexRun& pages, std::uint32_t ns, const std::vector<IndexRun>& given) {
  OpScope scope(*this);
  const InsertOut r = insert_host(key, pages, ns);
  return {r, adopt(r.last, given, true)};
}

at::Tensor RadixTree::adopt(TreeNode* last, const std::vector<IndexRun>& given, bool host) {
  bool any = false;
  for (const IndexRun& ids : given) any = any || ids.defined();
  if (!any) return at::empty({0}, at::kLong);
  const std::vector<TreeNode*> path = path_of(last);
  // The hit ends (hybrid_paths.py _hit_ends): branch points, the end the new
  // leaf hangs from, the last node.
  std::vector<TreeNode*> ends;
  if (!path.empty()) {
    for (std::size_t i = 0; i + 1 < path.size(); ++i) {
      if (path[i]->children.size() > 1) ends.push_back(path[i]);
    }
    TreeNode* end_node = path.back();
    if (end_node->created == clock_ && path.size() > 1 &&
        std::find(ends.begin(), ends.end(), path[path.size() - 2]) == ends.end()) {
      ends.push_back(path[path.size() - 2]);
    }
    ends.push_back(end_node);
  }
  std::unordered_map<const TreeNode*, std::int64_t> end_page;
  std::int64_t depth = 0;
  for (TreeNode* node : path) {
    depth += node->num_tokens() / page_size_;
    end_page[node] = depth;
  }
  std::vector<page_id_t> unused;
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    const IndexRun& ids = given[c];
    if (!ids.defined()) continue;
    const ComponentKind& kind = comps_[c];
    const page_id_t* data = ids.data();
    std::vector<bool> taken(static_cast<std::size_t>(ids.num_pages), false);
    for (TreeNode* end_node : ends) {
      std::int64_t end = end_page[end_node];
      const std::int64_t low = kind.kept_from(end);
      TreeNode* node = end_node;
      while (end > low && node->parent != nullptr) {
        const std::int64_t node_start = end - node->num_tokens() / page_size_;
        const bool has_copy = host ? node->on_host() : node->on_device();
        if (has_copy && !node->comps[c].in(host).defined()) {
          const std::int64_t first = kind.window ? std::max(node_start, low) : node_start;
          const std::int64_t lo = (kind.window ? first : end - 1) * kind.width;
          const std::int64_t hi = end * kind.width;
          bool all = true;
          for (std::int64_t k = lo; k < hi; ++k) all = all && data[k] >= 0;
          if (all) {
            if (first > node_start) split(node, first - node_start);  // a window split
            at::Tensor own = at::empty({hi - lo}, at::kLong);
            std::memcpy(own.data_ptr(), data + lo, static_cast<std::size_t>(hi - lo) * sizeof(page_id_t));
            set_data(node, c, host, IndexRun{std::move(own), 0, hi - lo});
            for (std::int64_t k = lo; k < hi; ++k) taken[static_cast<std::size_t>(k)] = true;
          }
        }
        end = node_start;
        node = node->parent;
      }
    }
    for (std::int64_t k = 0; k < ids.num_pages; ++k) {
      if (data[k] >= 0 && !taken[static_cast<std::size_t>(k)]) unused.push_back(data[k]);
    }
  }
  at::Tensor out = at::empty({static_cast<std::int64_t>(unused.size())}, at::kLong);
  if (!unused.empty()) {
    std::memcpy(out.data_ptr(), unused.data(), unused.size() * sizeof(page_id_t));
  }
  return out;
}

// -------------------------------------------------------------- one record
void RadixTree::attach_component(TreeNode* node, std::size_t c, bool host, const IndexRun& pages) {
  check_reentry("attach_component", true);
  const char* tier = host ? "host" : "device";
  if (node->parent == nullptr || !(host ? node->on_host() : node->on_device())) {
    throw ValueError(std::string("attach_component: expected a non-root node with a ") + tier +
                     " copy, got " + node->repr());
  }
  if (node->comps[c].in(host).defined()) {
    throw ValueError("attach_component: node " + std::to_string(node->id) +
                     " already holds component " + std::to_string(c) + " in " + tier);
  }
  const std::int64_t expected = comps_[c].num_ids(node->num_tokens() / page_size_);
  if (pages.num_pages != expected) {
    throw ValueError("attach_component: expected " + std::to_string(expected) +
                     " page ids, got " + std::to_string(pages.num_pages));
  }
  if (expected != 0) {
    const page_id_t low = *std::min_element(pages.data(), pages.data() + expected);
    if (low < 0) {
      throw ValueError("attach_component: expected page ids >= 0, got " + std::to_string(low));
    }
  }
  set_data(node, c, host, pages.owned());
}

at::Tensor RadixTree::detach_component(TreeNode* node, std::size_t c, bool host) {
  check_reentry("detach_component");
  const IndexRun ids = node->comps ? node->comps[c].in(host) : IndexRun{};
  const std::int64_t locked = host ? node->host_lock_ref : node->lock_ref;
  if (!ids.defined() || locked != 0 || node->io_status != IOStatus::None) {
    throw ValueError("detach_component: expected a node holding component " + std::to_string(c) +
                     " in " + (host ? "host" : "device") +
                     ", unlocked there, with no IO in flight, got " + node->repr());
  }
  set_data(node, c, host, IndexRun{});
  return ids.tensor();
}

at::Tensor RadixTree::component_table(TreeNode* node, std::size_t c, bool host) const {
  const ComponentKind& kind = comps_[c];
  const std::vector<TreeNode*> path = path_of(node);
  std::int64_t total = 0;
  for (const TreeNode* n : path) total += n->num_tokens() / page_size_ * kind.width;
  at::Tensor out = at::empty({total}, at::kLong);
  auto* dst = static_cast<page_id_t*>(out.data_ptr());
  for (const TreeNode* n : path) {
    const std::int64_t num_ids = n->num_tokens() / page_size_ * kind.width;
    const IndexRun& ids = n->comps[c].in(host);
    const std::int64_t held = ids.defined() ? ids.num_pages : 0;
    std::fill(dst, dst + num_ids - held, page_id_t{-1});
    if (held != 0) std::memcpy(dst + num_ids - held, ids.data(), held * sizeof(page_id_t));
    dst += num_ids;
  }
  return out;
}

std::vector<TreeNode*> RadixTree::path_missing_host_hybrid(TreeNode* node,
                                                           std::int64_t min_hit_count) const {
  std::vector<TreeNode*> path;
  for (; node->parent != nullptr; node = node->parent) {
    if (!node->on_device() || node->io_status != IOStatus::None ||
        node->hit_count < min_hit_count) {
      continue;
    }
    bool lacks = !node->on_host();
    for (std::size_t c = 0; !lacks && c < comps_.size(); ++c) {
      lacks = node->comps[c].device.defined() && !node->comps[c].host.defined();
    }
    if (lacks) path.push_back(node);
  }
  std::reverse(path.begin(), path.end());
  return path;
}

// ----------------------------------------------------------------- eviction
std::optional<HeapEntry> RadixTree::peek_device() {
  while (!device_heap_.empty()) {
    const HeapEntry e = device_heap_.top();
    const TreeNode* node = find(e.node);
    if (node != nullptr && e.seq == node->dev_seq) {
      const int rank = device_rank(node);
      if (rank >= 0 && entry(node, rank, e.seq).key() == e.key()) return e;
    }
    device_heap_.pop();
  }
  return std::nullopt;
}

std::optional<HeapEntry> RadixTree::peek_host() {
  while (!host_heap_.empty()) {
    const HeapEntry e = host_heap_.top();
    const TreeNode* node = find(e.node);
    if (node != nullptr && e.seq == node->host_seq) {
      const int rank = host_rank(node);
      if (rank >= 0 && entry(node, rank, e.seq).key() == e.key()) return e;
    }
    host_heap_.pop();
  }
  return std::nullopt;
}

bool RadixTree::peek_record(std::size_t c, bool host) {
  CandidateHeap& heap = comp_heaps_[host ? 1 : 0][c];
  while (!heap.empty()) {
    const HeapEntry e = heap.top();
    const TreeNode* node = find(e.node);
    if (node != nullptr && e.seq == (host ? node->comps[c].host_seq : node->comps[c].dev_seq)) {
      const int rank = record_rank(node, c, host);
      if (rank != INT_MIN && record_entry(node, c, rank, e.seq).key() == e.key()) return true;
    }
    heap.pop();
  }
  return false;
}

std::optional<std::pair<HeapEntry, std::size_t>> RadixTree::best_component(bool host) {
  std::optional<std::pair<HeapEntry, std::size_t>> best;
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    if (!peek_record(c, host)) continue;
    const HeapEntry& e = comp_heaps_[host ? 1 : 0][c].top();
    if (!best ||
        std::tie(e.rank, e.p1, e.p2) < std::tie(best->first.rank, best->first.p1, best->first.p2)) {
      best = std::make_pair(e, c);
    }
  }
  return best;
}

EvictOut RadixTree::evict_component(std::size_t c, bool host, std::int64_t num_pages) {
  check_reentry("evict_component", true);
  if (num_pages < 0) throw ValueError("num_pages: expected >= 0, got " + std::to_string(num_pages));
  OpScope scope(*this);
  EvictTally tally;
  std::int64_t need = num_pages;
  while (need > 0 && peek_record(c, host)) need -= evict_record(c, host, tally);
  return tally_result(tally);
}

std::int64_t RadixTree::evict_record(std::size_t c, bool host, EvictTally& tally) {
  CandidateHeap& heap = comp_heaps_[host ? 1 : 0][c];
  const HeapEntry e = heap.pop();  // best_component left it on top
  TreeNode* node = find(e.node);
  ComponentRecord& rec = node->comps[c];
  (host ? rec.host_seq : rec.dev_seq) = 0;
  const IndexRun ids = rec.in(host);
  set_data(node, c, host, IndexRun{});
  tally.freed.push_back(ids);
  return ids.num_pages;
}

namespace {
bool before(const HeapEntry& a, const HeapEntry& b) {
  return std::tie(a.rank, a.p1, a.p2) < std::tie(b.rank, b.p1, b.p2);
}
}  // namespace

EvictOut RadixTree::evict_device_hybrid(std::int64_t need, const BackupHook* backup) {
  EvictTally tally;
  TreeNode* node = nullptr;
  try {
    while (need > 0) {
      const std::optional<HeapEntry> full = peek_device();
      const auto comp = best_component(false);
      if (comp && (!full || before(comp->first, *full))) {
        need -= evict_record(comp->second, false, tally);
        continue;
      }
      if (!full) break;
      node = pop_device();
      need -= evict_device_node(node, need, backup, tally);
    }
  } catch (...) {
    for (TreeNode* n : tally.skipped) refresh(n);
    if (node != nullptr && node->parent != nullptr) refresh(node);
    throw;
  }
  for (TreeNode* n : tally.skipped) push_device(n, 0);
  maybe_compact();
  return tally_result(tally);
}

EvictOut RadixTree::evict_host_hybrid(std::int64_t need, bool drop_device_resident) {
  EvictTally tally;
  while (need > 0) {
    const std::optional<HeapEntry> full = peek_host();
    const auto comp = best_component(true);
    if (comp && (!full || before(comp->first, *full))) {
      if (comp->first.rank >= 1 && !drop_device_resident) break;
      need -= evict_record(comp->second, true, tally);
      continue;
    }
    if (!full) break;
    TreeNode* node = find(full->node);
    if (node->on_device() && !drop_device_resident) break;
    pop_host();
    need -= evict_host_node(node, need, tally);
  }
  return tally_result(tally);
}

// ---------------------------------------------------------------- integrity
std::string RadixTree::check_components() const {
  std::vector<std::array<std::int64_t, 2>> counts(comps_.size(), {0, 0});
  std::int64_t evictable = 0;
  std::int64_t takeable = 0;
  std::vector<page_id_t> pages[2];
  std::vector<std::unordered_map<std::uint64_t, const HeapEntry*>> live[2];
  for (const bool host : {false, true}) {
    for (const CandidateHeap& heap : comp_heaps_[host ? 1 : 0]) {
      auto& seqs = live[host ? 1 : 0].emplace_back();
      for (const auto& e : heap.entries()) seqs.emplace(e.seq, &e);
    }
  }
  for (const auto& root : roots_) {
    if (!root) continue;  // a free namespace index
    if (!root->comps) return "a root without its component records";
    for (std::size_t c = 0; c < comps_.size(); ++c) {
      if (root->comps[c].device.defined() || root->comps[c].host.defined()) {
        return "a root holds component data";
      }
    }
  }
  for (const TreeNode* node : nodes()) {
    const std::string where = "node " + std::to_string(node->id);
    if (!node->comps) return where + ": not one record per component";
    for (const bool host : {false, true}) {
      const IndexRun& full = host ? node->host : node->device;
      if (full.defined()) pages[host].insert(pages[host].end(), full.data(), full.data() + full.num_pages);
    }
    const std::int64_t num_pages = node->num_tokens() / page_size_;
    for (std::size_t c = 0; c < comps_.size(); ++c) {
      const ComponentKind& kind = comps_[c];
      const ComponentRecord& rec = node->comps[c];
      const std::string comp = "component " + std::to_string(c);
      for (const bool host : {false, true}) {
        const IndexRun& ids = rec.in(host);
        const char* tier = host ? "host" : "device";
        if (!ids.defined()) continue;
        if (!(host ? node->on_host() : node->on_device())) {
          return where + ": " + comp + " in " + tier + " without the node's " + tier + " copy";
        }
        if (ids.num_pages != kind.num_ids(num_pages)) {
          return where + ": " + comp + " holds " + std::to_string(ids.num_pages) + " ids in " +
                 tier + ", expected " + std::to_string(kind.num_ids(num_pages));
        }
        pages[host].insert(pages[host].end(), ids.data(), ids.data() + ids.num_pages);
        counts[c][host ? 1 : 0] += ids.num_pages;
        if (!host && node->lock_ref == 0) evictable += ids.num_pages;
        if (host && host_free(node)) takeable += ids.num_pages;
        const int rank = record_rank(node, c, host);
        if (rank != INT_MIN) {
          const std::uint64_t seq = host ? rec.host_seq : rec.dev_seq;
          const auto& seqs = live[host ? 1 : 0][c];
          const auto e = seqs.find(seq);
          if (e == seqs.end() || e->second->key() != record_entry(node, c, rank, seq).key()) {
            return where + ": " + comp + " is a " + tier +
                   " eviction candidate without a current heap entry";
          }
        }
      }
      if (kind.window) {
        std::uint32_t dev = 0;
        std::uint32_t host = 0;
        for (const TreeNode* ch = node->first_child; ch != nullptr; ch = ch->next_sibling) {
          dev += ch->comps[c].device.defined() ? 1 : 0;
          host += ch->comps[c].host.defined() ? 1 : 0;
        }
        if (dev != rec.dev_children || host != rec.host_children) {
          return where + ": miscounts children holding " + comp;
        }
      }
    }
  }
  for (std::size_t c = 0; c < comps_.size(); ++c) {
    if (counts[c] != comp_counts_[c]) {
      return "component " + std::to_string(c) + " counts " + std::to_string(comp_counts_[c][0]) +
             ", " + std::to_string(comp_counts_[c][1]) + " page ids (device, host), nodes hold " +
             std::to_string(counts[c][0]) + ", " + std::to_string(counts[c][1]);
    }
  }
  if (evictable != device_component_evictable_pages) {
    return "device_component_evictable_pages is " +
           std::to_string(device_component_evictable_pages) + ", nodes sum to " +
           std::to_string(evictable);
  }
  if (takeable != host_component_takeable_pages) {
    return "host_component_takeable_pages is " + std::to_string(host_component_takeable_pages) +
           ", nodes sum to " + std::to_string(takeable);
  }
  for (const bool host : {false, true}) {
    auto& all = pages[host ? 1 : 0];
    std::sort(all.begin(), all.end());
    if (std::adjacent_find(all.begin(), all.end()) != all.end()) {
      return std::string("a ") + (host ? "host" : "device") +
             " page is held twice (full and component pages share one page space)";
    }
  }
  return "";
}

}  // namespace hicache
