// LOCKS on CUDA (sm_90a): batched page-summary build (Alg. 1), fused score pass (Eq. 4, one read
// of each summary for the whole GQA group), group-average shares + exact top-k with sink and recent
// pages (Eq. 5, Alg. 2 lines 6-9), sparse and dense paged decode attention (split-K + LSE merge).
//
// Every kernel has a Params struct and a host wrapper `cudaError_t fn(const Params&, cudaStream_t)`
// that only enqueues work: no allocation, no host synchronisation, so a whole decode step
// (score -> select -> attention -> merge) can be captured in a CUDA graph. Wrappers return the
// launch error (cudaGetLastError) or cudaErrorInvalidValue for shapes they do not support.
//
// Device layouts (all pointers are device memory):
//   KV pool, per layer:   K, V [n_pages_pool][n_head_kv][16][head_dim] f16 or bf16 (the CPU
//                         PagedKvCache layout of one layer, so a layer uploads with one memcpy).
//   Page table (CSR, FlashInfer): indptr [batch + 1], indices [indptr[batch]] page ids,
//                         last_page_len [batch] in 1..16 (tokens in the last page). int32.
//                         Sequence b has n_pages_b = indptr[b+1] - indptr[b] pages, position j of
//                         its page table is page id indices[indptr[b] + j].
//   Summaries, per layer: one record of summary_record_bytes(head_dim) bytes per (KV head, page id),
//                         records[(kv_head * n_pages_pool + page) * record_bytes] (832 B at d = 128,
//                         512 B at d = 64, 16-byte aligned), plus tails[kv_head * n_pages_pool + page]
//                         float (tau, diagnostics only). Format: rank 8, int4 basis with one f16
//                         scale per column, int8 coefficients with one f16 scale per token, int8
//                         centroid with one f16 scale: the CPU SummaryFormat{8, 4, 8, 8}, stored in
//                         the order the score kernel's lanes read it (see pack_summary_record).
//   Queries:              q [batch][n_head_kv * group][head_dim] float32, post-RoPE; query head
//                         n uses KV head n / group (llama.cpp / HF GQA order).
// Supported: head_dim 64 or 128; group 1..16 (any value, 5, 6, 7 included); page size 16.
//
// Bad device-side input (checked on the device, at a small cost: docs/cuda-design.md): a sequence
// whose page count is negative (indptr not ascending) or above what the launch covers, whose
// last_page_len is outside 1..16, or whose page table holds an id outside [0, n_pages_pool), is never
// read or written out of bounds. Its outputs become NaN (o, lse, lse_total; n_selected = -1) and a bit of the optional
// status word is set (DecodeStatus; read it with read_decode_status). Other sequences are unaffected.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace locks::cuda {

constexpr int kPageSize = 16;    // B
constexpr int kSummaryRank = 8;  // r
constexpr int kMaxGroup = 16;    // G
constexpr int kHistBins = 2048;  // top-k histogram over share bits 30..20

enum class KvType : int { kF16 = 0, kBF16 = 1 };

/// Bits of the status word (`status` in the Params below; one per DecodePlan workspace).
enum DecodeStatus : uint32_t {
  kStatusBadPageCount = 1u,    // n_pages_b < 0 (indptr descending) or above the launch's page capacity
  kStatusBadLastPageLen = 2u,  // last_page_len[b] outside 1..16 for a sequence with pages
  kStatusBadPageId = 4u,       // a page id outside [0, n_pages_pool)
  kStatusBadKeys = 8u,         // summary_build: a page's keys are not finite (its record is NaN)
};
/// "page count out of range (indptr descending, or more pages than the plan covers: max_pages); ..."
/// (empty for 0; bits outside DecodeStatus are listed as "unknown status bits 0x..").
std::string describe_decode_status(uint32_t status);

/// Bytes of one summary record on the device: 832 at head_dim 128, 512 at 64, 0 for any other
/// head_dim (no device format).
size_t summary_record_bytes(int head_dim);

/// One layer's paged KV cache on the device with its CSR page table.
struct PagedKvView {
  const void* k = nullptr;  // [n_pages_pool][n_head_kv][16][head_dim]
  const void* v = nullptr;  // same
  KvType dtype = KvType::kF16;
  int n_head_kv = 0;
  int head_dim = 0;                        // 64 or 128
  int batch = 0;                           // sequences
  const int32_t* indptr = nullptr;         // [batch + 1]
  const int32_t* indices = nullptr;        // [indptr[batch]] page ids
  const int32_t* last_page_len = nullptr;  // [batch], 1..16
  // Page ids must be < n_pages_pool; 0: not checked (the decode steps then use theirs). The attention
  // kernels read page 0 in place of a bad entry (and discard it), so a pool is at least one page.
  int n_pages_pool = 0;
};

// ----------------------------------------------------------------------------------------------
/// Alg. 1 for a batch of pages, every KV head: centroid, 16x16 Gram eigendecomposition (one warp per
/// (page, KV head): float64 centroid and Gram matrix, parallel cyclic Jacobi in float32, eigenvalues
/// refined in float64 by Rayleigh quotients), rank-8 basis / coefficients / tail, quantized on the
/// fly. Pages of identical keys or rank < 8 give zero basis columns (exact, no NaN). The records
/// agree with the CPU's float64 build up to float32 eigenvectors: directions whose eigenvalue is
/// below ~1e-7 of the page's largest are not resolved (their share of the page's keys is as small),
/// and an int4/int8 code sits one step apart here and there (on random pages rank-8 reconstructions
/// within ~1e-2, log-masses within ~2e-3 nats, the tail within 1e-4 relative, as the tests check;
/// the eigenvalues are Rayleigh quotients of the float64 Gram matrix, so well-separated ones agree
/// with the CPU's far closer). A page with NaN or Inf keys (or keys beyond ~1e18,
/// whose Gram matrix float32 cannot hold) gets a NaN centroid scale (every score NaN), a NaN tail and
/// kStatusBadKeys (the CPU build throws), never an out-of-bounds access.
/// Launch contract: grid = ceil(n_layers * n_pages * n_head_kv / 4) CTAs of 128 threads, ~15 KB (d 128)
/// shared memory per warp; reads 16 * head_dim * 2 bytes of K per item, writes one record + one tail.
struct SummaryBuildParams {
  const void* k = nullptr;  // K pool of the layer (see PagedKvView)
  KvType dtype = KvType::kF16;
  int n_head_kv = 0;
  int head_dim = 0;
  const int32_t* pages = nullptr;  // [n_pages] page ids to summarise (full pages); -1: skipped
  int n_pages = 0;
  int n_pages_pool = 0;
  uint8_t* records = nullptr;  // [n_head_kv][n_pages_pool][record_bytes]
  float* tails = nullptr;      // [n_head_kv][n_pages_pool], nullable
  uint32_t* status = nullptr;  // nullable: kStatusBadPageId (an id outside the pool: skipped), kStatusBadKeys
  /// Several layers in one launch: a decoded page fills in every layer at once, and the launch is
  /// latency-bound, so L layers cost about what one does (docs/cuda-design.md). Layer l
  /// reads K at k + l * k_layer_stride elements and writes records + l * records_layer_stride bytes,
  /// tails + l * tails_layer_stride floats; the same page ids in every layer. With n_layers > 1 the
  /// strides must keep the layers apart (k_layer_stride >= n_pages_pool * n_head_kv * 16 * head_dim, or
  /// 0 to read one pool for every layer; records_layer_stride >= n_head_kv * n_pages_pool *
  /// record_bytes; tails_layer_stride >= n_head_kv * n_pages_pool) and keep 16-byte alignment
  /// (k_layer_stride a multiple of 8, records_layer_stride of 16), else cudaErrorInvalidValue.
  int n_layers = 1;
  size_t k_layer_stride = 0;
  size_t records_layer_stride = 0;
  size_t tails_layer_stride = 0;
};
cudaError_t summary_build(const SummaryBuildParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Eq. 4 for every page of every sequence and KV head, all G query heads from one read of each
/// summary: log_mass[b][h][g][j] = s_hat_j(q_g), natural log of the page's mass of exp(scale * q.k)
/// (nats, as the CPU's PageSummaryStore::score). The last page of a sequence, when partial
/// (last_page_len < 16), has no summary: its exact log-mass is computed from its keys, as the CPU
/// selector does. Also produces the per-head normaliser of the shares (Eq. 5):
/// lse_total[b][h][g] = logsumexp_j log_mass[b][h][g][j] (-inf for a sequence without pages), or,
/// with defer_lse_total, leaves it to select_pages.
/// Launch contract: `grid` persistent CTAs of 128 threads walk the work items (b, h, chunk c)
/// round-robin; an item scores positions [c * chunk_pages, (c + 1) * chunk_pages) (balance_chunks: its
/// sequence's run-time chunk size), each warp 8 pages
/// (an octet) at a time (int8 tensor cores: Q x basis, Q x centroid; f16: W x coefficients). G <= 8:
/// records arrive by one bulk copy (TMA) each into a ring of octet slots shared by the CTA's warps
/// (10 slots, 66.6 KB of shared memory at d 128, 3 CTAs/SM); G > 8: by cp.async into two stages per
/// warp (53 KB, 2 CTAs/SM). Records must be 16-byte aligned (record_bytes is a multiple of 16).
/// Every item writes its chunk's
/// (max, sum) (an empty chunk (-inf, 0), bad input NaN) and the last item of (b, h) merges them
/// (with defer_lse_total, select_pages does). counters has batch * n_head_kv entries, zero before the
/// first launch and left zero afterwards.
struct ScoreParams {
  const float* q = nullptr;            // [batch][n_head_kv * group][head_dim], 16-byte aligned
  PagedKvView kv;                      // page table; K read only for partial last pages
  const uint8_t* summaries = nullptr;  // records of this layer
  int n_pages_pool = 0;                // records per KV head; page ids must be < n_pages_pool
  int group = 1;                       // G, 1..16
  float scale = 0.0f;                  // softmax scale, usually 1/sqrt(head_dim)
  int chunk_pages = 0;                 // multiple of 32
  int n_chunks = 0;                    // >= ceil(max_b n_pages_b / chunk_pages)
  float* log_mass = nullptr;           // out [batch][n_head_kv][group][log_mass_stride]
  int log_mass_stride = 0;             // >= max_b n_pages_b, multiple of 8
  float* lse_total = nullptr;          // out [batch][n_head_kv][group]
  float* chunk_stats = nullptr;        // workspace [batch][n_head_kv][16][n_chunks][2]: (max, sum), log2 units
  uint32_t* counters = nullptr;        // workspace [batch * n_head_kv], zero-initialised
  int grid = 0;                        // persistent CTAs; 0: enough to fill the device
  bool pdl = false;                    // launch with programmatic dependent launch
  /// Leave the merge of the chunk statistics into lse_total to select_pages, which must then get them
  /// (SelectParams::chunk_stats): no CTA here waits for the others of its (b, h). lse_total is then
  /// -inf for a sequence without pages, NaN for the others (select_pages overwrites it; without
  /// chunk_stats it gives n_selected = -1 for them instead of using a stale value).
  bool defer_lse_total = false;
  /// Size the chunks from the page table at run time instead of chunk_pages: sequence b gets a_b
  /// chunks per KV head, a_b = 1 + floor(n_b * (S - batch) / sum n) with S = grid / n_head_kv
  /// (so sum_b a_b <= S while S >= batch; else a_b = 1 and CTAs take several items), capped at
  /// n_chunks and at one chunk per 32 pages; one sequence alone gets min(n_chunks, S) chunks without a
  /// page-table read. Chunks are a multiple of 32 pages. A batch of one long and many short sequences
  /// thus keeps the whole grid busy. chunk_stats holds n_chunks entries per (b, h, row); those past
  /// a_b are written empty. The decode plan sets it (DecodePlan::score_balance).
  bool balance_chunks = false;
  /// Nullable. Bad input (see the top of this file): page count above the pass's capacity
  /// (log_mass_stride; without balance_chunks also n_chunks * chunk_pages), last_page_len
  /// outside 1..16, a page id outside [0, n_pages_pool) (never read) -> lse_total NaN (with
  /// defer_lse_total: once select_pages has merged the chunk statistics); that sequence's log_mass
  /// values are then unspecified.
  uint32_t* status = nullptr;
  /// Nullable: workspace [batch * n_head_kv], zero before the first launch; not with
  /// defer_lse_total (cudaErrorInvalidValue). With it, the last active item of (b, h) (after its
  /// lse_total merge), or item 0 for bad input or an empty sequence, adds 1 to
  /// ready[b * n_head_kv + h] once the pair's log_mass, chunk statistics and lse_total are visible
  /// at the GPU (nothing of the pair is written after that), so that the one-kernel select
  /// (SelectParams::score_ready) starts on that pair while other pairs are still being scored. Each
  /// launch with it must be followed by exactly one select_pages with score_ready (as
  /// locks_decode_step does); init_decode_workspace resets both sides.
  uint32_t* ready = nullptr;
};
/// Counters a ScoreParams needs (batch * n_head_kv).
inline size_t score_counters(int batch, int n_head_kv) { return size_t(batch) * n_head_kv; }
cudaError_t score_pages(const ScoreParams& p, cudaStream_t stream);

/// The oracle's scores: every page's exact log-mass s_j(q) = log sum_t exp(scale q . k_t) over its keys
/// (the partial last page masked to last_page_len tokens), in score_pages's output format, and the
/// share normaliser lse_total (the CPU twin: exact_log_mass, src/core/summary_score.cpp; the oracle
/// selector reads the whole K cache, so this is a ceiling, not a fast path). Float32 arithmetic on
/// the stored bf16/f16 keys. Bad input (a page count outside [0, log_mass_stride], last_page_len
/// outside 1..16, a page id outside [0, kv.n_pages_pool) when that is set) -> that sequence's (or
/// page's) log_mass and its lse_total NaN, so select_pages gives it n_selected = -1.
/// Launch contract: grid (ceil(log_mass_stride / 4), n_head_kv, batch) x 128 threads (a warp per
/// page), then (group, n_head_kv, batch) x 32 threads for lse_total. head_dim a multiple of 16, <= 256.
struct ExactScoreParams {
  int batch = 0;
  const float* q = nullptr;  // [batch][n_head_kv * group][head_dim], 16-byte aligned
  PagedKvView kv;
  int group = 1;               // G, 1..16
  float scale = 0.0f;          // softmax scale
  float* log_mass = nullptr;   // out [batch][n_head_kv][group][log_mass_stride]
  int log_mass_stride = 0;     // >= max_b n_pages_b
  float* lse_total = nullptr;  // out [batch][n_head_kv][group]
  uint32_t* status = nullptr;  // nullable
};
cudaError_t exact_page_scores(const ExactScoreParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Group-average shares and the selected set (Alg. 2 lines 6-9): share m_bar_j = mean_g
/// exp(log_mass[g][j] - lse_total[g]); keep page 0 (sink), page n-1 (recent) and the top-(k-2) other
/// pages by share, ties to the lower page index (exact: a 2048-bin histogram of the share's float
/// bits narrows the threshold, then a radix select on (share bits, ~index) resolves it). Output
/// positions ascending; n_b <= k selects every page. A sequence with a NaN lse_total (bad input, see
/// score_pages; with chunk_stats: NaN statistics) or more pages than log_mass_stride gets
/// n_selected = -1 and no selection. Two kernels: shares +
/// histogram (grid (ceil(stride / 1024), n_head_kv, batch) x 256 threads) and select (grid (n_head_kv, batch) x 1024
/// threads, one CTA per GQA group). hist must be zero before the first launch; left zero afterwards.
/// With cluster_pages (below) one kernel instead: the same shares and selection, bit for bit.
struct SelectParams {
  int batch = 0;
  int n_head_kv = 0;
  int group = 1;
  const int32_t* indptr = nullptr;  // [batch + 1] (n_pages_b)
  const float* log_mass = nullptr;  // [batch][n_head_kv][group][log_mass_stride]
  int log_mass_stride = 0;
  float* lse_total = nullptr;     // [batch][n_head_kv][group]: in; out with chunk_stats
  int budget_pages = 2;           // k >= 2
  uint32_t* keys = nullptr;       // workspace [batch][n_head_kv][log_mass_stride]
  uint32_t* hist = nullptr;       // workspace [batch][n_head_kv][kHistBins], zero-initialised
  int32_t* selected = nullptr;    // out [batch][n_head_kv][budget_pages] page positions
  int32_t* n_selected = nullptr;  // out [batch][n_head_kv] = min(k, n_pages_b)
  float* shares = nullptr;        // optional out [batch][n_head_kv][log_mass_stride]
  bool pdl = false;
  /// With pdl: read indptr before waiting for the previous kernel. Valid when that kernel does not
  /// write the page table (score_pages inside locks_decode_step).
  bool pdl_early_reads = false;
  /// Nullable: the score pass's chunk statistics ([batch][n_head_kv][16][n_chunks][2], log2 units;
  /// required after a pass with defer_lse_total). Every CTA of the first kernel then merges lse_total
  /// itself (one round trip instead of the score pass's last-CTA chain), and CTA 0 of each (b, h)
  /// writes it to `lse_total` for sequences with pages, which is then an output.
  const float* chunk_stats = nullptr;
  int n_chunks = 0;
  /// Nullable (both or neither): workspace candidates [batch][n_head_kv][log_mass_stride] and
  /// n_candidates [batch][n_head_kv][ceil(log_mass_stride / 1024)]. With them, each CTA of the first
  /// kernel (1024 pages) also lists its pages whose share is in or above its own threshold bin for the
  /// k - 2 largest (a superset of the selection's share of them), and select scans those lists instead
  /// of every key (about 1 / 8 of them with a 128-page budget). The decode plan uses them while the
  /// first kernel fits in one wave (DecodePlan::select_candidates).
  unsigned long long* candidates = nullptr;
  int32_t* n_candidates = nullptr;
  /// 0: the two kernels above. Otherwise one kernel: each (sequence, KV head) is one thread-block
  /// cluster of C = ceil(log_mass_stride / cluster_pages) CTAs of 1024 threads (C <=
  /// kSelectClusterMaxCtas), CTA r taking pages [r * cluster_pages, (r + 1) * cluster_pages), 4 per
  /// thread and round of loads (4096 pages a round; shared memory ~10 KB static + 57 KB + 4.125 bytes
  /// per page: 198 KB at kClusterSelectPages); the CTAs
  /// exchange their histograms, the threshold bin's candidates and their counts through distributed
  /// shared memory (three or four cluster barriers), so keys, hist and candidates are not used.
  /// cluster_pages: a multiple of 32, at most kClusterSelectPages. The decode plan uses it where the
  /// clusters of a step fit at once (DecodePlan::select_cluster_pages). The CTAs of a cluster must
  /// agree on a sequence's page count, so indptr must not change while the kernel runs (with
  /// pdl_early_reads: the previous kernel must not write it); else the kernel may hang.
  int cluster_pages = 0;
  /// Nullable, one-kernel select only (cluster_pages != 0; else cudaErrorInvalidValue): the score
  /// pass's ScoreParams::ready, and ready_seen, workspace [batch][n_head_kv][kSelectClusterMaxCtas]
  /// zero before the first launch. Each CTA then waits for its (b, h)'s count to pass its own
  /// ready_seen entry (and advances it) instead of waiting for the whole score grid (the PDL wait;
  /// indptr is then read before the wait whatever pdl_early_reads says): with pdl, the selection of
  /// one pair overlaps the scoring of others. The score grid must be resident before this kernel's
  /// CTAs (as a PDL launch after it guarantees), and every score launch with `ready` must be followed
  /// by one launch of this kernel with the same cluster_pages, else a later launch reads a pair before
  /// it is scored (run init_decode_workspace after changing either); a select whose count does not
  /// come within 10 s stops with a device-side message and a launch failure instead of hanging.
  const uint32_t* score_ready = nullptr;
  uint32_t* ready_seen = nullptr;
};
constexpr int kClusterSelectPages = 32768;
constexpr int kSelectClusterMaxCtas = 16;  // CTAs per cluster of the one-kernel select
cudaError_t select_pages(const SelectParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Exact decode attention of each GQA group over a list of its pages (sparse: `selected`, as
/// select_pages writes it; dense: every page when `selected` is null). One CTA per (split, KV head,
/// sequence) handles the whole group (G query heads as the rows of m16n8k16 MMAs, K and V read once
/// for the group, f32 accumulation); splits are merged by log-sum-exp in the last CTA of each
/// (sequence, KV head), by a merge kernel when there are many splits, or (cluster_merge) inside the
/// thread-block cluster the splits form. The partial last page is masked to last_page_len tokens. An
/// empty page list gives o = 0 and lse = -inf. Bad input (see the top of this file; dense: more pages
/// than n_splits * pages_per_split; sparse: n_selected < 0, or above selected_stride or
/// n_splits * pages_per_split, kStatusBadPageCount) gives o = NaN and lse = NaN for the whole group.
/// A non-finite q or scale is not checked on the device: it gives NaN outputs for its group (the CPU
/// twin refuses it). A position listed twice is attended twice.
/// Launch contract: grid (n_splits, n_head_kv, batch) x 128 threads (2 n_splits with group_halves
/// and G > 8: CTAs 2s and 2s + 1 take heads [0, 8) and [8, G) of split s); split s handles list entries
/// [s * pages_per_split, (s + 1) * pages_per_split). counters must be zero before the first launch;
/// left zero afterwards (required with n_splits > 1; not used with cluster_merge or where the merge
/// kernel runs, n_splits > merge_kernel_above).
struct AttentionParams {
  const float* q = nullptr;  // [batch][n_head_kv * group][head_dim]
  PagedKvView kv;
  int group = 1;
  float scale = 0.0f;
  const int32_t* selected = nullptr;    // [batch][n_head_kv][selected_stride] positions, or null
  const int32_t* n_selected = nullptr;  // [batch][n_head_kv]
  int selected_stride = 0;
  int pages_per_split = 0;  // >= 1
  int n_splits = 0;
  float* o = nullptr;            // out [batch][n_head_kv * group][head_dim] float32
  float* lse = nullptr;          // out [batch][n_head_kv * group] natural log, nullable
  float* partial_o = nullptr;    // workspace [batch][n_head_kv][n_splits][16][head_dim]
  float* partial_lse = nullptr;  // workspace [batch][n_head_kv][n_splits][16]
  uint32_t* counters = nullptr;  // workspace [batch][n_head_kv], zero-initialised
  bool pdl = false;
  /// With pdl: read q and the page table before waiting for the previous kernel (only `selected`
  /// and `n_selected` after). Valid when the previous kernel in the stream produced only those
  /// (select_pages inside locks_decode_step).
  bool pdl_early_reads = false;
  /// Above this many splits the LSE merge runs as a second kernel (grid (group, n_head_kv, batch))
  /// instead of in the last CTA of each (sequence, KV head): one CTA merging up to 1 MB of partials
  /// is latency-bound.
  int merge_kernel_above = 16;
  /// G > 8 only: run each split as two CTAs of at most 8 heads (rows [0, 8) and [8, G)), the second
  /// reading K/V mostly from the L2, instead of one CTA with all G heads as MMA rows.
  bool group_halves = false;
  /// Dense only (ignored with `selected`), batch > 1: share the grid's n_splits * batch CTAs per KV
  /// head among the sequences in proportion to their pages, instead of n_splits each. Sequence b gets
  /// a_b = 1 + floor(n_b * (S - batch) / sum n) splits of ceil(n_b / a_b) pages (S = n_splits *
  /// batch), at most attention_max_splits() and one per 4 pages; a sequence with a bad page count
  /// counts as empty (its one CTA reports it). So sequences shorter than the plan's bound, or one long
  /// sequence among short ones, keep the whole grid busy. partial_o / partial_lse are then indexed
  /// [n_head_kv][S][16][head_dim] and [n_head_kv][S][16] (the same sizes). A sequence's splits depend
  /// on the others' lengths, so its output can differ in the last bits between batches (off:
  /// batch-invariant). The split merge runs where the plan's n_splits puts it (merge_kernel_above),
  /// also for a sequence that gets more splits than n_splits.
  bool balance_splits = false;
  /// Sparse only (needs `selected`), n_splits <= 16, one CTA per split (not group_halves with G > 8):
  /// launch the splits of each (sequence, KV head) as one thread-block cluster and merge them through
  /// distributed shared memory, instead of partials in global memory merged by the last CTA (two
  /// cluster barriers in place of a store, fence, atomic and reload; partial_o, partial_lse,
  /// counters and merge_kernel_above are not used). Clusters above 8 CTAs are non-portable
  /// (H100/H200: up to 16; elsewhere the launch fails with the runtime's error); see
  /// DecodePlan::sparse_cluster_merge for when the plan uses it. Invalid combinations:
  /// cudaErrorInvalidValue.
  bool cluster_merge = false;
  uint32_t* status = nullptr;  // nullable: DecodeStatus bits for bad input
};
cudaError_t paged_decode_attention(const AttentionParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
/// Plan/run for a whole LOCKS (or dense) decode step of one layer. The plan fixes the grid sizes
/// for an upper bound on the pages per sequence, so one captured graph replays for any lengths
/// up to it. The workspace is one device allocation of `workspace_bytes`.
struct DecodeShape {
  int batch = 1;
  int n_head_kv = 1;
  int group = 1;
  int head_dim = 128;
  KvType dtype = KvType::kF16;
  int max_pages = 1;       // upper bound on n_pages_b
  int budget_pages = 128;  // k (LOCKS budget in pages, b = 16 k tokens)
};
struct DecodePlan {
  DecodeShape shape;
  int n_sm = 0;
  int score_chunk_pages = 0, score_chunks = 0;
  int log_mass_stride = 0;
  int sparse_pages_per_split = 0, sparse_splits = 0;
  int dense_pages_per_split = 0, dense_splits = 0;
  bool sparse_group_halves = false;  // AttentionParams::group_halves of the sparse attention
  /// AttentionParams::cluster_merge of the sparse attention: on when the sparse splits (2 to 16, one
  /// CTA each) of every (sequence, KV head) fit as clusters in one wave on the plan's device.
  bool sparse_cluster_merge = false;
  bool defer_lse_total = false;    // ScoreParams::defer_lse_total (select_pages merges lse_total)
  bool score_balance = true;       // ScoreParams::balance_chunks (score_chunks is then its capacity); read-only
  bool dense_balance = true;       // AttentionParams::balance_splits of the dense step
  int score_equal_chunks = 0;      // chunks per (sequence, KV head) when all have max_pages pages
  bool select_candidates = false;  // SelectParams::candidates (the share kernel fits in one wave); read-only
  int select_cluster_pages = 0;    // SelectParams::cluster_pages (0: two kernels); read-only
  bool pdl = true;
  size_t workspace_bytes = 0;
  // Byte offsets inside the workspace.
  size_t off_log_mass = 0, off_lse_total = 0, off_chunk_stats = 0, off_keys = 0, off_candidates = 0,
         off_n_candidates = 0, off_hist = 0, off_selected = 0, off_n_selected = 0, off_partial_o = 0,
         off_partial_lse = 0, off_counters = 0, off_counters_sparse = 0, off_counters_dense = 0, off_status = 0,
         off_score_ready = 0, off_ready_seen = 0;
  int score_grid = 0;
  size_t counters_bytes = 0;
};
/// Sizes the grids from `device`'s SM count and the kernels' occupancy on it (default -1: the current
/// device; the current device is restored on return). Launch the plan's kernels on that device.
/// `balance` (default): the score pass's chunks and the dense step's splits follow the sequences'
/// actual lengths at run time (score_balance, dense_balance), so ragged batches keep the GPU busy;
/// false gives every sequence the same share, sized by max_pages, and batch-invariant results (a
/// sequence's output then does not depend on the other sequences of the batch).
/// The score pass's CTAs per SM come from the first device this process plans for (cached).
/// Throws std::invalid_argument for unsupported shapes (head_dim, group, budget, a batch, n_head_kv
/// or max_pages below 1) and std::runtime_error when the device cannot be used ("CUDA decode: no
/// device", "no device N", ...).
DecodePlan make_decode_plan(const DecodeShape& shape, int device = -1, bool balance = true);
/// Whether locks_decode_step starts the one-kernel select on each (sequence, KV head) as the score
/// pass completes it (ScoreParams::ready / SelectParams::score_ready): with select_cluster_pages and
/// pdl, where the score pass merges lse_total itself (not defer_lse_total).
bool select_per_pair(const DecodePlan& plan);
/// Zero the histograms, the last-CTA and per-pair ready counters and the status word of a workspace
/// (once before the first step, and after a failed one).
cudaError_t init_decode_workspace(const DecodePlan& plan, void* workspace, cudaStream_t stream);

/// LOCKS step: score_pages -> select_pages -> sparse paged_decode_attention (+ merge).
struct DecodeStepParams {
  const float* q = nullptr;  // [batch][n_head_kv * group][head_dim], 16-byte aligned (score_pages)
  PagedKvView kv;
  const uint8_t* summaries = nullptr;
  /// Page ids of the pool (the summaries hold n_pages_pool records per KV head); also the page-id
  /// check of the attention kernels when kv.n_pages_pool is 0.
  int n_pages_pool = 0;
  float scale = 0.0f;
  float* o = nullptr;    // [batch][n_head_kv * group][head_dim]
  float* lse = nullptr;  // nullable
  void* workspace = nullptr;
};
/// Enqueues the three launches (no host synchronisation; capturable in a CUDA graph). Returns the
/// first launch error; after an error, run init_decode_workspace before the next step (a score pass
/// may have been enqueued without its select, which would leave the per-pair counters out of step).
cudaError_t locks_decode_step(const DecodePlan& plan, const DecodeStepParams& p, cudaStream_t stream);
/// Oracle step: exact_page_scores -> select_pages -> sparse paged_decode_attention, the selection rule
/// and budget of the LOCKS step with exact page log-masses (the `oracle` selector of the CPU). Needs no
/// summaries (p.summaries is not read). Capturable; errors as locks_decode_step.
cudaError_t oracle_decode_step(const DecodePlan& plan, const DecodeStepParams& p, cudaStream_t stream);
/// Dense step over every page (same kernel, more splits).
cudaError_t dense_decode_step(const DecodePlan& plan, const DecodeStepParams& p, cudaStream_t stream);
/// The launches a step makes, one by one (for benchmarks that time them apart): the parameters
/// locks_decode_step passes to score_pages, select_pages and (sparse) paged_decode_attention, and
/// dense_decode_step to paged_decode_attention.
/// paired: the score pass and the select are launched together, one after the other, as
/// locks_decode_step does; where select_per_pair(plan), the select then starts on each (sequence,
/// KV head) as the score pass completes it (ScoreParams::ready, SelectParams::score_ready). Pass the
/// same value to both; unpaired (the default), each waits for the whole previous kernel (PDL), so a
/// score pass may also be launched alone.
ScoreParams step_score_params(const DecodePlan& plan, const DecodeStepParams& p, bool paired = false);
SelectParams step_select_params(const DecodePlan& plan, const DecodeStepParams& p, bool paired = false);
AttentionParams step_attention_params(const DecodePlan& plan, const DecodeStepParams& p, bool sparse);

/// The workspace's status word (DecodeStatus bits, set by any step since the last clear), copied to
/// the host: synchronises `stream`. With clear, resets it to 0 (also stream-ordered).
cudaError_t read_decode_status(const DecodePlan& plan, void* ws, uint32_t* status, bool clear, cudaStream_t stream);

/// Views into a plan's workspace (for tests and diagnostics).
float* plan_log_mass(const DecodePlan& plan, void* ws);
float* plan_lse_total(const DecodePlan& plan, void* ws);
int32_t* plan_selected(const DecodePlan& plan, void* ws);
int32_t* plan_n_selected(const DecodePlan& plan, void* ws);

// ----------------------------------------------------------------------------------------------
// Host helpers (no device needed).

/// Quantize a float summary exactly as the CPU PageSummaryStore does (f16 scales rounded first,
/// codes against the rounded scale, round-half-even) and write the device record.
///   centroid [d], basis [8][d] (row k = basis column k), coef [16][8]; out: record_bytes(d) bytes.
/// Throws std::invalid_argument on unsupported d or a scale that overflows f16.
void pack_summary_record(const float* centroid, const float* basis, const float* coef, int d, uint8_t* out);
/// Dequantize a device record: centroid [d], basis [8][d], coef [16][8].
void unpack_summary_record(const uint8_t* rec, int d, float* centroid, float* basis, float* coef);

/// True when a CUDA device is usable (tests skip otherwise); `why` says why not.
bool device_available(std::string* why = nullptr);
/// "NVIDIA H200 (sm_90), 132 SMs, 140 GiB, L2 60 MiB, CUDA runtime 13.0, driver 13.0".
std::string device_description(int device = -1);

}  // namespace locks::cuda
